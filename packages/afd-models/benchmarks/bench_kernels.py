"""Benchmark: the wide checkpoint's layer kernels, as vLLM CPU runs them, against afd-plan's terms.

``afd bench`` measures whole engines; this measures the two kernels a decode step of the wide
tiny checkpoint (``afd tiny --width wide``: hidden 1024, 8 experts of 1024, top-2, 16 query heads
of 64 over 4 KV heads) spends its layer time in, outside any engine, on one core and one thread:

* **experts**: vLLM's CPU fused-MoE op (``cpu_fused_moe``, the fp32 ``vec`` kernel that serving
  selects for this checkpoint), its weights prepacked as vLLM prepacks them; ``--layers`` layers
  of their own weights (more bytes than the last-level cache holds, as in serving), each call
  with a fresh uniform top-2 routing of ``M`` tokens;
* **attention projections**: QKV and O through oneDNN (``onednn_mm``, vLLM CPU's fp32 linear).

Per batch ``M``: the median time of one layer's call over ``--repeats`` steps (all layers),
the experts hit, and, with ``--hardware`` (an afd-plan profile, e.g. the calibrated one), the
roofline afd-plan prices the same bytes and FLOPs at: ``t_mem + t_flop`` (the profile's
``compute_overlaps_memory = false``) and ``max(t_mem, t_flop)``.

What it showed on the 2-vCPU test VM (README, "Kernel costs against the model"): the expert
kernel costs the same per expert hit at 1 to 16 tokens (its arithmetic hides behind the weight
reads); the projections sit between the sum and the max.

Usage: ``python bench_kernels.py --out results.json [--hardware PROFILE] [--repeats N]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import vllm._custom_ops as ops
from afd_models.demo.tiny import TinySpec, ensure_tiny_checkpoint
from afd_plan.cost import roofline
from afd_plan.hardware import HardwareProfile, load_profile
from afd_plan.shape import ModelShape, load_model_shape

BATCHES = (1, 4, 16)
#: vLLM's CPU fused-MoE kernel for fp32 weights (``CPUUnquantizedExperts.isa``).
MOE_ISA = "vec"


def _pin_one_core() -> int:
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    return cpu


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def measure_experts(shape: ModelShape, layers: int, repeats: int) -> list[dict[str, float]]:
    e, h, i, k = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size, shape.top_k
    weights = [
        (
            ops.cpu_prepack_moe_weight(torch.randn(e, 2 * i, h) * 0.02, MOE_ISA),
            ops.cpu_prepack_moe_weight(torch.randn(e, h, i) * 0.02, MOE_ISA),
        )
        for _ in range(layers)
    ]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in BATCHES:
        x, out = torch.randn(m, h), torch.empty(m, h)
        topk_w = torch.full((m, k), 1.0 / k)
        hits: list[int] = []

        def step(
            m: int = m,
            x: torch.Tensor = x,
            out: torch.Tensor = out,
            hits: list[int] = hits,
            topk_w: torch.Tensor = topk_w,
        ) -> None:
            for w13, w2 in weights:
                ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)])
                hits.append(len(set(ids.flatten().tolist())))
                ops.cpu_fused_moe(
                    out, x, w13, w2, None, None, topk_w, ids.to(torch.int32), "silu", MOE_ISA
                )

        ms = _median_ms(step, repeats) / layers
        rows.append({"batch": m, "ms_per_layer": ms, "experts_hit": statistics.mean(hits)})
    return rows


def measure_projections(shape: ModelShape, layers: int, repeats: int) -> list[dict[str, float]]:
    h = shape.hidden_size
    att = shape.attention
    qkv = (att.num_heads + 2 * att.num_kv_heads) * att.head_dim
    handles = [
        ops.create_onednn_mm((torch.randn(n, kdim) * 0.02).t(), 32)
        for _ in range(layers)
        for n, kdim in ((qkv, h), (h, att.num_heads * att.head_dim))
    ]
    rows = []
    for m in BATCHES:
        x_in = torch.randn(m, h)

        def step(x: torch.Tensor = x_in) -> None:
            for handle in handles:
                ops.onednn_mm(handle, x, None)

        rows.append({"batch": m, "ms_per_layer": _median_ms(step, repeats) / layers})
    return rows


def _priced(nbytes: float, flops: float, hw: HardwareProfile) -> dict[str, float]:
    add = roofline(nbytes, flops, hw.with_overrides(compute_overlaps_memory=False), "fp32")
    top = roofline(nbytes, flops, hw.with_overrides(compute_overlaps_memory=True), "fp32")
    return {"sum_ms": add.seconds * 1e3, "max_ms": top.seconds * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(
        description="the wide checkpoint's layer kernels against afd-plan's terms"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hardware", help="an afd-plan profile to price the kernels with")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()

    shape = load_model_shape(ensure_tiny_checkpoint(TinySpec("qwen3_moe", width="wide"), None))
    cpu = _pin_one_core()
    experts = measure_experts(shape, args.layers, args.repeats)
    projections = measure_projections(shape, args.layers, args.repeats)
    hw = load_profile(args.hardware) if args.hardware else None
    att = shape.attention
    proj_params = att.weight_params(shape.hidden_size)
    for row in experts:
        nbytes = row["experts_hit"] * shape.expert_params() * 4
        row["ms_per_hit"] = row["ms_per_layer"] / row["experts_hit"]
        row["weight_read_gb_s"] = nbytes / row["ms_per_layer"] / 1e6
        if hw is not None:
            flops = row["batch"] * shape.top_k * 2.0 * shape.expert_params()
            row.update(_priced(nbytes, flops, hw))
    for row in projections:
        row["weight_read_gb_s"] = proj_params * 4 / row["ms_per_layer"] / 1e6
        if hw is not None:
            row.update(_priced(proj_params * 4, row["batch"] * 2.0 * proj_params, hw))

    result = {
        "cpu": cpu,
        "layers": args.layers,
        "repeats": args.repeats,
        "profile": args.hardware,
        "experts": experts,
        "projections": projections,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, rows in (("experts", experts), ("projections", projections)):
        for row in rows:
            print(name, " ".join(f"{k} {v:.3g}" for k, v in row.items()))


if __name__ == "__main__":
    main()
