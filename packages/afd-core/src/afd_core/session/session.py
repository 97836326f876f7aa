"""One rank's session: what every transport shares between connecting and byte movement.

A session runs on a rendezvous store (P2P: a TCPStore behind the access gate; in-process: a
``HashStore``) and, per initialisation of a connector:

1. joins the newest round and claims its world rank there (:mod:`~afd_core.session.rounds`);
   its keys live under ``afd/g<round>``; with elastic FFN ranks (:class:`ElasticSeat`) the round's
   FFN slots are decided first (:mod:`~afd_core.session.membership`) and fix the world;
2. handshakes: publishes this rank's agreement fields (protocol version, config agreement fields
   and hash, model identity, topology, payload spec, ...) and compares every peer's
   (:mod:`~afd_core.session.handshake`), raising :class:`AFDHandshakeError` naming the first
   differing field on every rank; then a barrier;
3. lets the transport set up its byte movement (process groups, queues) on
   :attr:`AFDSession.store`;
4. a ``ready`` barrier; then liveness (:mod:`~afd_core.session.liveness`);
5. at a clean close says goodbye; any failure is published (sticky, first wins) through the
   :class:`~afd_core.session.startup.StartupCoordinator`, where every peer's wait looks.

Every wait is bounded by the deadline the connector passes (``startup_timeout_s``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from afd_core.errors import AFDPeerError
from afd_core.session import liveness, membership
from afd_core.session.handshake import _compare_handshake
from afd_core.session.rounds import claim_round, current_round, round_prefix
from afd_core.session.startup import StartupCoordinator, StartupFailure

__all__ = ["AFDSession", "ElasticSeat", "publish_startup_failure"]


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


@dataclass(frozen=True)
class ElasticSeat:
    """A rank of a world whose FFN slots vary by round (:mod:`~afd_core.session.membership`):
    ``P`` Attention peers (world ranks ``0..P-1``), ``num_slots`` FFN slots, this rank's FFN
    ``slot`` (``None`` on an Attention peer) and ``covers(members)``: whether slots hold every
    routed expert."""

    num_attention_peers: int
    num_slots: int
    slot: int | None
    covers: Callable[[tuple[int, ...]], bool]
    #: World rank 0: the slots the round should wait for before :data:`~afd_core.session.
    #: membership.SETTLE_S` (the previous round's, less one whose failure ended it); ``None``:
    #: every slot, or the settle time.
    expected: tuple[int, ...] | None = None


class AFDSession:
    """One initialisation of one world rank (see the module docstring)."""

    def __init__(
        self,
        root: Any,
        *,
        world_rank: int,
        world_size: int,
        who: str,
        startup_timeout_s: float,
        served_by: tuple[str, int] | None = None,
        elastic: ElasticSeat | None = None,
    ) -> None:
        self.root = root
        self.elastic = elastic
        #: The FFN slots serving the round (``None`` until :meth:`claim`; all of them unless
        #: ``elastic``).
        self.members: tuple[int, ...] | None = None
        #: World rank 0 of an elastic world: the join count its round formed at.
        self.joins_seen = 0
        self.served_by = served_by
        self.world_rank = world_rank
        self.world_size = world_size
        self.who = who
        self.startup_timeout_s = startup_timeout_s
        #: The round this session joined (0 until :meth:`claim`).
        self.generation = 0
        #: The round's namespace of the root store (``None`` until :meth:`claim`).
        self.store: Any = None
        self.coordinator: StartupCoordinator | None = None
        self._stop = threading.Event()
        self._closed = False

    # -- startup ---------------------------------------------------------------------------

    def claim(self, deadline: float) -> None:
        """Join the newest round, claim this world rank; set up :attr:`store` and
        :attr:`coordinator`. Elastic: also decide (world rank 0) or learn the round's FFN
        slots, which fix :attr:`world_size` and an FFN slot's :attr:`world_rank`."""
        if self.elastic is None:
            self.generation = claim_round(
                self.root,
                self.world_rank,
                deadline,
                who=self.who,
                startup_timeout_s=self.startup_timeout_s,
                served_by=self.served_by,
            )
            self.store = dist.PrefixStore(round_prefix(self.generation), self.root)
        else:
            self._claim_elastic(self.elastic, deadline)
        self.coordinator = StartupCoordinator(
            self.store,
            rank=self.world_rank,
            world_size=self.world_size,
            timeout_s=self.startup_timeout_s,
        )

    def _claim_elastic(self, seat: ElasticSeat, deadline: float) -> None:
        timeout = self.startup_timeout_s
        if seat.slot is None:  # an Attention peer
            self.generation = claim_round(
                self.root, self.world_rank, deadline, who=self.who, startup_timeout_s=timeout
            )
            self.store = dist.PrefixStore(round_prefix(self.generation), self.root)
            if self.world_rank == 0:
                self.members, self.joins_seen = membership.form_members(
                    self.store,
                    self.root,
                    seat.num_slots,
                    seat.covers,
                    deadline,
                    startup_timeout_s=timeout,
                    expected=seat.expected,
                )
            else:
                self.members = membership.await_members(
                    self.store, deadline, who=self.who, startup_timeout_s=timeout
                )
        else:
            slot, after = seat.slot, 0
            while True:
                self.generation = claim_round(
                    self.root,
                    self.world_rank,
                    deadline,
                    who=self.who,
                    startup_timeout_s=timeout,
                    served_by=self.served_by,
                    claim_key=membership.slot_claim(slot),
                    after=after,
                    holder_rank=lambda n: self._holder(n, seat),
                )
                self.store = dist.PrefixStore(round_prefix(self.generation), self.root)
                self.members = membership.await_members(
                    self.store, deadline, who=self.who, startup_timeout_s=timeout
                )
                if slot in self.members:
                    break
                membership.note_join(self.root, slot)
                after = self.generation
            self.world_rank = seat.num_attention_peers + self.members.index(slot)
        self.world_size = seat.num_attention_peers + len(self.members)

    def _holder(self, number: int, seat: ElasticSeat) -> int | None:
        """The world rank FFN ``seat.slot`` has in round ``number`` (``None`` when that round
        formed without it, or has not formed yet)."""
        store = dist.PrefixStore(round_prefix(number), self.root)
        if not store.check([membership.MEMBERS_KEY]):
            return None
        members = json.loads(store.get(membership.MEMBERS_KEY).decode("utf-8"))
        if seat.slot not in members:
            return None
        return seat.num_attention_peers + members.index(seat.slot)

    def joins_pending(self) -> bool:
        """World rank 0 of an elastic world: whether an FFN slot asked to join since this round
        formed (never raises: False when the store is gone)."""
        if self.elastic is None or self.world_rank != 0 or self._closed:
            return False
        try:
            return membership.joins_pending(self.root, self.joins_seen)
        except Exception:
            return False

    def handshake(self, mine: Mapping[str, Any], deadline: float) -> None:
        """Publish ``mine``, wait for every peer's publication, compare field by field
        (:class:`AFDHandshakeError` on the first difference), then a barrier."""
        coord = self._coord()
        self.store.set(f"hs/{self.world_rank}", json.dumps(dict(mine), sort_keys=True))
        others = [r for r in range(self.world_size) if r != self.world_rank]
        coord.wait_keys({r: f"hs/{r}" for r in others}, "handshake", timeout_s=_remaining(deadline))
        for peer in others:
            theirs = json.loads(self.store.get(f"hs/{peer}").decode("utf-8"))
            _compare_handshake(mine, theirs, peer)
        coord.barrier("handshake", timeout_s=_remaining(deadline))

    def ready(
        self,
        deadline: float,
        *,
        beat: bool,
        watch: Sequence[int],
        on_lost: Callable[[AFDPeerError], None],
    ) -> None:
        """The ``ready`` barrier, a last check for failures published meanwhile, then liveness:
        beat this rank's heartbeat (``beat``) and watch the ``watch`` peers'."""
        coord = self._coord()
        coord.barrier("ready", timeout_s=_remaining(deadline))
        # A rank may publish ready and then fail (e.g. cancelled inside this barrier).
        coord.raise_if_failed()
        liveness.start_liveness(
            self.store, self.world_rank, beat=beat, watch=watch, on_lost=on_lost, stop=self._stop
        )

    # -- failures --------------------------------------------------------------------------

    def publish_failure(self, stage: str, reason: str) -> bool:
        """Publish this rank's failure (first one wins); never raises."""
        coord = self.coordinator
        return False if coord is None else coord.publish_failure(stage, reason)

    def failure_of(self, rank: int | None) -> StartupFailure | None:
        """The failure ``rank`` published (``None``: the lowest failed peer's); never raises."""
        coord = self.coordinator
        if coord is None:
            return None
        try:
            return coord.first_failure() if rank is None else coord.failure_of(rank)
        except Exception:
            return None

    def peer_gone(self, rank: int) -> AFDPeerError | None:
        """Why peer ``rank`` cannot answer any more (it published a failure or said goodbye),
        else ``None``; for transports that wait on a peer without a link that would drop."""
        failure = self.failure_of(rank)
        if failure is not None:
            return AFDPeerError(failure.rank, failure.stage, failure.reason)
        if self.store is not None and liveness.has_left(self.store, rank):
            return AFDPeerError(rank, "goodbye", "left the session (closed)")
        return None

    # -- end -------------------------------------------------------------------------------

    def close(self, *, goodbye: bool) -> None:
        """Stop liveness; with ``goodbye`` tell the peers this rank left cleanly. Idempotent."""
        self._stop.set()
        if goodbye and not self._closed and self.store is not None:
            liveness.say_goodbye(self.store, self.world_rank)
        self._closed = True

    def _coord(self) -> StartupCoordinator:
        if self.coordinator is None:
            raise RuntimeError("AFD session used before claim()")
        return self.coordinator


def publish_startup_failure(
    root: Any,
    *,
    world_rank: int,
    world_size: int,
    stage: str,
    reason: str,
    deadline: float,
    timeout_s: float,
) -> bool:
    """Publish the failure of ``world_rank`` in ``stage`` before its ``init`` (e.g. while
    loading its model) into the round its peers' current initialisation looks at (world rank 0
    opens a new one); never raises; True when it reached the store."""
    try:
        number = current_round(root, world_rank, deadline)
        if number == 0:
            return False
        coord = StartupCoordinator(
            dist.PrefixStore(round_prefix(number), root),
            rank=world_rank,
            world_size=world_size,
            timeout_s=timeout_s,
        )
        return coord.publish_failure(stage, reason)
    except Exception:
        return False
