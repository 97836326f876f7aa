"""A connector whose lifecycle is the shared session (:mod:`afd_core.session`).

:class:`AFDSessionConnector` implements ``init`` / ``close`` / ``abort`` / failure handling /
``publish_startup_failure`` once for every transport: rendezvous store (from the transport),
round claim, handshake (config, model identity, ``num_stages``, ``role_agreement``, the
transport's protocol version), the transport's own setup (``open_groups``), the ready barrier and
liveness (``confirm_ready``: FFN ranks beat, Attention ranks watch their FFN peers) and the goodbye
at ``close``. ``init`` is both steps; a caller that binds to the groups (afd-runtime's Mega) runs
them apart and binds in between.

A transport implements:

* ``_rendezvous(config, world_rank, timeout_s)`` (classmethod): the root store of the world;
* ``_open_transport(session, deadline)``: its byte movement on ``session.store`` (e.g. process
  groups), within the startup deadline;
* ``_close_transport()``: release it (idempotent, safe after a partial setup);
* the data plane of :class:`~afd_core.connector.base.AFDConnectorBase`, calling
  :meth:`AFDSessionConnector._fail` on any transport error (it publishes this rank's failure,
  records it as ``peer_failure``, closes and raises :class:`AFDPeerError` /
  :class:`AFDTimeoutError`).
"""

from __future__ import annotations

import time
import traceback
from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, NoReturn

import torch

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.base import AFDConnectorBase, AFDGroupInfo
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDNotInitializedError,
    AFDPeerError,
    AFDRankServedError,
    AFDStartupError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.handshake import _handshake_fields
from afd_core.session.session import AFDSession, ElasticSeat, publish_startup_failure
from afd_core.session.startup import StartupCoordinator
from afd_core.topology import AFDTopology

__all__ = ["AFDSessionConnector"]


class AFDSessionConnector(AFDConnectorBase):
    """Base of the connectors built on :class:`~afd_core.session.AFDSession`."""

    #: The transport's wire protocol version (compared first in the handshake).
    protocol_version: ClassVar[int] = 1
    #: How errors name the transport (``"P2P"``).
    label: ClassVar[str] = "session"

    def __init__(
        self,
        config: AFDConfig,
        topology: AFDTopology | None = None,
        role_rank: int = 0,
        *,
        payload_spec: AFDPayloadSpec,
        num_layers: int,
        device: torch.device | str | None = None,
        role_agreement: Mapping[str, Any] | None = None,
        model_identity: Mapping[str, Any] | None = None,
        num_draft_layers: int = 0,
    ) -> None:
        super().__init__(
            config,
            topology,
            role_rank,
            payload_spec=payload_spec,
            num_layers=num_layers,
            device=device,
            role_agreement=role_agreement,
            model_identity=model_identity,
            num_draft_layers=num_draft_layers,
        )
        #: The configured topology (every FFN slot); :attr:`topology` is the current round's.
        self.full_topology = self.topology
        self._session: AFDSession | None = None
        self._opened = False  # open_groups() succeeded (confirm_ready() may follow)
        self._initialized = False
        self._generation = 0
        self._deadline = 0.0

    # -- transport hooks -------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def _rendezvous(cls, config: AFDConfig, world_rank: int, timeout_s: float) -> Any:
        """The world's root store (world rank 0 owns it); bounded by ``timeout_s``."""

    @abstractmethod
    def _open_transport(self, session: AFDSession, deadline: float) -> None:
        """Set up byte movement on ``session.store`` before ``deadline`` (monotonic)."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Release the transport (idempotent; safe after a partial ``_open_transport``)."""

    # -- state -----------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def generation(self) -> int:
        """The round of this rank's latest initialisation against the current store."""
        return self._generation

    @property
    def session(self) -> AFDSession | None:
        """The session of the current initialisation (``None`` when closed)."""
        return self._session

    @property
    def coordinator(self) -> StartupCoordinator | None:
        """The startup coordinator of the current initialisation (``None`` when closed)."""
        return None if self._session is None else self._session.coordinator

    def handshake_fields(self) -> dict[str, Any]:
        """What this rank publishes at init; every field must match on every rank (``role``
        and ``role_agreement`` only between ranks of the same role)."""
        return _handshake_fields(
            self.config,
            self.topology,
            self.payload_spec,
            self.num_layers,
            self.device,
            self.role_agreement,
            self.model_identity,
            protocol_version=self.protocol_version,
            num_draft_layers=self.num_draft_layers,
        )

    def _ffn_group(self, name: str) -> AFDGroupInfo:
        """This FFN rank's place in the group of the round's FFN ranks (FFN-rank order), the
        group a transport opens when ``config.needs_ffn_group``; ``name``: its label."""
        size = len(self.topology.members)
        rank = self.world_rank - self.topology.num_attention_peers
        peers = tuple(r for r in range(size) if r != rank)
        return AFDGroupInfo(name=name, world_size=size, rank=rank, peer_ranks=peers)

    def _who(self) -> str:
        return f"{self.role} {self.role_rank}"

    def membership_pending(self) -> bool:
        """World rank 0 of an elastic world (``expert_replicas > 1``): an FFN slot waits to
        join, so the round should be formed again at the next step boundary."""
        session = self._session
        return session is not None and self._initialized and session.joins_pending()

    def _elastic_seat(self) -> ElasticSeat | None:
        topo = self.full_topology
        if not topo.elastic:
            return None
        return ElasticSeat(
            num_attention_peers=topo.num_attention_peers,
            num_slots=topo.num_ffn_ranks,
            slot=None if self.role is AFDRole.ATTENTION else self.role_rank,
            covers=topo.covers,
            expected=self._expected_members(),
        )

    def _expected_members(self) -> tuple[int, ...] | None:
        """World rank 0, before a new round: the previous round's FFN slots, less the one
        whose failure ended it (``None`` before the first round, or when the previous round's
        topology is gone)."""
        if self.world_rank != 0 or self._generation == 0:
            return None
        previous = self.topology
        members = previous.members
        failure = self._failure
        rank = failure.rank if isinstance(failure, AFDPeerError) else None
        if isinstance(rank, int) and 0 <= rank < previous.world_size:
            role, slot = previous.role_of(rank)
            if role is AFDRole.FFN:
                members = tuple(m for m in members if m != slot)
        return members

    # -- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        """The whole start: :meth:`open_groups`, then :meth:`confirm_ready`."""
        if self._initialized:
            return
        self.open_groups()
        self.confirm_ready()

    def open_groups(self) -> None:
        """Start up to the ready barrier: rendezvous, round claim, handshake, the transport's
        groups. The peers are not told this rank is ready yet: a compute that binds to the
        groups (:meth:`data_process_group`, :meth:`group_info`) binds now, then the caller runs
        :meth:`confirm_ready`, or :meth:`abort` naming the failed stage (every peer's start then
        fails naming this rank, the stage and the reason). Idempotent; all waits share the
        start-up deadline (``startup_timeout_s`` from here)."""
        if self._initialized or self._opened:
            return
        seat = self._elastic_seat()  # reads the previous round's topology and failure
        self._clear_failure()
        stage = "connect"
        startup_s = self.config.startup_timeout_s
        try:
            deadline = self._deadline = time.monotonic() + startup_s
            self.topology = self.full_topology
            root = self._rendezvous(self.config, self.world_rank, startup_s)
            session = self._session = AFDSession(
                root,
                world_rank=self.world_rank,
                world_size=self.topology.world_size,
                who=self._who(),
                startup_timeout_s=startup_s,
                # FFN ranks beat a heartbeat while they serve: a second claimant of a live one
                # is refused at once instead of waiting for a round that never opens.
                served_by=None if self.role is AFDRole.ATTENTION else ("ffn_rank", self.role_rank),
                elastic=seat,
            )
            stage = "claim"
            session.claim(deadline)
            self._generation = session.generation
            if session.members is not None:
                self.topology = self.full_topology.with_members(session.members)
            stage = "handshake"
            session.handshake(self.handshake_fields(), deadline)
            stage = "process_groups"
            self._open_transport(session, deadline)
        except BaseException as err:
            self._start_failed(err, stage)
        self._opened = True

    def confirm_ready(self) -> None:
        """Finish the start after :meth:`open_groups`: the ready barrier (every rank of the
        world), then liveness (FFN ranks beat, Attention ranks watch their FFN peers).

        Raises:
            AFDNotInitializedError: :meth:`open_groups` did not run (or failed).
        """
        if self._initialized:
            return
        session = self._session
        if not self._opened or session is None:
            raise AFDNotInitializedError(
                f"AFD {self.label} world rank {self.world_rank}: confirm_ready() before "
                "open_groups()"
            )
        try:
            is_attention = self.role is AFDRole.ATTENTION
            session.ready(
                self._deadline,
                beat=not is_attention,
                watch=self.topology.peers_of(AFDRole.ATTENTION, self.role_rank)
                if is_attention
                else (),
                on_lost=self._on_lost(session),
            )
        except BaseException as err:
            self._start_failed(err, "ready")
        self._initialized = True

    def _start_failed(self, err: BaseException, stage: str) -> NoReturn:
        """Publish this rank's failure in ``stage`` (unless a peer's or another live process's
        made it), tear down, raise ``err`` or its connector-error form."""
        # A rank served by another live process must not publish into that process's round.
        if self._session is not None and not isinstance(
            err, AFDStartupError | AFDPeerError | AFDRankServedError
        ):
            self._session.publish_failure(stage, f"{type(err).__name__}: {err}")
        self._shutdown(goodbye=False)
        # Exit requests (KeyboardInterrupt, SystemExit) and cancellation keep their type:
        # the process is stopping, which is not a peer's failure.
        if not isinstance(err, Exception) or isinstance(err, AFDConnectorError | AFDConfigError):
            raise err
        text = str(err).lower()
        if isinstance(err, TimeoutError) or "timeout" in text or "timed out" in text:
            raise AFDTimeoutError(
                f"AFD {self.label} init of world rank {self.world_rank} timed out in stage "
                f"{stage!r}: {err}"
            ) from err
        raise AFDPeerError(None, stage, f"{type(err).__name__}: {err}") from err

    def _on_lost(self, session: AFDSession) -> Any:
        def lost(failure: AFDPeerError) -> None:
            if self._session is session:  # not a previous initialisation's watcher
                self._record_failure(failure)

        return lost

    def close(self) -> None:
        """Say goodbye to the peers (a clean leave: initialised, no failure recorded), release
        the transport; idempotent.

        Also drops the local variables of the finished frames in the recorded failure's
        traceback chain (its text and stack stay): a failed operation's frames hold the
        transport's pending requests, and through them its connections, which would stay open
        as long as anything keeps the failure (the Attention link does, until it reconnects),
        so a peer blocked on this rank would wait out ``timeout_s`` instead of failing at once."""
        self._shutdown(goodbye=self._initialized and self._failure is None)
        _release_frames(self._failure)

    def _shutdown(self, *, goodbye: bool) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close(goodbye=goodbye)
        self._close_transport()
        self._opened = self._initialized = False

    def announce_leave(self) -> bool:
        """Say this rank's goodbye on the session now and stop its heartbeat (the peers'
        watchers report the leave at their next look); the transport stays open until
        :meth:`close`. False before ``init``, after a failure or once closed."""
        session = self._session
        if session is None or not self._initialized or self._failure is not None:
            return False
        session.close(goodbye=True)
        return True

    def abort(self, op: str, reason: str) -> None:
        """Publish this rank's failure (``op``, ``reason``), then close without a goodbye: the
        peers' waits fail at once naming this rank and ``reason``."""
        session = self._session
        if session is not None:
            session.publish_failure(op, reason)
        self._shutdown(goodbye=False)

    # -- failure handling ------------------------------------------------------------------

    def _fail(self, err: BaseException, op: str, peer: int | None) -> NoReturn:
        """Classify ``err``, publish this rank's failure, tear down, raise.

        Preference: the failure the awaited ``peer`` published; else a timeout (attributed to a
        failed rank if one published); else the transport error attributed to ``peer`` (it
        died or closed); else any published failure.
        """
        session = self._session

        def published(rank: int | None) -> Any:
            return None if session is None else session.failure_of(rank)

        text = str(err)
        exc: AFDConnectorError
        peer_failure = published(peer) if peer is not None else None
        if isinstance(err, AFDConnectorError):
            exc = err
        elif peer_failure is not None:
            exc = AFDPeerError(peer_failure.rank, peer_failure.stage, peer_failure.reason)
        elif "timed out" in text.lower() or "application timeout" in text.lower():
            other = published(None)
            if other is not None:
                exc = AFDPeerError(other.rank, other.stage, other.reason)
            else:
                exc = AFDTimeoutError(
                    f"AFD {self.label} {op} with world rank {peer} did not complete within "
                    f"{self.config.timeout_s:g}s: {text}"
                )
        elif peer is not None:
            exc = AFDPeerError(peer, op, text)
        else:
            other = published(None)
            exc = (
                AFDPeerError(other.rank, other.stage, other.reason)
                if other is not None
                else AFDPeerError(None, op, text)
            )
        if session is not None:
            session.publish_failure(op, f"{type(exc).__name__}: {exc}")
        self._record_failure(exc)
        self._shutdown(goodbye=False)
        if exc is err:
            raise exc
        raise exc from err

    @classmethod
    def publish_startup_failure(
        cls,
        config: AFDConfig,
        role_rank: int,
        stage: str,
        reason: str,
        *,
        timeout_s: float | None = None,
    ) -> bool:
        """Publish the failure of this rank (``config.role``, ``role_rank``) in ``stage`` on the
        rendezvous store, for a rank that fails before its ``init`` (e.g. loading its model): the
        peers' ``init`` then raises :class:`AFDStartupError` naming this rank, ``stage`` and
        ``reason`` at once instead of waiting ``startup_timeout_s``.

        Connects like ``init`` (into world rank 0's current round: the failure lands where the
        peers' current initialisation looks; world rank 0 itself opens a new round for it),
        publishes, disconnects. Bounded by ``timeout_s`` (default ``config.startup_timeout_s``);
        never raises; True when the failure reached the store. An elastic FFN slot
        (``expert_replicas > 1``) publishes nothing: no round waits for it."""
        try:
            topology = AFDTopology.from_config(config)
            if topology.elastic and config.role is AFDRole.FFN:
                # An elastic FFN slot has no world rank before a round takes it, and a round
                # forms without a slot that never claims: nobody waits for this one.
                return False
            world_rank = topology.world_rank(config.role, role_rank)
            wait_s = config.startup_timeout_s if timeout_s is None else float(timeout_s)
            deadline = time.monotonic() + wait_s
            root = cls._rendezvous(config, world_rank, wait_s)
            return publish_startup_failure(
                root,
                world_rank=world_rank,
                world_size=topology.world_size,
                stage=stage,
                reason=reason,
                deadline=deadline,
                timeout_s=wait_s,
            )
        except Exception:
            return False


def _release_frames(exc: BaseException | None) -> None:
    """Clear the finished frames of ``exc``'s traceback and of its causes' and contexts'
    (:func:`traceback.clear_frames` skips frames still executing)."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]
