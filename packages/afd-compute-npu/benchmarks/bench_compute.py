"""Reference W8A8 / W4A8 expert compute vs bf16 expert compute on CPU, and expert-weight bytes.

Usage::

    python bench_compute.py --out results/compute.json          # full run
    python bench_compute.py --out /tmp/quick.json --quick             # tiny smoke run

Compute timing: one MoE layer (``--experts``, ``--hidden``, ``--intermediate``, ``--top-k``) for
1..256 tokens; each scheme runs :class:`afd_compute_npu.LayeredCompute` on the reference backend;
the baseline is a bf16 grouped expert FFN over the same routing (per-expert bf16 matmuls, SiLU*up,
weighted combine). Median wall time of ``--repeats`` runs after one warmup.

Weight bytes: every tensor the contract holds (weights, scales, biases) for one layer at
``--bytes-hidden`` x ``--bytes-intermediate`` (DeepSeek-V3-like by default), relative to the same
experts in bf16. Bytes are per expert-count invariant, so one expert is exported.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from afd_compute_npu import ComputeConfig, LayeredCompute, ReferenceBackend
from afd_weights import QuantScheme, export_quantized_expert_weights

SCHEMES: list[tuple[str, QuantScheme, int]] = [
    ("w8a8", QuantScheme.W8A8, 0),
    ("w4a8_per_channel", QuantScheme.W4A8_PER_CHANNEL, 0),
    ("w4a8_per_group", QuantScheme.W4A8_PER_GROUP, 128),
]


def bf16_moe(
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """bf16 grouped expert FFN: ``w13`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]`` (K-major)."""
    t, k = ids.shape
    inter = w2.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = torch.empty(rows.shape[0], x.shape[1], dtype=x.dtype)
    start = 0
    for e, n in enumerate(counts):
        if n:
            h = rows[start : start + n] @ w13[e]
            y[start : start + n] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e]
            start += n
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32)
    out[order] = y.float()
    return (out.reshape(t, k, -1) * w.float().unsqueeze(-1)).sum(1).to(x.dtype)


def _median_ms(fn: Any, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_compute(args: argparse.Namespace) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    computes = {}
    for name, scheme, group in SCHEMES:
        weights = export_quantized_expert_weights(
            {0: (w13, w2)}, scheme=scheme, group_size=min(group, i) if group else 0
        )
        cfg = ComputeConfig(max_tokens=max(args.tokens), top_k=k)
        computes[name] = LayeredCompute(weights, cfg, ReferenceBackend())
    w13_bf = w13.transpose(1, 2).contiguous().to(torch.bfloat16)
    w2_bf = w2.transpose(1, 2).contiguous().to(torch.bfloat16)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(torch.bfloat16)
        row: dict[str, Any] = {"tokens": t}
        row["bf16_ms"] = _median_ms(partial(bf16_moe, x, ids, w, w13_bf, w2_bf), args.repeats)
        for name, comp in computes.items():
            row[f"{name}_ms"] = _median_ms(partial(comp, 0, x, ids, w), args.repeats)
        rows.append(row)
    return rows


def run_bytes(args: argparse.Namespace) -> list[dict[str, Any]]:
    h, i = args.bytes_hidden, args.bytes_intermediate
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(1, 2 * i, h, generator=g)
    w2 = torch.randn(1, h, i, generator=g)
    bf16 = 2 * (w13.numel() + w2.numel())
    out = [{"scheme": "bf16", "bytes": bf16, "ratio_vs_bf16": 1.0}]
    for name, scheme, group in SCHEMES:
        weights = export_quantized_expert_weights({0: (w13, w2)}, scheme=scheme, group_size=group)
        n = weights.nbytes()
        out.append({"scheme": name, "bytes": n, "ratio_vs_bf16": round(n / bf16, 4)})
    return out


def markdown(result: dict[str, Any]) -> str:
    names = [n for n, _, _ in SCHEMES]
    lines = [
        "| tokens | bf16 ms | " + " | ".join(f"{n} ms (x bf16)" for n in names) + " |",
        "|---:|---:|" + "---:|" * len(names),
    ]
    for r in result["compute"]:
        cells = [f"{r[f'{n}_ms']:.2f} ({r[f'{n}_ms'] / r['bf16_ms']:.1f}x)" for n in names]
        lines.append(f"| {r['tokens']} | {r['bf16_ms']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "| scheme | bytes per expert | vs bf16 |", "|---|---:|---:|"]
    for r in result["bytes"]:
        lines.append(f"| {r['scheme']} | {r['bytes']} | {r['ratio_vs_bf16']:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two token counts")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytes-hidden", type=int, default=7168)
    p.add_argument("--bytes-intermediate", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.experts, args.hidden, args.intermediate = [1, 8], 4, 128, 64
        args.top_k, args.repeats = 2, 1
        args.bytes_hidden, args.bytes_intermediate = 1024, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {
        "benchmark": "afd-compute-npu reference expert compute vs bf16 (CPU)",
        "params": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "compute": run_compute(args),
        "bytes": run_bytes(args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
