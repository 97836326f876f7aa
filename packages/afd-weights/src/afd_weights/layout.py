"""Tensor layouts: what a native op depends on, blind to the values and to the data pointer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TensorLayout", "layout_of"]


@dataclass(frozen=True)
class TensorLayout:
    """Shape, strides, dtype and device type of one tensor.

    Invariant: two tensors with equal layouts can be swapped under a captured graph or a native op
    that was set up for one of them; values, data pointers and storage offsets are deliberately not
    part of the layout.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device_type: str

    def canonical(self) -> str:
        """A stable text form (identical in every process)."""
        return f"{self.shape}|{self.stride}|{self.dtype}|{self.device_type}"


def layout_of(tensor: torch.Tensor) -> TensorLayout:
    """Return the :class:`TensorLayout` of ``tensor``."""
    return TensorLayout(
        shape=tuple(int(s) for s in tensor.shape),
        stride=tuple(int(s) for s in tensor.stride()),
        dtype=str(tensor.dtype),
        device_type=tensor.device.type,
    )
