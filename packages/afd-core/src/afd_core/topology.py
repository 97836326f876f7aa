"""World layout and the Attention-to-FFN assignment for any ``A >= F``.

World layout (the connector's own world of ``A + F`` ranks): **Attention ranks first**, then FFN
ranks::

    world rank:  0 .. A-1            A .. A+F-1
    role:        attention 0..A-1    ffn 0..F-1

Assignment (balanced, contiguous): FFN rank ``f`` serves the Attention ranks
``[floor(f*A/F), floor((f+1)*A/F))``. Invariants (checked exhaustively in the tests):

* every Attention rank is served by exactly one FFN rank;
* every FFN rank serves ``floor(A/F)`` or ``ceil(A/F)`` (hence at least one) Attention ranks;
* served ranks are consecutive and FFN ranks are ordered like the Attention ranks they serve;
* for ``A % F == 0`` this is afd-plugin's ``[f*r, (f+1)*r)`` with ``r = A // F``.

``A < F`` is rejected with :class:`AFDConfigError` naming ``num_ffn_ranks``.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError

__all__ = ["AFDTopology"]


def _role(role: AFDRole | str) -> AFDRole:
    try:
        return AFDRole(role)
    except ValueError:
        raise AFDConfigError("role", role, "one of 'attention', 'ffn'") from None


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AFDConfigError(name, value, "a positive integer (not bool)")
    return value


@dataclass(frozen=True)
class AFDTopology:
    """``num_attention_ranks`` (A) Attention ranks served by ``num_ffn_ranks`` (F) FFN ranks."""

    num_attention_ranks: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        a = _check_count("num_attention_ranks", self.num_attention_ranks)
        f = _check_count("num_ffn_ranks", self.num_ffn_ranks)
        if f > a:
            raise AFDConfigError(
                "num_ffn_ranks",
                f,
                f"at most num_attention_ranks={a} (every FFN rank must serve an Attention rank)",
            )

    @classmethod
    def from_config(cls, config: AFDConfig) -> AFDTopology:
        """The topology described by ``config``."""
        return cls(config.num_attention_ranks, config.num_ffn_ranks)

    @property
    def world_size(self) -> int:
        """``A + F``."""
        return self.num_attention_ranks + self.num_ffn_ranks

    def role_size(self, role: AFDRole | str) -> int:
        """Number of ranks of ``role``."""
        return self.num_attention_ranks if _role(role) is AFDRole.ATTENTION else self.num_ffn_ranks

    def check_role_rank(self, role: AFDRole | str, role_rank: int) -> None:
        """Raise :class:`AFDConfigError` (field ``role_rank``) unless ``0 <= role_rank < size``."""
        size = self.role_size(role)
        if isinstance(role_rank, bool) or not isinstance(role_rank, int):
            raise AFDConfigError("role_rank", role_rank, f"an integer in 0..{size - 1}")
        if not 0 <= role_rank < size:
            raise AFDConfigError(
                "role_rank", role_rank, f"an integer in 0..{size - 1} for role {_role(role)}"
            )

    def world_rank(self, role: AFDRole | str, role_rank: int) -> int:
        """World rank of ``role_rank`` of ``role`` (Attention first, then FFN)."""
        self.check_role_rank(role, role_rank)
        if _role(role) is AFDRole.ATTENTION:
            return role_rank
        return self.num_attention_ranks + role_rank

    def role_of(self, world_rank: int) -> tuple[AFDRole, int]:
        """Inverse of :meth:`world_rank`: ``(role, role_rank)``."""
        if isinstance(world_rank, bool) or not isinstance(world_rank, int):
            raise AFDConfigError(
                "world_rank", world_rank, f"an integer in 0..{self.world_size - 1}"
            )
        if not 0 <= world_rank < self.world_size:
            raise AFDConfigError(
                "world_rank", world_rank, f"an integer in 0..{self.world_size - 1}"
            )
        if world_rank < self.num_attention_ranks:
            return AFDRole.ATTENTION, world_rank
        return AFDRole.FFN, world_rank - self.num_attention_ranks

    def _first_attention_rank(self, ffn_rank: int) -> int:
        return ffn_rank * self.num_attention_ranks // self.num_ffn_ranks

    def attention_ranks_for(self, ffn_rank: int) -> tuple[int, ...]:
        """Attention role ranks served by ``ffn_rank``, ascending (never empty)."""
        self.check_role_rank(AFDRole.FFN, ffn_rank)
        return tuple(
            range(self._first_attention_rank(ffn_rank), self._first_attention_rank(ffn_rank + 1))
        )

    def ffn_rank_for(self, attention_rank: int) -> int:
        """The FFN role rank serving ``attention_rank``."""
        self.check_role_rank(AFDRole.ATTENTION, attention_rank)
        # Largest f with floor(f*A/F) <= a  <=>  f*A < (a+1)*F.
        return ((attention_rank + 1) * self.num_ffn_ranks - 1) // self.num_attention_ranks

    def peers_of(self, role: AFDRole | str, role_rank: int) -> tuple[int, ...]:
        """World ranks this rank exchanges data with (its FFN rank, or its Attention ranks)."""
        if _role(role) is AFDRole.ATTENTION:
            return (self.world_rank(AFDRole.FFN, self.ffn_rank_for(role_rank)),)
        return tuple(
            self.world_rank(AFDRole.ATTENTION, a) for a in self.attention_ranks_for(role_rank)
        )

    def index_in_group(self, attention_rank: int) -> int:
        """Position of ``attention_rank`` among the ranks its FFN rank serves."""
        ffn = self.ffn_rank_for(attention_rank)
        return attention_rank - self._first_attention_rank(ffn)
