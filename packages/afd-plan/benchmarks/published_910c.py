"""Print the model's predictions for afd-plugin's DeepSeek-V3.2 W8A8 decode on Ascend 910C
next to the published figures, and how they move when the assumed inputs move.

Run: ``python packages/afd-plan/benchmarks/published_910c.py`` (no device, no engine; the
inputs and figures are those of ``tests/test_plan_published_afd_plugin.py``).
"""

from __future__ import annotations

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
    EXCHANGE_LATENCY_S,
    LENGTHS,
    PUBLISHED,
    fit_kv_efficiency,
    predicted,
    published_order,
    rates,
    run_profile,
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


def _gains(got: dict[int, dict[str, float]]) -> str:
    return "  ".join(
        f"{n // 1024}K {got[n]['64:16'] / got[n]['EP64'] - 1:+6.1%} / "
        f"{got[n]['48:16'] / got[n]['EP64'] - 1:+6.1%}"
        for n in LENGTHS
    )


def main() -> None:
    preds = predicted()
    print(
        f"exchange latency {EXCHANGE_LATENCY_S * 1e6:.0f} us (assumed), DSA kv_efficiency "
        f"{fit_kv_efficiency(EXCHANGE_LATENCY_S)} (fitted to EP64 alone)"
    )
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
    base = load_profile("ascend-910c-die")
    try:
        predict(shape, workload(32768, "model"), base, Candidate(64, 16, 2, 28, "w8a8"))
    except AFDPlanMemoryError as e:
        print(f"bf16 KV at 32K: {e}")

    print("\nthe profile as shipped (10 us, DSA at its roofline): 64:16 / 48:16 vs EP64")
    print("  " + _gains(rates(predicted(base))))
    print("\nexchange latency (DSA refitted to EP64 at each): 64:16 / 48:16 vs EP64")
    for us in range(10, 201, 10):
        hw = run_profile(us * 1e-6)
        got = rates(predicted(hw))
        ok = "  OK" if published_order(got) else ""
        print(f"  {us:3d} us kv_eff {hw.kv_efficiency:.4f}: {_gains(got)}{ok}")
    print("\nother inputs at the assumed latency: 64:16 / 48:16 vs EP64")
    run = run_profile()
    for label, changes in (
        ("compute efficiency 0.3", {"compute_efficiency": 0.3}),
        ("memory efficiency 0.5", {"memory_efficiency": 0.5}),
        ("message 1 us a peer", {"message_overhead": 1e-6}),
        ("message 2 us a peer", {"message_overhead": 2e-6}),
        ("link efficiency 0.5", {"link_efficiency": 0.5}),
    ):
        got = rates(predicted(run.with_overrides(**changes)))
        print(f"  {label:<24} {_gains(got)}{'  OK' if published_order(got) else ''}")


if __name__ == "__main__":
    main()
