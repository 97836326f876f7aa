"""Benchmark: CAM stage layout conversion (prepare + restore) on CPU, one process.

Times ``prepare_stage_inputs`` + ``restore_stage_outputs`` for two stages with residuals, in the
replicated TP layout and the sequence-parallel layout. The TP all-gather returns a precomputed
tensor, so the figure is the slicing/padding/concatenation cost, not the collective.

Run: ``python bench_cam.py --out results/cam.json [--quick]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from afd_cam import CAMStageLayout, prepare_stage_inputs, restore_stage_outputs


def _time_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6  # median


def bench_case(
    tokens: int, tp_size: int, use_sp: bool, hidden: int, repeats: int
) -> dict[str, object]:
    layout = CAMStageLayout.split_evenly(
        tokens, 2, tp_size=tp_size, tp_rank=0, use_sequence_parallel=use_sp
    )
    rows = layout.local_rows(layout.parent_input_tokens)
    x = torch.randn(rows, hidden)
    residual = torch.randn(rows, hidden)

    results: dict[tuple[int, ...], torch.Tensor] = {}

    def gather(local: torch.Tensor) -> torch.Tensor:
        # A precomputed tensor of the gathered shape (allocated at warm-up): no collective cost.
        shape = (local.shape[0] * tp_size, *local.shape[1:])
        if shape not in results:
            results[shape] = torch.randn(shape)
        return results[shape]

    def step() -> object:
        inputs = prepare_stage_inputs(x, residual, layout, gather)
        return restore_stage_outputs(inputs.hidden_states, inputs.residuals, layout, gather)

    return {
        "tokens": tokens,
        "tp_size": tp_size,
        "layout": "SP" if layout.is_sharded else "TP",
        "hidden": hidden,
        "stage_input_rows": [layout.local_rows(s.input_tokens) for s in layout.stages],
        "median_us": round(_time_us(step, repeats), 2),
    }


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| layout | TP | tokens | hidden | local rows per stage | prepare + restore median µs |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['tp_size']} | {r['tokens']} | {r['hidden']} "
            f"| {r['stage_input_rows']} | {r['median_us']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (harness test)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.quick:
        token_counts, hidden, repeats = [8], 16, 3
    else:
        token_counts, hidden, repeats = [256, 4096], 2048, 30
    rows: list[dict[str, object]] = []
    for tokens in token_counts:
        for tp_size, use_sp in ((1, False), (4, False), (4, True)):
            rows.append(bench_case(tokens, tp_size, use_sp, hidden, repeats))
    result = {
        "benchmark": "afd-cam",
        "quick": args.quick,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
