"""Decode a layer of the contract back to integer codes and fp32 scales (and dequantized weights).

These are the exact values the kernels compute with: ``codes * scale`` is the dequantized weight.
Scales are always returned with a group axis: ``[E, G, N]`` where ``G == 1`` unless per-group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_weights.contract import QuantizedExpertWeights
from afd_weights.packing import decode_scale_int64, unpack_int4_from_int32

__all__ = ["LayerCodes", "dequantize_layer", "layer_codes"]


@dataclass(frozen=True, eq=False)
class LayerCodes:
    """Integer codes (K-major) and fp32 scales of one layer.

    ``w13_codes`` int8 ``[E, H, 2I]``; ``w2_codes`` int8 ``[E, I, H]``; ``w13_scale`` fp32
    ``[E, G13, 2I]``; ``w2_scale`` fp32 ``[E, G2, H]`` (the stored dtype's values, widened);
    biases fp32 ``[E, N]`` or None.
    """

    w13_codes: torch.Tensor
    w2_codes: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None


def _scale(t: torch.Tensor, int4: bool) -> torch.Tensor:
    s = decode_scale_int64(t) if int4 else t.float()
    return s if s.dim() == 3 else s.unsqueeze(1)


def layer_codes(weights: QuantizedExpertWeights, layer_id: int) -> LayerCodes:
    """Unpack ``layer_id``'s tensors into :class:`LayerCodes` (new tensors; contract untouched)."""
    layer = weights.layer(layer_id)
    int4 = weights.scheme.is_int4
    if int4:
        w13 = unpack_int4_from_int32(layer.w13)
        w2 = unpack_int4_from_int32(layer.w2)
    else:
        w13, w2 = layer.w13, layer.w2
    return LayerCodes(
        w13_codes=w13,
        w2_codes=w2,
        w13_scale=_scale(layer.w13_scale, int4),
        w2_scale=_scale(layer.w2_scale, int4),
        w13_bias=layer.w13_bias,
        w2_bias=layer.w2_bias,
    )


def _expand(scale: torch.Tensor, k: int) -> torch.Tensor:
    return scale.repeat_interleave(k // scale.shape[1], dim=1)


def dequantize_layer(
    weights: QuantizedExpertWeights, layer_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 dequantized weights of ``layer_id``: ``w13`` ``[E, H, 2I]`` and ``w2`` ``[E, I, H]``."""
    c = layer_codes(weights, layer_id)
    w13 = c.w13_codes.float() * _expand(c.w13_scale, c.w13_codes.shape[1])
    w2 = c.w2_codes.float() * _expand(c.w2_scale, c.w2_codes.shape[1])
    return w13, w2
