"""Print the model's predictions for afd-plugin's DeepSeek-V3.2 W8A8 decode on Ascend 910C
next to the published figures, and how the signs move when the assumed inputs move.

Run: ``python packages/afd-plan/benchmarks/published_910c.py`` (no device, no engine; the
inputs and figures are those of ``tests/test_plan_published_afd_plugin.py``).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from afd_plan.errors import AFDPlanMemoryError
from afd_plan.hardware import load_profile
from afd_plan.plan import Candidate, predict
from afd_plan.shape import shape_from_config
from afd_plan_inputs import DEEPSEEK_V32
from test_plan_published_afd_plugin import (
    DEPLOYMENTS,
    LENGTHS,
    PUBLISHED,
    predicted,
    rates,
    workload,
)


def _row(name: str, got: dict[int, dict[str, float]]) -> str:
    cells = []
    for n in LENGTHS:
        ep, pub_ep = got[n]["EP64"], PUBLISHED[n]["EP64"]
        g, p = got[n][name], PUBLISHED[n][name]
        rel = "" if name == "EP64" else f" ({g / ep - 1:+.1%} vs {p / pub_ep - 1:+.1%})"
        cells.append(f"{g:7.1f} / {p:6.1f}{rel}")
    return f"{name:>6}  " + "  |  ".join(cells)


def main() -> None:
    base = load_profile("ascend-910c-die")
    preds = predicted(base)
    print("tokens/s per die, predicted / published (gain vs EP64: predicted vs published)")
    print("          16K" + " " * 38 + "32K")
    for name in DEPLOYMENTS:
        print(_row(name, rates(preds)))
    for n in LENGTHS:
        for name, p in preds[n].items():
            print(
                f"  {n:>5} {name:>6}: S={p.candidate.stages} TPOT {p.tpot_s * 1e3:.1f} ms, "
                f"binds {p.binding}"
            )
    shape = shape_from_config(DEEPSEEK_V32)
    try:
        predict(shape, workload(32768, "model"), base, Candidate(64, 16, 2, 28, "w8a8"))
    except AFDPlanMemoryError as e:
        print(f"bf16 KV at 32K: {e}")
    print("\nsensitivity: 64:16 / 48:16 gain vs EP64 at 16K and 32K; OK = published order")
    grid = itertools.product(
        (0.1e-6, 1e-6, 2e-6),  # message_overhead
        (5e-6, 20e-6),  # link_latency
        (0.8, 0.2, 0.055),  # kv_efficiency
        (0.6, 0.3),  # compute_efficiency
        (0.8, 0.5),  # memory_efficiency
    )
    hits = 0
    for mo, lat, kv, ce, me in grid:
        hw = base.with_overrides(
            message_overhead=mo,
            link_latency=lat,
            kv_efficiency=kv,
            compute_efficiency=ce,
            memory_efficiency=me,
        )
        got = rates(predicted(hw))
        ok = all(r["64:16"] > r["EP64"] > r["48:16"] for r in got.values())
        hits += ok
        gains = "  ".join(
            f"{got[n]['64:16'] / got[n]['EP64'] - 1:+6.1%}/{got[n]['48:16'] / got[n]['EP64'] - 1:+6.1%}"
            for n in LENGTHS
        )
        print(
            f"msg {mo * 1e6:3.1f}us lat {lat * 1e6:2.0f}us kv_eff {kv:<5} compute {ce} "
            f"memory {me}: {gains}{'  OK' if ok else ''}"
        )
    print(f"{hits} settings reproduce the published order")


if __name__ == "__main__":
    main()
