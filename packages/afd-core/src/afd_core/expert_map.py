"""Which FFN rank holds which routed expert (expert parallelism over ``F`` FFN ranks).

An :class:`ExpertMap` assigns each of ``num_experts`` routed (global) experts to exactly one FFN
rank; on its rank an expert has a *local* index (its position among the rank's experts,
ascending by global index). The default placement, :meth:`ExpertMap.contiguous`, gives rank ``f``
the experts ``[floor(f*E/F), floor((f+1)*E/F))``: ranges differ by at most one expert. Any other
assignment (non-contiguous, an EPLB placement) is an ``owners`` tuple.

Invariants (checked at construction and in the tests):

* every expert has exactly one owner in ``0..F-1`` and every FFN rank owns at least one expert
  (``E >= F``);
* ``local_experts(f)`` is ascending and ``local_index(e)`` is ``e``'s position in it;
* :meth:`localise` maps a token's top-k slots to rank-local ids; slots on other ranks get weight
  exactly 0 and a valid local id, so the rank's output for the token is the sum over its own
  experts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from afd_core.errors import AFDConfigError

__all__ = ["ExpertMap"]


def _count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AFDConfigError(name, value, f"an int >= {minimum}")
    return value


@dataclass(frozen=True)
class ExpertMap:
    """``owners[e]`` is the FFN rank holding routed expert ``e``."""

    num_ffn_ranks: int
    owners: tuple[int, ...]
    _local: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        f = _count("num_ffn_ranks", self.num_ffn_ranks, 1)
        owners = tuple(self.owners)
        if len(owners) < f:
            raise AFDConfigError(
                "num_experts", len(owners), f"at least num_ffn_ranks={f} (one expert per rank)"
            )
        for e, owner in enumerate(owners):
            if isinstance(owner, bool) or not isinstance(owner, int) or not 0 <= owner < f:
                raise AFDConfigError(f"owners[{e}]", owner, f"an FFN rank in 0..{f - 1}")
        local = tuple(tuple(e for e, o in enumerate(owners) if o == r) for r in range(f))
        for r, experts in enumerate(local):
            if not experts:
                raise AFDConfigError("owners", owners, f"a placement giving FFN rank {r} experts")
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "_local", local)

    @classmethod
    def contiguous(cls, num_experts: int, num_ffn_ranks: int) -> ExpertMap:
        """Balanced contiguous ranges: rank ``f`` holds ``[f*E//F, (f+1)*E//F)``."""
        e = _count("num_experts", num_experts, 1)
        f = _count("num_ffn_ranks", num_ffn_ranks, 1)
        if e < f:
            raise AFDConfigError(
                "num_ffn_ranks", f, f"at most num_experts={e} (every FFN rank holds an expert)"
            )
        return cls(f, tuple(((x + 1) * f - 1) // e for x in range(e)))

    @property
    def num_experts(self) -> int:
        """The number of routed (global) experts."""
        return len(self.owners)

    def local_experts(self, ffn_rank: int) -> tuple[int, ...]:
        """The global experts ``ffn_rank`` holds, ascending (local index = position)."""
        self._check_rank(ffn_rank)
        return self._local[ffn_rank]

    def num_local(self, ffn_rank: int) -> int:
        """How many experts ``ffn_rank`` holds."""
        return len(self.local_experts(ffn_rank))

    def owner(self, expert: int) -> int:
        """The FFN rank holding global ``expert``."""
        if isinstance(expert, bool) or not isinstance(expert, int):
            raise AFDConfigError("expert", expert, f"an int in 0..{self.num_experts - 1}")
        if not 0 <= expert < self.num_experts:
            raise AFDConfigError("expert", expert, f"an int in 0..{self.num_experts - 1}")
        return self.owners[expert]

    def local_index(self, expert: int) -> int:
        """``expert``'s index among its owner's experts."""
        return self._local[self.owner(expert)].index(expert)

    def contiguous_range(self, ffn_rank: int) -> range | None:
        """``ffn_rank``'s experts as a ``range`` when they are contiguous, else ``None``."""
        experts = self.local_experts(ffn_rank)
        r = range(experts[0], experts[-1] + 1)
        return r if len(r) == len(experts) else None

    def owner_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[num_experts]`` int64: the owner of each global expert (for dispatch)."""
        return torch.tensor(self.owners, dtype=torch.int64, device=device)

    def local_table(self, ffn_rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[num_experts]`` int64: each global expert's local index on ``ffn_rank``, -1 elsewhere."""
        table = torch.full((self.num_experts,), -1, dtype=torch.int64)
        for i, e in enumerate(self.local_experts(ffn_rank)):
            table[e] = i
        return table.to(device)

    def localise(
        self,
        ffn_rank: int,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        table: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global top-k ``(weights, ids)`` ``[n, k]`` -> rank-local ``[n, k_local]``.

        ``k_local = min(k, num_local(ffn_rank))``. A token's slots on this rank keep their
        weights (in their top-k order) with local ids; every other slot gets weight 0 and local
        id 0. ``table`` is :meth:`local_table` (pass it to avoid rebuilding it per call).

        Raises:
            AFDConfigError: shapes differ, or an id is outside ``0..num_experts-1``.
        """
        if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2:
            raise AFDConfigError(
                "topk_ids",
                (tuple(topk_ids.shape), tuple(topk_weights.shape)),
                "two [tokens, k] tensors of the same shape",
            )
        if table is None:
            table = self.local_table(ffn_rank, topk_ids.device)
        ids = topk_ids.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_experts):
            raise AFDConfigError(
                "topk_ids",
                (int(ids.min()), int(ids.max())),
                f"expert ids in 0..{self.num_experts - 1}",
            )
        local = table[ids]
        mine = local >= 0
        k_local = min(ids.shape[1], self.num_local(ffn_rank))
        if k_local < ids.shape[1]:
            # Keep a token's own slots first (stable: their top-k order holds); a token has at
            # most num_local of them, so nothing of this rank is cut.
            order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)[:, :k_local]
            local = local.gather(1, order)
            mine = mine.gather(1, order)
            topk_weights = topk_weights.gather(1, order)
        weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        return weights, torch.where(mine, local, torch.zeros_like(local)).to(topk_ids.dtype)

    def _check_rank(self, ffn_rank: int) -> None:
        if isinstance(ffn_rank, bool) or not isinstance(ffn_rank, int):
            raise AFDConfigError("ffn_rank", ffn_rank, f"an int in 0..{self.num_ffn_ranks - 1}")
        if not 0 <= ffn_rank < self.num_ffn_ranks:
            raise AFDConfigError("ffn_rank", ffn_rank, f"an int in 0..{self.num_ffn_ranks - 1}")
