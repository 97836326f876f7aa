"""Graph signatures: equal exactly when a captured graph can be reused."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from afd_weights.layout import TensorLayout

__all__ = ["GraphSignature"]


@dataclass(frozen=True)
class GraphSignature:
    """What a captured graph (or native op setup) over expert weights depends on.

    Fields: the scheme, the group size, the SwiGLU clamp, the routed scaling factor, the layer ids
    **in contract order** (a layered op indexes per-layer lists by slot, so order matters), and the
    :class:`TensorLayout` of each tensor (identical for all layers once validated). Tensor values,
    data pointers and storage offsets are excluded.

    Invariants: hashable; ``==`` and :meth:`digest` agree; :meth:`digest` is identical in every
    process (it does not use Python's randomized ``hash``).
    """

    scheme: str
    group_size: int
    swiglu_limit: float
    routed_scaling_factor: float
    layer_ids: tuple[int, ...]
    tensor_layouts: tuple[tuple[str, TensorLayout | None], ...]

    def canonical(self) -> str:
        """A stable text form; floats are written in hex so no rounding hides a difference."""
        layouts = ";".join(
            f"{name}={layout.canonical() if layout is not None else 'none'}"
            for name, layout in self.tensor_layouts
        )
        return (
            f"scheme={self.scheme}|group={self.group_size}|"
            f"clamp={float(self.swiglu_limit).hex()}|"
            f"scaling={float(self.routed_scaling_factor).hex()}|"
            f"layers={self.layer_ids}|{layouts}"
        )

    def digest(self) -> str:
        """SHA-256 hex digest of :meth:`canonical`; a cross-process graph key."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()
