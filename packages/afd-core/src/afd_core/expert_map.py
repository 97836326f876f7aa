"""Which FFN rank holds which routed expert, and which one computes it (expert parallelism).

An :class:`ExpertMap` routes each of ``num_experts`` routed (global) experts to exactly one FFN
rank, its *owner*; a rank *holds* (has loaded) at least the experts it owns. On its rank an expert
has a *local* index: its position among the experts the rank holds, ascending by global index.
The default placement, :meth:`ExpertMap.contiguous`, gives rank ``f`` the experts
``[floor(f*E/F), floor((f+1)*E/F))``: ranges differ by at most one expert, and every rank holds
exactly what it owns. Any other assignment (non-contiguous, an EPLB placement) is an ``owners``
tuple.

Replicas (``expert_replicas: R``): :meth:`ExpertMap.replicated` places expert ``e`` on the ``R``
FFN ranks ``p(e), p(e)+1, ..., p(e)+R-1`` (mod ``F``), where ``p(e)`` is its contiguous owner, so
every rank holds ``R`` neighbouring ranges (about ``R*E/F`` experts) and any ``R-1`` ranks may be
lost without losing an expert. :meth:`ExpertMap.route` gives the map of a *round* whose FFN ranks
are a live subset (``members``) of those slots: each expert goes to its first live replica in that
order, so with every slot live the routing is exactly the contiguous one (the same tokens reach
the same experts as with ``R = 1``), and a lost slot's experts move to the next live holder.

Invariants (checked at construction and in the tests):

* every expert has exactly one owner in ``0..F-1``, every FFN rank owns at least one expert
  (``E >= F``), and holds every expert it owns;
* ``local_experts(f)`` (the held experts) is ascending and ``local_index(e)`` is ``e``'s
  position among its owner's;
* :meth:`localise` maps a token's top-k slots to rank-local ids; slots the rank does not hold (or
  marked ``-1``: routed elsewhere, see :attr:`ExpertMap.replicated_routing`) get weight exactly 0
  and a valid local id, so the rank's output for the token is the sum over its own experts only.
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
    """``owners[e]`` is the FFN rank computing routed expert ``e``; ``held[f]`` (default: the
    experts ``f`` owns) what rank ``f`` has loaded; ``slots[f]`` the FFN slot (``ffn_rank``) rank
    ``f`` is in a round map of :meth:`route` (default ``f``)."""

    num_ffn_ranks: int
    owners: tuple[int, ...]
    held: tuple[tuple[int, ...], ...] | None = None
    slots: tuple[int, ...] | None = None
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
        owned = tuple(tuple(e for e, o in enumerate(owners) if o == r) for r in range(f))
        for r, experts in enumerate(owned):
            if not experts:
                raise AFDConfigError("owners", owners, f"a placement giving FFN rank {r} experts")
        local = owned
        if self.held is not None:
            held = tuple(tuple(sorted(set(h))) for h in self.held)
            if len(held) != f:
                raise AFDConfigError("held", self.held, f"{f} tuples (one per FFN rank)")
            for r, experts in enumerate(held):
                if not set(owned[r]) <= set(experts) or (experts and experts[-1] >= len(owners)):
                    raise AFDConfigError(
                        f"held[{r}]",
                        experts,
                        f"expert ids in 0..{len(owners) - 1} including every expert rank {r} "
                        f"owns {owned[r]}",
                    )
            local = held
            object.__setattr__(self, "held", None if held == owned else held)
        slots = tuple(range(f)) if self.slots is None else tuple(self.slots)
        if len(slots) != f or len(set(slots)) != f:
            raise AFDConfigError("slots", self.slots, f"{f} distinct FFN slots (one per rank)")
        object.__setattr__(self, "slots", slots)
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

    @classmethod
    def replicated(cls, num_experts: int, num_ffn_ranks: int, replicas: int) -> ExpertMap:
        """Every expert on ``replicas`` neighbouring slots of its contiguous owner (module
        docstring), routed to that owner; ``replicas == 1`` is :meth:`contiguous`."""
        base = cls.contiguous(num_experts, num_ffn_ranks)
        f = base.num_ffn_ranks
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= f:
            raise AFDConfigError("expert_replicas", replicas, f"an integer in 1..{f}")
        held = tuple(
            tuple(e for e, p in enumerate(base.owners) if (r - p) % f < replicas) for r in range(f)
        )
        return cls(f, base.owners, held=held)

    @property
    def replicated_routing(self) -> bool:
        """True when some rank holds experts it does not compute (replicas): the sender then
        marks, per rank, the top-k slots routed elsewhere ``-1`` (:meth:`routed_ids`)."""
        return self.held is not None

    def replicas(self, expert: int) -> tuple[int, ...]:
        """The ranks holding ``expert``, in routing preference order (its owner first, then the
        next ranks cyclically)."""
        owner = self.owner(expert)
        f = self.num_ffn_ranks
        return tuple(r for r in ((owner + j) % f for j in range(f)) if expert in self._local[r])

    def route(self, members: tuple[int, ...]) -> ExpertMap:
        """The map of a round served by the live slots ``members`` (ascending, distinct): rank
        ``i`` of the round is slot ``members[i]`` and holds what that slot holds; each expert
        goes to its first live replica (:meth:`replicas`).

        Raises:
            AFDConfigError: ``members`` is not an ascending tuple of distinct slots, or they do
                not hold every expert (naming the first expert no live slot holds).
        """
        f = self.num_ffn_ranks
        if (
            not isinstance(members, tuple)
            or not members
            or list(members) != sorted(set(members))
            or any(isinstance(m, bool) or not isinstance(m, int) for m in members)
            or not 0 <= members[0] <= members[-1] < f
        ):
            raise AFDConfigError("members", members, f"ascending distinct FFN slots in 0..{f - 1}")
        if members == tuple(range(f)):
            return self
        index = {m: i for i, m in enumerate(members)}
        owners = []
        for e in range(self.num_experts):
            live = [r for r in self.replicas(e) if r in index]
            if not live:
                raise AFDConfigError(
                    "members",
                    members,
                    f"FFN slots holding every routed expert (expert {e} lives only on slots "
                    f"{self.replicas(e)})",
                )
            owners.append(index[live[0]])
        held = tuple(self._local[m] for m in members)
        return ExpertMap(len(members), tuple(owners), held=held, slots=members)

    @property
    def num_experts(self) -> int:
        """The number of routed (global) experts."""
        return len(self.owners)

    def local_experts(self, ffn_rank: int) -> tuple[int, ...]:
        """The global experts ``ffn_rank`` holds (has loaded), ascending (local index =
        position)."""
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
        """``expert``'s index among the experts its owner holds."""
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
        """``[num_experts]`` int64: each held global expert's local index on ``ffn_rank``, -1
        for the experts it does not hold."""
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

        ``k_local = min(k, num_local(ffn_rank))``. A token's slots on experts this rank holds
        keep their weights (in their top-k order) with local ids; every other slot, and a slot
        the sender marked ``-1`` (routed to another replica), gets weight 0 and local id 0.
        ``table`` is :meth:`local_table` (pass it to avoid rebuilding it per call).

        Raises:
            AFDConfigError: shapes differ, or an id is outside ``-1..num_experts-1``.
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
        if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= self.num_experts):
            raise AFDConfigError(
                "topk_ids",
                (int(ids.min()), int(ids.max())),
                f"expert ids in 0..{self.num_experts - 1} (-1: routed to another replica)",
            )
        local = torch.where(ids >= 0, table[ids.clamp(min=0)], -1)
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

    def routed_ids(
        self, ffn_rank: int, topk_ids: torch.Tensor, owner_table: torch.Tensor
    ) -> torch.Tensor:
        """``topk_ids`` (global, ``[n, k]``) with every slot not routed to ``ffn_rank`` set to
        ``-1``: what a rank that holds replicas gets, so it computes only what it owns."""
        return torch.where(
            owner_table[topk_ids.long()] == ffn_rank, topk_ids, torch.full_like(topk_ids, -1)
        )

    def _check_rank(self, ffn_rank: int) -> None:
        if isinstance(ffn_rank, bool) or not isinstance(ffn_rank, int):
            raise AFDConfigError("ffn_rank", ffn_rank, f"an int in 0..{self.num_ffn_ranks - 1}")
        if not 0 <= ffn_rank < self.num_ffn_ranks:
            raise AFDConfigError("ffn_rank", ffn_rank, f"an int in 0..{self.num_ffn_ranks - 1}")
