"""One MoE layer's quantized expert tensors (references, never copies)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afd_weights.errors import WeightsError

__all__ = ["TENSOR_NAMES", "ExpertLayerTensors"]

TENSOR_NAMES: tuple[str, ...] = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")
"""The tensor fields of :class:`ExpertLayerTensors`, in the order signatures list them."""


@dataclass(frozen=True, eq=False)
class ExpertLayerTensors:
    """The expert tensors of one MoE layer, in the layout the native kernels consume.

    ``w13`` holds gate (rows/columns ``[0, I)``) then up (``[I, 2I)``), vLLM's order. Weights are
    K-major (input dimension first): ``w13`` is ``[E, H, 2I]``, ``w2`` is ``[E, I, H]`` in logical
    elements. The exact per-scheme shapes and dtypes are checked by
    :class:`afd_weights.QuantizedExpertWeights`, which also checks that all layers match.

    Biases are the W4A8 ``scale_bias`` tensors (``8 * s * colsum(W)``); they are ``None`` for W8A8.
    The dataclass stores the given tensor objects themselves (identity is preserved).
    """

    layer_id: int
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layer_id, bool) or not isinstance(self.layer_id, int):
            raise WeightsError("layer_id", self.layer_id, "a non-negative int")
        if self.layer_id < 0:
            raise WeightsError("layer_id", self.layer_id, "a non-negative int")
        for name in TENSOR_NAMES:
            value = getattr(self, name)
            if value is None and name in ("w13_bias", "w2_bias"):
                continue
            if not isinstance(value, torch.Tensor):
                raise WeightsError(
                    name, type(value).__name__, "a torch.Tensor", context=f"layer {self.layer_id}"
                )

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors by field name, in :data:`TENSOR_NAMES` order."""
        return {name: getattr(self, name) for name in TENSOR_NAMES}

    def nbytes(self) -> int:
        """Bytes held by this layer's tensors (their logical elements, not their storages)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t is not None)
