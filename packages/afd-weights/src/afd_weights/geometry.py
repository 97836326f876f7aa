"""Expert geometry derived from a validated weight contract."""

from __future__ import annotations

from dataclasses import dataclass

from afd_weights.scheme import QuantScheme

__all__ = ["ExpertGeometry"]


@dataclass(frozen=True)
class ExpertGeometry:
    """Sizes shared by every layer of a :class:`~afd_weights.QuantizedExpertWeights`.

    Invariants: ``hidden_size % group_size == 0`` and ``intermediate_size % group_size == 0`` when
    ``group_size > 0``; ``group_size == 0`` exactly when the scheme is not per-group.
    """

    scheme: QuantScheme
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    group_size: int

    @property
    def w13_out_features(self) -> int:
        """Output features of the gate/up GEMM (``2 * intermediate_size``)."""
        return 2 * self.intermediate_size

    @property
    def w13_num_groups(self) -> int:
        """Scale groups along the w13 input (hidden) dimension; 1 when per-channel."""
        return self.hidden_size // self.group_size if self.group_size else 1

    @property
    def w2_num_groups(self) -> int:
        """Scale groups along the w2 input (intermediate) dimension; 1 when per-channel."""
        return self.intermediate_size // self.group_size if self.group_size else 1

    def bf16_bytes_per_layer(self) -> int:
        """Bytes of the same experts stored unquantized in bf16 (w13 and w2 only)."""
        return 2 * self.num_experts * 3 * self.hidden_size * self.intermediate_size
