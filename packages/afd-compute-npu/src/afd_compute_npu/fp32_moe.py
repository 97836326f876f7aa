"""An fp32 MoE over the dequantized weights: the accuracy yardstick for the quantized paths.

Documented tolerance (checked by ``tests/test_compute_accuracy.py`` over H in {96, 128, 256},
I in {32, 128, 256}, every scheme and valid group size, T in {1, 8, 64}, K in {2, 8}): for
unit-scale, Gaussian-like activations the quantized Layered/Mega outputs ``y`` satisfy
``max|y - ref| <= FP32_TOLERANCE * max|ref|`` where ``ref`` is :func:`fp32_dequantized_moe` on the
same weights. Measured (README "Accuracy"): at most 3.52e-2 over those shapes (margin 1.7x) and
at most 4.5e-2 in spot checks up to I = 2048 (margin 1.3x).

The error budget is int8 activation quantization at both GEMM inputs (a step of ``max|row|/127``
per row, so the relative error grows with each row's crest factor ``max|a| / rms(a)``, which for
the SwiGLU output grows slowly with I) plus bf16 rounding of the expert outputs, the router
weights and the combined result (~2**-8 each). Heavy-tailed activations can exceed the bound.
"""

from __future__ import annotations

import torch
from afd_weights import QuantizedExpertWeights, dequantize_layer

__all__ = ["FP32_TOLERANCE", "fp32_dequantized_moe"]

FP32_TOLERANCE = 6e-2
"""Max abs error relative to ``max|ref|`` (bf16 output, unit-scale Gaussian-like activations)."""


def fp32_dequantized_moe(
    weights: QuantizedExpertWeights,
    layer_id: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """fp32 ``sum_k w_k * W2_e(SwiGLU_L(x W13_e)) * routed_scaling_factor`` with no quantization."""
    w13, w2 = dequantize_layer(weights, layer_id)
    x = hidden_states.float()
    inter = w2.shape[1]
    limit = weights.swiglu_limit
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        for expert in torch.unique(topk_ids[:, slot]).tolist():
            rows = (topk_ids[:, slot] == expert).nonzero().squeeze(-1)
            h = x[rows] @ w13[expert]
            g, u = h[:, :inter], h[:, inter:]
            if limit > 0:
                g = torch.clamp(g, max=limit)
                u = torch.clamp(u, -limit, limit)
            y = (torch.nn.functional.silu(g) * u) @ w2[expert]
            out[rows] += y * topk_weights[rows, slot].float().unsqueeze(-1)
    return out * weights.routed_scaling_factor
