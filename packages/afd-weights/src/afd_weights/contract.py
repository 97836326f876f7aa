"""QuantizedExpertWeights: the one weight contract every FFN compute implementation consumes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from afd_weights.errors import WeightLayoutError, WeightsError
from afd_weights.geometry import ExpertGeometry
from afd_weights.layer import TENSOR_NAMES, ExpertLayerTensors
from afd_weights.layout import TensorLayout, layout_of
from afd_weights.scheme import QuantScheme
from afd_weights.signature import GraphSignature

__all__ = ["QuantizedExpertWeights", "expected_layer_spec"]

_Spec = Mapping[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]] | None]


def expected_layer_spec(
    scheme: QuantScheme, num_experts: int, hidden: int, intermediate: int, group_size: int
) -> dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]] | None]:
    """Expected ``(shape, allowed dtypes)`` of each tensor of a layer; ``None`` = must be absent.

    ================  ======================  =====================  ===========================
    tensor            W8A8                    W4A8 per-channel       W4A8 per-group
    ================  ======================  =====================  ===========================
    w13               int8 [E, H, 2I]         int32 [E, H, 2I/8]     int32 [E, H, 2I/8]
    w2                int8 [E, I, H]          int32 [E, I, H/8]      int32 [E, I, H/8]
    w13_scale         fp32 [E, 2I]            int64 [E, 2I]          int64 [E, H/G, 2I]
    w2_scale          fp32|bf16 [E, H]        int64 [E, H]           int64 [E, I/G, H]
    w13_bias          absent                  fp32 [E, 2I]           fp32 [E, 2I]
    w2_bias           absent                  fp32 [E, H]            fp32 [E, H]
    ================  ======================  =====================  ===========================
    """
    e, h, i, n13 = num_experts, hidden, intermediate, 2 * intermediate
    if scheme is QuantScheme.W8A8:
        return {
            "w13": ((e, h, n13), (torch.int8,)),
            "w2": ((e, i, h), (torch.int8,)),
            "w13_scale": ((e, n13), (torch.float32,)),
            "w2_scale": ((e, h), (torch.float32, torch.bfloat16)),
            "w13_bias": None,
            "w2_bias": None,
        }
    if scheme is QuantScheme.W4A8_PER_CHANNEL:
        s13: tuple[int, ...] = (e, n13)
        s2: tuple[int, ...] = (e, h)
    else:
        s13 = (e, h // group_size, n13)
        s2 = (e, i // group_size, h)
    return {
        "w13": ((e, h, n13 // 8), (torch.int32,)),
        "w2": ((e, i, h // 8), (torch.int32,)),
        "w13_scale": (s13, (torch.int64,)),
        "w2_scale": (s2, (torch.int64,)),
        "w13_bias": ((e, n13), (torch.float32,)),
        "w2_bias": ((e, h), (torch.float32,)),
    }


@dataclass(frozen=True, eq=False)
class QuantizedExpertWeights:
    """Per-layer references to quantized expert tensors plus the scalars the kernels need.

    Args:
        scheme: the :class:`QuantScheme` shared by all layers.
        layers: one :class:`ExpertLayerTensors` per MoE layer; any order, gaps allowed, ids unique.
            The order given is kept (it is the slot order of layered native ops).
        swiglu_limit: SwiGLU clamp ``L``; ``0.0`` disables it. Finite and ``>= 0``.
        routed_scaling_factor: multiplier applied to the routed output; finite and ``> 0``.
        group_size: input-dimension group of W4A8 per-group scales; ``0`` for other schemes.

    Invariants (checked at construction, before anything else happens):

    * every layer has exactly the tensors and the shapes/dtypes of :func:`expected_layer_spec`;
    * every layer is homogeneous with the first one: same shape, dtype, strides and device for
      every tensor (a :class:`WeightLayoutError` names the layer, the tensor, expected and actual);
    * tensors are stored by reference, never copied.
    """

    scheme: QuantScheme
    layers: tuple[ExpertLayerTensors, ...]
    swiglu_limit: float = 0.0
    routed_scaling_factor: float = 1.0
    group_size: int = 0
    _slots: dict[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, QuantScheme):
            allowed = ", ".join(repr(s) for s in QuantScheme)
            raise WeightsError("scheme", self.scheme, f"a QuantScheme ({allowed})")
        if isinstance(self.layers, ExpertLayerTensors) or not isinstance(self.layers, Iterable):
            raise WeightsError("layers", type(self.layers).__name__, "a sequence of layers")
        layers = tuple(self.layers)
        if not layers:
            raise WeightsError("layers", "()", "at least one ExpertLayerTensors")
        for pos, layer in enumerate(layers):
            if not isinstance(layer, ExpertLayerTensors):
                raise WeightsError(f"layers[{pos}]", type(layer).__name__, "ExpertLayerTensors")
        ids = [layer.layer_id for layer in layers]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise WeightsError("layers.layer_id", dup, "unique layer ids")
        _check_scalar("swiglu_limit", self.swiglu_limit, allow_zero=True)
        _check_scalar("routed_scaling_factor", self.routed_scaling_factor, allow_zero=False)
        self._check_group_size()
        _validate_layers(self.scheme, layers, self.group_size)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "swiglu_limit", float(self.swiglu_limit))
        object.__setattr__(self, "routed_scaling_factor", float(self.routed_scaling_factor))
        object.__setattr__(self, "_slots", {lid: slot for slot, lid in enumerate(ids)})

    def _check_group_size(self) -> None:
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int):
            raise WeightsError("group_size", g, "an int")
        if self.scheme.is_per_group and g <= 0:
            raise WeightsError("group_size", g, f"> 0 for {self.scheme.value}")
        if not self.scheme.is_per_group and g != 0:
            raise WeightsError("group_size", g, f"0 for {self.scheme.value}")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Layer ids in contract (slot) order."""
        return tuple(layer.layer_id for layer in self.layers)

    def slot_of(self, layer_id: int) -> int:
        """Position of ``layer_id`` in :attr:`layers`; raises :class:`WeightsError` if absent."""
        try:
            return self._slots[layer_id]
        except (KeyError, TypeError):
            raise WeightsError("layer_id", layer_id, f"one of {self.layer_ids}") from None

    def layer(self, layer_id: int) -> ExpertLayerTensors:
        """The tensors of ``layer_id``."""
        return self.layers[self.slot_of(layer_id)]

    @property
    def device(self) -> torch.device:
        """The device holding every tensor."""
        return self.layers[0].w13.device

    @cached_property
    def geometry(self) -> ExpertGeometry:
        """Sizes shared by all layers."""
        first = self.layers[0]
        return ExpertGeometry(
            scheme=self.scheme,
            num_layers=len(self.layers),
            num_experts=int(first.w13.shape[0]),
            hidden_size=int(first.w13.shape[1]),
            intermediate_size=int(first.w13.shape[2]) * self.scheme.weight_values_per_element // 2,
            group_size=self.group_size,
        )

    @cached_property
    def signature(self) -> GraphSignature:
        """The :class:`GraphSignature` of these weights (see its invariants)."""
        first = self.layers[0]
        layouts: tuple[tuple[str, TensorLayout | None], ...] = tuple(
            (name, layout_of(t) if t is not None else None) for name, t in first.tensors().items()
        )
        return GraphSignature(
            scheme=self.scheme.value,
            group_size=self.group_size,
            swiglu_limit=self.swiglu_limit,
            routed_scaling_factor=self.routed_scaling_factor,
            layer_ids=self.layer_ids,
            tensor_layouts=layouts,
        )

    def nbytes(self) -> int:
        """Bytes of all expert tensors (weights, scales and biases) over all layers."""
        return sum(layer.nbytes() for layer in self.layers)


def _check_scalar(name: str, value: object, *, allow_zero: bool) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WeightsError(name, value, f"a finite float {bound}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise WeightsError(name, value, f"a finite float {bound}")


def _validate_layers(
    scheme: QuantScheme, layers: tuple[ExpertLayerTensors, ...], group_size: int
) -> None:
    first = layers[0]
    lid = first.layer_id
    vpe = scheme.weight_values_per_element
    want_dtype = torch.int32 if scheme.is_int4 else torch.int8
    for name in ("w13", "w2"):
        t = getattr(first, name)
        if t.dtype != want_dtype:
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="dtype", expected=want_dtype, actual=t.dtype
            )
        if t.dim() != 3:
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="ndim", expected=3, actual=t.dim()
            )
    e, h, n13_stored = (int(s) for s in first.w13.shape)
    n13 = n13_stored * vpe
    inter = n13 // 2
    if min(e, h, n13) <= 0 or n13 % 2 != 0:
        raise WeightLayoutError(
            layer_id=lid,
            tensor="w13",
            prop="shape",
            expected="[E>0, H>0, 2I>0 (logical, even)]",
            actual=tuple(first.w13.shape),
        )
    if scheme.is_int4 and h % 8 != 0:
        raise WeightLayoutError(
            layer_id=lid, tensor="w13", prop="shape[1] (hidden)", expected="multiple of 8", actual=h
        )
    if group_size and (h % group_size or inter % group_size):
        raise WeightsError(
            "group_size",
            group_size,
            f"a divisor of hidden={h} and intermediate={inter}",
        )
    spec = expected_layer_spec(scheme, e, h, inter, group_size)
    device = first.w13.device
    for name, want in spec.items():
        t = getattr(first, name)
        if want is None:
            if t is not None:
                raise WeightLayoutError(
                    layer_id=lid, tensor=name, prop="presence", expected="absent", actual="present"
                )
            continue
        if t is None:
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="presence", expected="present", actual="absent"
            )
        shape, dtypes = want
        if tuple(t.shape) != shape:
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="shape", expected=shape, actual=tuple(t.shape)
            )
        if t.dtype not in dtypes:
            expected: object = dtypes[0] if len(dtypes) == 1 else dtypes
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="dtype", expected=expected, actual=t.dtype
            )
        if t.device != device:
            raise WeightLayoutError(
                layer_id=lid, tensor=name, prop="device", expected=device, actual=t.device
            )
    reference = {name: first.tensors()[name] for name in TENSOR_NAMES}
    for layer in layers[1:]:
        for name in TENSOR_NAMES:
            ref = reference[name]
            t = getattr(layer, name)
            if ref is None or t is None:
                if (ref is None) != (t is None):
                    raise WeightLayoutError(
                        layer_id=layer.layer_id,
                        tensor=name,
                        prop="presence",
                        expected="absent" if ref is None else "present",
                        actual="absent" if t is None else "present",
                    )
                continue
            for prop in ("shape", "dtype", "stride", "device"):
                want_v = _prop(ref, prop)
                got = _prop(t, prop)
                if want_v != got:
                    raise WeightLayoutError(
                        layer_id=layer.layer_id, tensor=name, prop=prop, expected=want_v, actual=got
                    )


def _prop(t: torch.Tensor, prop: str) -> object:
    if prop == "shape":
        return tuple(t.shape)
    if prop == "stride":
        return tuple(t.stride())
    if prop == "dtype":
        return t.dtype
    return t.device
