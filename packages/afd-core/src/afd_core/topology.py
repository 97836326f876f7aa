"""World layout, who exchanges data with whom, and where the routed experts live.

World layout (the connector's own world of ``P + F`` ranks, ``P = A x T`` Attention peers):
**Attention peers first**, then FFN ranks::

    world rank:  0 .. P-1              P .. P+F-1
    role:        attention 0..P-1      ffn 0..F-1

The Attention role runs ``A`` data-parallel ranks of ``T`` tensor-parallel workers each
(``attention_tp_size``). **Every TP worker is a peer of the FFN ranks**, with Attention role rank
``dp_rank * T + tp_rank`` (:meth:`AFDTopology.attention_peer`). Why each TP worker and not one
sender per TP group: under plain TP every worker holds the same tokens, so routed TP padding lets
worker ``r`` send only its slice of them (at most ``ceil(N / T)`` rows, none of them padding,
:func:`afd_core.collectives.tp_slice_rows`) and the slices' outputs are all-gathered in TP rank
order. Each real token reaches the FFN exactly once, the bytes per link fall by ``T``, every
worker's own link works in parallel (on accelerators each has its own NIC), and no worker waits
on a broadcast from a sender. The FFN ranks batch all ``P`` peers' rows per ``(layer, stage)``.
With ``T == 1`` a peer is a data-parallel rank, as before.

Exchange: every Attention peer exchanges data with every FFN rank (all to all). With ``F == 1``
the FFN rank serves all ``P`` Attention peers and computes each MoE layer once over their
tokens. With ``F > 1`` the FFN ranks are **expert parallel**: rank ``f`` holds only its share of
the routed experts (:meth:`AFDTopology.expert_map`), and each Attention peer dispatches a token
to the FFN ranks that hold its top-k experts. ``A < F`` is allowed (experts can outgrow
attention). With ``expert_dispatch='ffn'`` (Mega: the FFN compute dispatches among the FFN ranks
itself) a peer sends all of its tokens to one FFN rank, :meth:`AFDTopology.home_ffn_rank`, and
the others an empty transfer: every (layer, stage) still reaches every FFN rank.

Invariants (checked in the tests):

* :meth:`AFDTopology.world_rank` and :meth:`AFDTopology.role_of` are inverse;
* :meth:`AFDTopology.peers_of` of an Attention peer is every FFN world rank, of an FFN rank every
  Attention world rank, both ascending;
* :meth:`AFDTopology.attention_peer` maps ``(dp_rank, tp_rank)`` one to one onto ``0..P-1``;
* :meth:`AFDTopology.expert_map` gives every routed expert exactly one FFN rank.

Elastic FFN ranks (``expert_replicas > 1``): the ``F`` FFN ranks are *slots* (``ffn_rank``), and
each initialisation round is served by the live slots that joined it, ``ffn_members`` (ascending;
``None``: all of them). :meth:`AFDTopology.with_members` gives the round's topology: its world is
``P + len(ffn_members)`` ranks, FFN slot ``ffn_members[i]`` is world rank ``P + i``, the Attention
peers exchange data with the members only, and :meth:`AFDTopology.expert_map` routes each expert
to a live holder (:meth:`afd_core.expert_map.ExpertMap.route`). ``F`` (the slots) and the
replication stay what the config says, so both roles' code paths do not change with the round.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError
from afd_core.expert_map import ExpertMap

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
    """``num_attention_ranks`` (A) data-parallel Attention ranks of ``attention_tp_size`` (T)
    TP workers each (``A x T`` peers) served by ``num_ffn_ranks`` (F) FFN ranks."""

    num_attention_ranks: int
    num_ffn_ranks: int
    attention_tp_size: int = 1
    #: Each routed expert lives on this many FFN slots (``expert_replicas``).
    expert_replicas: int = 1
    #: The FFN slots serving this round (ascending), ``None`` for all ``num_ffn_ranks``.
    ffn_members: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_count("num_attention_ranks", self.num_attention_ranks)
        _check_count("num_ffn_ranks", self.num_ffn_ranks)
        _check_count("attention_tp_size", self.attention_tp_size)
        _check_count("expert_replicas", self.expert_replicas)
        if self.expert_replicas > self.num_ffn_ranks:
            raise AFDConfigError(
                "expert_replicas", self.expert_replicas, f"an integer in 1..{self.num_ffn_ranks}"
            )
        members = self.ffn_members
        if members is not None:
            members = tuple(members)
            if (
                not members
                or any(isinstance(m, bool) or not isinstance(m, int) for m in members)
                or list(members) != sorted(set(members))
                or not 0 <= members[0] <= members[-1] < self.num_ffn_ranks
            ):
                raise AFDConfigError(
                    "ffn_members",
                    self.ffn_members,
                    f"ascending distinct FFN slots in 0..{self.num_ffn_ranks - 1}",
                )
            if members == tuple(range(self.num_ffn_ranks)):
                members = None
            object.__setattr__(self, "ffn_members", members)

    @classmethod
    def from_config(cls, config: AFDConfig) -> AFDTopology:
        """The topology described by ``config`` (every FFN slot a member)."""
        return cls(
            config.num_attention_ranks,
            config.num_ffn_ranks,
            config.attention_tp_size,
            config.expert_replicas,
        )

    @property
    def elastic(self) -> bool:
        """True when rounds may be served by a subset of the FFN slots (``expert_replicas >
        1``)."""
        return self.expert_replicas > 1

    @property
    def members(self) -> tuple[int, ...]:
        """The FFN slots of this round, ascending."""
        if self.ffn_members is None:
            return tuple(range(self.num_ffn_ranks))
        return self.ffn_members

    def with_members(self, members: tuple[int, ...]) -> AFDTopology:
        """This topology for a round served by the FFN slots ``members``."""
        return AFDTopology(
            self.num_attention_ranks,
            self.num_ffn_ranks,
            self.attention_tp_size,
            self.expert_replicas,
            tuple(members),
        )

    def covers(self, members: tuple[int, ...]) -> bool:
        """Whether the FFN slots ``members`` hold every routed expert of :meth:`placement`:
        each slot's own range lives on it and the ``expert_replicas - 1`` slots after it
        (cyclically), and every range is non-empty (``E >= F``), so this needs no expert
        count."""
        live = set(members)
        f, r = self.num_ffn_ranks, self.expert_replicas
        return all(any((p + j) % f in live for j in range(r)) for p in range(f))

    def placement(self, num_experts: int) -> ExpertMap:
        """Where the ``num_experts`` routed experts live over all ``F`` slots (what each FFN slot
        loads): :meth:`ExpertMap.replicated` with ``expert_replicas``."""
        return ExpertMap.replicated(num_experts, self.num_ffn_ranks, self.expert_replicas)

    @property
    def num_attention_peers(self) -> int:
        """``P = A x T``: the Attention role ranks of the connector (one per TP worker)."""
        return self.num_attention_ranks * self.attention_tp_size

    @property
    def world_size(self) -> int:
        """``P + F`` (``P`` + the round's members)."""
        return self.num_attention_peers + len(self.members)

    def role_size(self, role: AFDRole | str) -> int:
        """Number of connector ranks of ``role`` (Attention: the ``P`` peers)."""
        if _role(role) is AFDRole.ATTENTION:
            return self.num_attention_peers
        return self.num_ffn_ranks

    def attention_peer(self, dp_rank: int, tp_rank: int = 0) -> int:
        """The Attention role rank of TP worker ``tp_rank`` of data-parallel rank ``dp_rank``:
        ``dp_rank * T + tp_rank``."""
        for name, value, size in (
            ("data_parallel_rank", dp_rank, self.num_attention_ranks),
            ("tp_rank", tp_rank, self.attention_tp_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise AFDConfigError(name, value, f"an integer in 0..{size - 1}")
        return dp_rank * self.attention_tp_size + tp_rank

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
        members = self.members
        if role_rank not in members:
            raise AFDConfigError(
                "ffn_rank", role_rank, f"an FFN slot serving this round (one of {members})"
            )
        return self.num_attention_peers + members.index(role_rank)

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
        if world_rank < self.num_attention_peers:
            return AFDRole.ATTENTION, world_rank
        return AFDRole.FFN, self.members[world_rank - self.num_attention_peers]

    @property
    def expert_parallel(self) -> bool:
        """True when the routed experts are split over several FFN ranks (``F > 1``)."""
        return self.num_ffn_ranks > 1

    def attention_ranks_for(self, ffn_rank: int) -> tuple[int, ...]:
        """Attention role ranks (peers) served by ``ffn_rank``: all of them, ascending."""
        self.check_role_rank(AFDRole.FFN, ffn_rank)
        return tuple(range(self.num_attention_peers))

    def ffn_ranks_for(self, attention_rank: int) -> tuple[int, ...]:
        """FFN role ranks ``attention_rank`` sends to: all of the round's, ascending."""
        self.check_role_rank(AFDRole.ATTENTION, attention_rank)
        return self.members

    def home_ffn_rank(self, attention_rank: int) -> int:
        """The FFN rank (of the round's, by index) that gets all of ``attention_rank``'s tokens
        when the FFN compute dispatches them itself (``expert_dispatch='ffn'``): consecutive
        Attention peers share one, ``attention_rank * F // P`` (``P`` peers, ``F`` the round's
        FFN ranks), so with ``P >= F`` every FFN rank serves ``P / F`` of them, and with
        ``P < F`` some FFN ranks get no tokens of their own (they still join each dispatch)."""
        self.check_role_rank(AFDRole.ATTENTION, attention_rank)
        return attention_rank * len(self.members) // self.num_attention_peers

    def peers_of(self, role: AFDRole | str, role_rank: int) -> tuple[int, ...]:
        """World ranks this rank exchanges data with (every rank of the other role)."""
        if _role(role) is AFDRole.ATTENTION:
            return tuple(self.world_rank(AFDRole.FFN, f) for f in self.ffn_ranks_for(role_rank))
        return tuple(
            self.world_rank(AFDRole.ATTENTION, a) for a in self.attention_ranks_for(role_rank)
        )

    def expert_map(self, num_experts: int) -> ExpertMap:
        """Which rank of this round computes each of the ``num_experts`` routed experts: the
        :meth:`placement` routed over the round's members (:meth:`ExpertMap.route`; with every
        slot a member and one replica, balanced contiguous ranges). Both roles take the map from
        here, so a different placement (non-contiguous, EPLB) replaces it in one place."""
        return self.placement(num_experts).route(self.members)
