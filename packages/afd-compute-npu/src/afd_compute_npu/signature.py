"""The graph key of a compute object: the weights' signature plus what the compute fixes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from afd_weights import GraphSignature

__all__ = ["ComputeGraphSignature"]


@dataclass(frozen=True)
class ComputeGraphSignature:
    """Equal exactly when a graph captured around one compute object can replay on another.

    Mega includes its bound group name and world size; Layered has ``group_name=""`` and
    ``world_size=0``. :meth:`digest` is stable across processes.
    """

    kind: str
    backend: str
    weights: GraphSignature
    max_tokens: int
    top_k: int
    dtype: str
    group_name: str = ""
    world_size: int = 0

    def digest(self) -> str:
        """SHA-256 hex digest of every field (the weights through their own canonical form)."""
        text = (
            f"{self.kind}|{self.backend}|{self.weights.canonical()}|{self.max_tokens}|"
            f"{self.top_k}|{self.dtype}|{self.group_name}|{self.world_size}"
        )
        return hashlib.sha256(text.encode()).hexdigest()
