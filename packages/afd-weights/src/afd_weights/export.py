"""Exporters: turn a vLLM fused-MoE layer's unquantized expert weights into the contract.

vLLM's unquantized ``FusedMoE`` stores ``w13_weight`` as ``[E, 2I, H]`` (gate rows then up rows)
and ``w2_weight`` as ``[E, H, I]``. The exporter accepts those two tensors directly, or any object
with attributes of those names (a vLLM layer, a ``SimpleNamespace``...); vLLM is never imported.

What it produces (see :func:`afd_weights.contract.expected_layer_spec`): per-output-channel (or
per-group) symmetric codes, transposed to the K-major layout the kernels use and made contiguous;
int4 codes packed eight per int32 along the output dimension; W4A8 scales encoded as int64 fp32
bits; and the W4A8 ``scale_bias`` of :func:`afd_weights.quantize.int4_scale_bias`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from afd_weights.contract import QuantizedExpertWeights
from afd_weights.errors import QuantizationError
from afd_weights.layer import ExpertLayerTensors
from afd_weights.packing import encode_scale_int64, pack_int4_to_int32
from afd_weights.quantize import (
    int4_scale_bias,
    quantize_int4_per_channel,
    quantize_int4_per_group,
    quantize_int8_per_channel,
)
from afd_weights.scheme import QuantScheme

__all__ = [
    "export_fused_moe_layer",
    "export_fused_moe_tensors",
    "export_quantized_expert_weights",
]


def _check_pair(w13: object, w2: object) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("w13_weight", w13), ("w2_weight", w2)):
        if not isinstance(t, torch.Tensor):
            raise QuantizationError(name, type(t).__name__, "a torch.Tensor")
        if not t.is_floating_point():
            raise QuantizationError(f"{name}.dtype", t.dtype, "a floating dtype")
        if t.dim() != 3:
            raise QuantizationError(f"{name}.shape", tuple(t.shape), "a 3-D tensor")
    assert isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
    e, n13, h = w13.shape
    if n13 == 0 or n13 % 2 != 0:
        raise QuantizationError("w13_weight.shape", tuple(w13.shape), "[E, 2I, H] with 2I even > 0")
    inter = n13 // 2
    if tuple(w2.shape) != (e, h, inter):
        raise QuantizationError("w2_weight.shape", tuple(w2.shape), f"[E, H, I] = {(e, h, inter)}")
    return w13, w2


def _check_scheme(scheme: object, group_size: object, h: int, inter: int) -> None:
    if not isinstance(scheme, QuantScheme):
        raise QuantizationError("scheme", scheme, f"one of {[s.value for s in QuantScheme]}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise QuantizationError("group_size", group_size, "an int")
    if scheme.is_per_group:
        if group_size <= 0 or h % group_size or inter % group_size:
            raise QuantizationError(
                "group_size", group_size, f"> 0 dividing hidden={h} and intermediate={inter}"
            )
    elif group_size != 0:
        raise QuantizationError("group_size", group_size, f"0 for {scheme.value}")
    if scheme.is_int4 and (h % 8 or (2 * inter) % 8):
        raise QuantizationError(
            "hidden/intermediate", (h, inter), "hidden and 2*intermediate multiples of 8 for int4"
        )


def _k_major(t: torch.Tensor) -> torch.Tensor:
    """``[E, N, K] -> [E, K, N]`` contiguous."""
    return t.transpose(1, 2).contiguous()


def _int4_parts(
    weight: torch.Tensor, scheme: QuantScheme, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scheme.is_per_group:
        codes, scale = quantize_int4_per_group(weight, group_size)
        enc = encode_scale_int64(_k_major(scale))  # [E, K/G, N]
    else:
        codes, scale = quantize_int4_per_channel(weight)
        enc = encode_scale_int64(scale.contiguous())  # [E, N]
    bias = int4_scale_bias(codes, scale).contiguous()
    packed = pack_int4_to_int32(_k_major(codes))
    return packed, enc, bias


def export_fused_moe_tensors(
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
    *,
    layer_id: int,
    scheme: QuantScheme,
    group_size: int = 0,
    w2_scale_dtype: torch.dtype = torch.float32,
) -> ExpertLayerTensors:
    """Quantize one layer from vLLM-layout float tensors.

    Args:
        w13_weight: ``[E, 2I, H]`` float (gate rows ``[0, I)``, up rows ``[I, 2I)``).
        w2_weight: ``[E, H, I]`` float.
        layer_id: the layer's id.
        scheme: target :class:`QuantScheme`.
        group_size: input group for ``W4A8_PER_GROUP`` (must divide H and I); else 0.
        w2_scale_dtype: W8A8 only: ``torch.float32`` or ``torch.bfloat16`` (vLLM-Ascend keeps the
            model dtype); the codes are computed with the rounded scale.
    """
    w13, w2 = _check_pair(w13_weight, w2_weight)
    _e, n13, h = w13.shape
    _check_scheme(scheme, group_size, int(h), int(n13) // 2)
    if scheme is QuantScheme.W8A8:
        if w2_scale_dtype not in (torch.float32, torch.bfloat16):
            raise QuantizationError("w2_scale_dtype", w2_scale_dtype, "float32 or bfloat16")
        c13, s13 = quantize_int8_per_channel(w13)
        c2, s2 = quantize_int8_per_channel(w2, scale_dtype=w2_scale_dtype)
        return ExpertLayerTensors(
            layer_id=layer_id,
            w13=_k_major(c13),
            w2=_k_major(c2),
            w13_scale=s13.contiguous(),
            w2_scale=s2.contiguous(),
        )
    if w2_scale_dtype != torch.float32:
        raise QuantizationError("w2_scale_dtype", w2_scale_dtype, "torch.float32 for W4A8")
    p13, e13, b13 = _int4_parts(w13, scheme, group_size)
    p2, e2, b2 = _int4_parts(w2, scheme, group_size)
    return ExpertLayerTensors(
        layer_id=layer_id,
        w13=p13,
        w2=p2,
        w13_scale=e13,
        w2_scale=e2,
        w13_bias=b13,
        w2_bias=b2,
    )


def export_fused_moe_layer(
    source: object,
    *,
    layer_id: int,
    scheme: QuantScheme,
    group_size: int = 0,
    w2_scale_dtype: torch.dtype = torch.float32,
) -> ExpertLayerTensors:
    """Like :func:`export_fused_moe_tensors`, reading ``source.w13_weight`` / ``source.w2_weight``.

    ``source`` may be a vLLM ``FusedMoE`` layer or any object with those attributes; a
    ``torch.nn.Parameter`` is read through ``.data`` (nothing is registered or modified).
    """
    missing = [a for a in ("w13_weight", "w2_weight") if not hasattr(source, a)]
    if missing:
        raise QuantizationError(
            "source", type(source).__name__, f"an object with attributes {missing}"
        )
    w13 = getattr(source, "w13_weight")  # noqa: B009 - explicit duck-typed attribute
    w2 = getattr(source, "w2_weight")  # noqa: B009
    w13 = w13.data if isinstance(w13, torch.nn.Parameter) else w13
    w2 = w2.data if isinstance(w2, torch.nn.Parameter) else w2
    return export_fused_moe_tensors(
        w13,
        w2,
        layer_id=layer_id,
        scheme=scheme,
        group_size=group_size,
        w2_scale_dtype=w2_scale_dtype,
    )


def export_quantized_expert_weights(
    sources: Mapping[int, object] | Iterable[tuple[int, object]],
    *,
    scheme: QuantScheme,
    swiglu_limit: float = 0.0,
    routed_scaling_factor: float = 1.0,
    group_size: int = 0,
    w2_scale_dtype: torch.dtype = torch.float32,
) -> QuantizedExpertWeights:
    """Export several layers (``{layer_id: layer}`` or ``(layer_id, layer)`` pairs, order kept).

    Each value is either a layer-like object (see :func:`export_fused_moe_layer`) or a
    ``(w13_weight, w2_weight)`` tuple.
    """
    items = list(sources.items()) if isinstance(sources, Mapping) else list(sources)
    layers = []
    for layer_id, src in items:
        if isinstance(src, tuple) and len(src) == 2:
            layers.append(
                export_fused_moe_tensors(
                    src[0],
                    src[1],
                    layer_id=layer_id,
                    scheme=scheme,
                    group_size=group_size,
                    w2_scale_dtype=w2_scale_dtype,
                )
            )
        else:
            layers.append(
                export_fused_moe_layer(
                    src,
                    layer_id=layer_id,
                    scheme=scheme,
                    group_size=group_size,
                    w2_scale_dtype=w2_scale_dtype,
                )
            )
    return QuantizedExpertWeights(
        scheme=scheme,
        layers=tuple(layers),
        swiglu_limit=swiglu_limit,
        routed_scaling_factor=routed_scaling_factor,
        group_size=group_size,
    )
