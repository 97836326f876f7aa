"""Rendering a :class:`~afd_plan.plan.PlanResult`: a text table, a JSON document and the
optional plot (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd_plan.errors import AFDPlanError
from afd_plan.hardware import HardwareProfile
from afd_plan.plan import PlanResult, Prediction
from afd_plan.shape import ModelShape
from afd_plan.workload import Workload

__all__ = ["plan_json", "plot_ratio", "render_table"]

GIB = 2**30


def _vs_baseline(p: Prediction, result: PlanResult) -> float | None:
    base = result.baselines.get(p.candidate.devices)
    if base is None or p.candidate.colocated:
        return None
    return p.tokens_per_s_per_device / base.tokens_per_s_per_device - 1.0


def _row(p: Prediction, result: PlanResult) -> list[str]:
    c = p.candidate
    mem = {role: sum(parts.values()) / GIB for role, parts in p.memory.items()}
    vs = _vs_baseline(p, result)
    return [
        f"EP{c.num_attention}" if c.colocated else f"{c.num_attention}:{c.num_ffn}",
        str(c.devices),
        str(c.stages),
        str(c.batch),
        c.expert_quant,
        f"{p.tpot_s * 1e3:.2f}",
        f"{p.tokens_per_s_per_device:.1f}",
        f"{p.tokens_per_s:.1f}",
        f"{mem.get('attention', mem.get('colocated', 0.0)):.2f}",
        "-" if c.colocated else f"{mem['ffn']:.2f}",
        p.binding,
        "-" if vs is None else f"{vs * 100:+.1f}%",
    ]


HEADER = [
    "A:F",
    "dev",
    "S",
    "b",
    "experts",
    "TPOT ms",
    "tok/s/dev",
    "tok/s",
    "attn GiB",
    "ffn GiB",
    "binds",
    "vs EP",
]


def render_table(
    result: PlanResult,
    shape: ModelShape,
    hw: HardwareProfile,
    work: Workload,
    *,
    top: int = 10,
) -> str:
    """The best ``top`` candidates, then the best colocated baseline per device count among
    them (``vs EP``: tokens/s per device against that baseline), then what was refused."""
    lines = [
        f"model: {shape.family}, {shape.num_layers} layers ({shape.num_moe_layers} MoE), "
        f"{shape.num_experts} experts top-{shape.top_k}, hidden {shape.hidden_size}",
        f"hardware: {hw.name} ({hw.source[:100]}{'...' if len(hw.source) > 100 else ''})",
        f"workload: input {work.input_len}, output {work.output_len}, kv {work.kv_dtype}, "
        f"dense weights {work.dense_quant}, routing {work.routing} (skew {work.expert_skew:g})",
        "",
    ]
    rows = [_row(p, result) for p in result.candidates[:top]]
    shown = sorted({p.candidate.devices for p in result.candidates[:top]})
    base_rows = [_row(result.baselines[n], result) for n in shown if n in result.baselines]
    lines += _format([HEADER, *rows])
    if base_rows:
        lines += ["", "colocated baseline (expert parallel, best batch and stages per size):"]
        lines += _format([HEADER, *base_rows])
    if not result.candidates:
        lines.append("no AFD candidate fits memory and the TPOT target")
    if result.refused_memory:
        lines += [
            "",
            f"{len(result.refused_memory)} candidates refused for memory, e.g.: "
            f"{result.refused_memory[0]}",
        ]
    if result.over_tpot:
        lines.append(f"{result.over_tpot} candidates over the TPOT target")
    return "\n".join(lines)


def _format(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]


def plan_json(
    result: PlanResult,
    shape: ModelShape,
    hw: HardwareProfile,
    work: Workload,
    *,
    top: int | None = None,
) -> dict[str, Any]:
    """The same data as :func:`render_table`, for machines (all candidates unless ``top``)."""
    chosen = result.candidates if top is None else result.candidates[:top]
    return {
        "model": {
            "family": shape.family,
            "layers": shape.num_layers,
            "moe_layers": shape.num_moe_layers,
            "experts": shape.num_experts,
            "top_k": shape.top_k,
            "hidden_size": shape.hidden_size,
        },
        "hardware": hw.to_mapping(),
        "workload": {
            "input_len": work.input_len,
            "output_len": work.output_len,
            "kv_dtype": work.kv_dtype,
            "dense_quant": work.dense_quant,
            "routing": work.routing,
            "expert_skew": work.expert_skew,
        },
        "candidates": [{**p.to_json(), "vs_colocated": _vs_baseline(p, result)} for p in chosen],
        "colocated_baselines": {str(n): p.to_json() for n, p in sorted(result.baselines.items())},
        "refused_memory": [str(e) for e in result.refused_memory[:20]],
        "refused_memory_count": len(result.refused_memory),
        "over_tpot_count": result.over_tpot,
    }


def plot_ratio(
    result: PlanResult,
    out: Path,
    *,
    measured: Mapping[float, float] | None = None,
) -> None:
    """Predicted tokens/s per device against ``A / F`` (the best candidate per ratio and ``F``,
    one line per ``F``; the best colocated baseline as a dashed line; ``measured`` points
    ``{A/F: tokens/s per device}`` as markers). Needs matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        raise AFDPlanError(
            "--plot",
            str(out),
            "an environment with matplotlib (pip install matplotlib)",
            detail="matplotlib is not installed",
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[int, dict[float, float]] = {}
    for p in result.candidates:
        c = p.candidate
        curve = best.setdefault(c.num_ffn, {})
        ratio = c.num_attention / c.num_ffn
        curve[ratio] = max(curve.get(ratio, 0.0), p.tokens_per_s_per_device)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f, curve in sorted(best.items()):
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker="o", label=f"AFD, F={f}")
    if result.baselines:
        top = max(result.baselines.values(), key=lambda p: p.tokens_per_s_per_device)
        ax.axhline(
            top.tokens_per_s_per_device,
            linestyle="--",
            color="gray",
            label=f"colocated EP{top.candidate.num_attention}",
        )
    if measured:
        xs = sorted(measured)
        ax.scatter(xs, [measured[x] for x in xs], marker="x", color="black", label="measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("A : F (Attention ranks per FFN rank)")
    ax.set_ylabel("predicted tokens/s per device")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
