"""One P2P connector rank's state, lifecycle and failure handling, shared by both sides.

:class:`_P2PLifecycle` holds the state of a rank (both roles' fields; a rank uses its role's),
runs the collective ``init`` (store, generation namespace, rank claim, handshake, process
groups, all within ``config.startup_timeout_s``), ``close``/``abort``, and turns every transport
error into a published failure, a teardown and an :class:`AFDPeerError` or
:class:`AFDTimeoutError` (:meth:`_P2PLifecycle._fail`). It also holds what both sides use: the
metadata checks, the stage tags and the receive-ahead window. The Attention side
(:mod:`afd_core.p2p.attention`) and the FFN side (:mod:`afd_core.p2p.ffn`) build on it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
import threading
import time
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from afd_core.access import deployment_secret, local_address
from afd_core.buffers import RecvBufferPool
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnectorBase, AFDGroupInfo, AFDTransferHandle, ReadyHook
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDNotInitializedError,
    AFDPayloadError,
    AFDPeerError,
    AFDReadyHookError,
    AFDStartupError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDControlMessage, AFDPayloadSpec, AFDTransferMetadata
from afd_core.p2p.groups import _LONG_WAIT, backend_for_device, make_process_group
from afd_core.p2p.handshake import _compare_handshake, _handshake_fields
from afd_core.p2p.recv_ahead import RECV_AHEAD_BYTES, _PendingRecv, _PostedRecv, _recv_window
from afd_core.p2p.wire import CONTROL_WORDS, _StageTags
from afd_core.startup import StartupCoordinator, open_tcp_store
from afd_core.topology import AFDTopology

_ROUND_KEY = "afd/round"
_ROUND_POLL_S = 0.01
#: How often an FFN rank beats its heartbeat on the store and an Attention rank reads it.
HEARTBEAT_S = 1.0
#: An FFN peer whose heartbeat has not moved for this long is reported lost (``liveness``).
#: Generous: a busy 2-core host can stall a thread for a while; in-flight transfers to a
#: vanished peer fail at once anyway (its connections drop).
LIVENESS_TIMEOUT_S = 10.0


def _address_in_use(err: BaseException) -> bool:
    """Whether ``err`` is a listening socket's "address already in use": an ``OSError`` with
    ``EADDRINUSE`` from a socket bound here, or torch's ``DistNetworkError`` (which carries the
    errno only in its text) from ``TCPStore``'s own bind."""
    if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
        return True
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


class _P2PLifecycle(AFDConnectorBase):
    """State, lifecycle and failure handling of a P2P connector rank (see the module docstring)."""

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
        ready_hook: ReadyHook | None = None,
        model_identity: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            config,
            topology,
            role_rank,
            payload_spec=payload_spec,
            num_layers=num_layers,
            device=device,
            role_agreement=role_agreement,
            ready_hook=ready_hook,
            model_identity=model_identity,
        )
        self.backend = backend_for_device(self.device)
        self._device_type = self.device.type
        self.check_sequence = bool(config.connector_extra_config.get("check_sequence", False))
        self.reuse_buffers = bool(config.connector_extra_config.get("reuse_buffers", False))
        self.recv_ahead = bool(config.connector_extra_config.get("recv_ahead", True))
        self.recv_ahead_bytes = int(
            config.connector_extra_config.get("recv_ahead_bytes", RECV_AHEAD_BYTES)
        )
        # Receives are posted ahead of their call only on gloo, which matches a send to a
        # receive by rendezvous. nccl and hccl run a rank's sends and receives in call order on
        # one device stream: a receive posted there before a send that its peer waits for
        # blocks that send (a deadlock), so they post every receive when it is asked for.
        self._post_early = self.backend == "gloo"
        self._token_bytes = sum(
            math.prod(f.shape(1)) * f.dtype.itemsize for f in payload_spec.fields
        )
        # Hot-path constants: (field name, index) in wire order, and the reply's width/dtype.
        self._wire_fields = tuple((f.name, i) for i, f in enumerate(payload_spec.fields))
        self._out_dtype = payload_spec.dtype
        self._hidden = payload_spec.hidden_size
        self._reply_spec = payload_spec.fields[0]
        self._hidden_only = len(payload_spec.fields) == 1
        self._is_ffn = self.role is AFDRole.FFN
        self._id = id(self)  # what this connector's handles carry
        self._buffers = RecvBufferPool(self.device, keep=self.reuse_buffers)
        self._stage_tags: dict[int, _StageTags] = {}
        # Attention side: stage -> its transfers awaiting a reply, in send order.
        self._reply_queue: dict[int, collections.deque[_PendingRecv]] = {}
        # FFN side: (stage, Attention world rank) -> receives posted ahead, in posting order
        # (never empty: a drained entry is removed). Attention side: the same rule mirrored,
        # stage -> token count the FFN rank has receives posted for.
        self._posted: collections.defaultdict[tuple[int, int], collections.deque[_PostedRecv]] = (
            collections.defaultdict(collections.deque)
        )
        # FFN: stage -> (Attention world rank, prepared receive) to post with the stage's reply.
        self._after_reply: dict[int, list[tuple[int, _PostedRecv]]] = {}
        self._unreplied: set[int] = set()  # FFN: stages received but not yet replied to
        self._seen: set[int] = set()  # FFN: stages received in this step
        self._streaming: set[int] = set()  # FFN: stages whose last step was a stream
        self._peer_posted: dict[int, int] = {}
        self._ahead_stages: frozenset[int] = frozenset()  # FFN: stages with a window this step
        self._last_received: AFDTransferMetadata | None = None  # FFN: of the last receive
        # Attention side: the control send still in flight; FFN side: the next control receive.
        # The wire buffers are allocated once: a control message is encoded only after the
        # previous send completed, and a received one is decoded before the next receive is
        # posted into the same buffer.
        self._control_bytes = bytearray(CONTROL_WORDS * 8)
        self._control_wire = torch.frombuffer(self._control_bytes, dtype=torch.int64)
        self._control_send: tuple[list[tuple[Any, int]], torch.Tensor] | None = None
        self._control_posted: tuple[list[torch.Tensor], list[tuple[Any, int]]] | None = None
        topo = self.topology
        # Expert parallel (F > 1): the data plane is send_dispatch / recv_combine /
        # recv_dispatch (see afd_core.p2p.expert_parallel); with one FFN rank it is the
        # request/reply path of the two sides.
        self._expert_parallel = topo.expert_parallel
        if self.role is AFDRole.ATTENTION:
            self._ffn_world_ranks = topo.peers_of(AFDRole.ATTENTION, role_rank)
            self._ffn_world_rank = self._ffn_world_ranks[0]
            self._served: tuple[int, ...] = ()
        else:
            self._ffn_world_ranks = ()
            self._ffn_world_rank = -1
            self._served = topo.peers_of(AFDRole.FFN, role_rank)
        # Expert parallel: the step's announced counts (Attention: this rank's per stage;
        # FFN: the merged message) and, FFN side, the next dispatch headers posted ahead.
        self._ep_announced: tuple[int, ...] | None = None
        self._ep_control: AFDControlMessage | None = None
        self._headers_ahead: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self._control_bufs = [torch.empty(CONTROL_WORDS, dtype=torch.int64) for _ in self._served]
        self._timeout = timedelta(seconds=config.timeout_s)
        self._store: Any = None
        self._coordinator: StartupCoordinator | None = None
        self._ctl_pg: Any = None
        self._data_pg: Any = None
        self._initialized = False
        self._generation = 0
        self._announced: tuple[int, ...] | None = None
        self._control: AFDControlMessage | None = None
        self._handles: weakref.WeakSet[AFDTransferHandle] = weakref.WeakSet()
        self._liveness_stop = threading.Event()

    # -- identity ------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def generation(self) -> int:
        """How many times this world rank initialised against the current store server."""
        return self._generation

    @property
    def coordinator(self) -> StartupCoordinator | None:
        """The startup coordinator of the current initialisation (``None`` when closed)."""
        return self._coordinator

    @property
    def served_world_ranks(self) -> tuple[int, ...]:
        """FFN side: world ranks of the served Attention ranks (empty on the Attention side)."""
        return self._served

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
        )

    def group_info(self) -> AFDGroupInfo:
        """The data group of this initialisation (valid from the ready hook on).

        Name ``afd-p2p/<host>:<port>/g<generation>/data``: unique per store server and
        initialisation of this world rank."""
        if self._data_pg is None:
            raise AFDNotInitializedError("AFD P2P connector has no data group (group_info)")
        peers = self._ffn_world_ranks if self.role is AFDRole.ATTENTION else self._served
        return AFDGroupInfo(
            name=f"afd-p2p/{self.config.host}:{self.config.port}/g{self._generation}/data",
            world_size=self.topology.world_size,
            rank=self.world_rank,
            peer_ranks=tuple(peers),
        )

    # -- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        if self._initialized:
            return
        self._clear_failure()
        stage = "connect"
        # Before any socket opens: a non-loopback host without AFD_SECRET is refused here.
        secret = deployment_secret(self.config.host)
        try:
            startup_s = self.config.startup_timeout_s
            deadline = time.monotonic() + startup_s
            root = self._open_store(startup_s, secret)
            bind_address = local_address(self.config.host, self.config.port)
            self._store = root
            stage = "claim"
            self._generation = self._claim_round(root, deadline)
            ns = dist.PrefixStore(f"afd/g{self._generation}", root)
            self._store = ns
            coord = StartupCoordinator(
                ns,
                rank=self.world_rank,
                world_size=self.topology.world_size,
                timeout_s=startup_s,
            )
            self._coordinator = coord
            stage = "handshake"
            self._handshake(ns, coord, deadline)
            coord.barrier("handshake", timeout_s=self._remaining(deadline))
            stage = "process_groups"
            self._ctl_pg = make_process_group(
                "gloo",
                dist.PrefixStore("pg/ctl", ns),
                self.world_rank,
                self.topology.world_size,
                _LONG_WAIT,
                bind_address=bind_address,
            )
            self._data_pg = make_process_group(
                self.backend,
                dist.PrefixStore("pg/data", ns),
                self.world_rank,
                self.topology.world_size,
                self._timeout,
                bind_address=bind_address,
            )
            if self.ready_hook is not None:
                stage = "ready_hook"
                try:
                    self.ready_hook(self)
                except Exception as hook_err:
                    raise AFDReadyHookError(
                        f"AFD world rank {self.world_rank} ready hook failed: "
                        f"{type(hook_err).__name__}: {hook_err}"
                    ) from hook_err
            stage = "ready"
            coord.barrier("ready", timeout_s=self._remaining(deadline))
            # A rank may publish ready and then fail (e.g. cancelled inside this barrier).
            coord.raise_if_failed()
            self._start_liveness(ns)
        except BaseException as err:
            if self._coordinator is not None and not isinstance(
                err, AFDStartupError | AFDPeerError
            ):
                self._coordinator.publish_failure(stage, f"{type(err).__name__}: {err}")
            self._teardown()
            # Exit requests (KeyboardInterrupt, SystemExit) and cancellation keep their type:
            # the process is stopping, which is not a peer's failure.
            if not isinstance(err, Exception) or isinstance(
                err, AFDConnectorError | AFDConfigError
            ):
                raise
            text = str(err).lower()
            if isinstance(err, TimeoutError) or "timeout" in text or "timed out" in text:
                raise AFDTimeoutError(
                    f"AFD P2P init of world rank {self.world_rank} timed out in stage "
                    f"{stage!r}: {err}"
                ) from err
            raise AFDPeerError(None, stage, f"{type(err).__name__}: {err}") from err
        self._initialized = True

    def _claim_round(self, root: Any, deadline: float) -> int:
        """Join the current initialisation round and claim this world rank in it; its number.

        World rank 0 (the store's server) opens a new round at every ``init``; every other rank
        joins the newest round. A rank already claimed there means the round is stale for this
        process (it replaces a holder that left, and rank 0 has not opened the next round yet)
        or a second process runs this rank: the claim then waits for a newer round and fails
        with :class:`AFDStartupError` (stage ``claim``) if none opens before the deadline.
        """
        rank = self.world_rank
        if rank == 0:
            number = int(root.add(_ROUND_KEY, 1))
            root.add(f"afd/g{number}/claim/0", 1)
            return number
        number = 0
        while True:
            current = int(root.add(_ROUND_KEY, 0))
            if current > number:
                number = current
                if int(root.add(f"afd/g{number}/claim/{rank}", 1)) == 1:
                    return number
            if time.monotonic() >= deadline:
                if number == 0:
                    raise AFDTimeoutError(
                        f"AFD P2P init of world rank {rank} timed out in stage 'claim': world "
                        f"rank 0 opened no round within {self.config.startup_timeout_s:g}s"
                    )
                raise AFDStartupError(
                    rank,
                    "claim",
                    f"world rank {rank} ({self.role} {self.role_rank}) is already claimed in "
                    f"round {number} and world rank 0 opened no newer round within "
                    f"{self.config.startup_timeout_s:g}s: another process runs this rank",
                )
            time.sleep(_ROUND_POLL_S)

    def _start_liveness(self, store: Any) -> None:
        """After ``init``: FFN ranks beat a heartbeat on the store; Attention ranks watch their
        FFN peers' beats and record a :class:`AFDPeerError` (stage ``liveness``) for a peer
        whose beat stops for :data:`LIVENESS_TIMEOUT_S` (see :meth:`peer_failure`). Both
        threads end when this initialisation ends (``close`` sets their event)."""
        stop = self._liveness_stop = threading.Event()
        if self._is_ffn:
            target: Any = self._beat
            args: tuple[Any, ...] = (store, stop)
        else:
            target, args = self._watch, (store, stop, self._generation)
        threading.Thread(
            target=target, args=args, name=f"afd-liveness-{self.world_rank}", daemon=True
        ).start()

    def _beat(self, store: Any, stop: threading.Event) -> None:
        key = f"alive/{self.world_rank}"
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception:  # the store's server is gone: the connector's ops will say so
                return
            stop.wait(HEARTBEAT_S)

    def _watch(self, store: Any, stop: threading.Event, generation: int) -> None:
        seen = {rank: (-1, time.monotonic()) for rank in self._ffn_world_ranks}
        while not stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            for rank, (count, since) in seen.items():
                try:
                    beat = int(store.add(f"alive/{rank}", 0))
                except Exception as err:
                    reason = f"the rendezvous store is unreachable: {type(err).__name__}: {err}"
                else:
                    if beat != count:
                        seen[rank] = (beat, now)
                        continue
                    if now - since < LIVENESS_TIMEOUT_S:
                        continue
                    reason = f"no heartbeat for {now - since:.1f}s (process gone or stalled)"
                if not stop.is_set() and self._generation == generation:
                    self._record_failure(AFDPeerError(rank, "liveness", reason))
                return

    def _open_store(self, timeout_s: float, secret: bytes | None) -> Any:
        """The rendezvous store (world rank 0 serves it on ``host:port``).

        Raises:
            AFDConfigError: ``port`` is already in use on this host (world rank 0 only: the
                store server cannot bind it). Without this, the bind failure would read as a
                failed peer, and the other role would wait out its startup timeout.
        """
        is_master = self.world_rank == 0
        try:
            return open_tcp_store(
                self.config.host,
                self.config.port,
                is_master=is_master,
                timeout_s=timeout_s,
                secret=secret,
            )
        except Exception as err:
            if not (is_master and _address_in_use(err)):
                raise
            raise AFDConfigError(
                "port",
                self.config.port,
                f"a TCP port free on {self.config.host} (world rank 0, the first Attention "
                "rank, serves the AFD rendezvous store there; set the same free port on every "
                "role)",
                detail=f"{self.config.host}:{self.config.port} is already in use by another "
                f"process: {type(err).__name__}: {err}",
            ) from err

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
        startup store, for a rank that fails before its ``init`` (e.g. loading its model): the
        peers' ``init`` then raises :class:`AFDStartupError` naming this rank, ``stage`` and
        ``reason`` at once instead of waiting ``startup_timeout_s``.

        Connects like ``init`` (into world rank 0's current round: the failure lands where the
        peers' current initialisation looks; world rank 0 itself opens a new round for it),
        publishes, disconnects. Bounded by ``timeout_s``
        (default ``config.startup_timeout_s``) spent waiting for the store's server; never
        raises; True when the failure reached the store. World rank 0 serves the store itself,
        so its failure only reaches peers that connect while this process lives."""
        try:
            topology = AFDTopology.from_config(config)
            world_rank = topology.world_rank(config.role, role_rank)
            wait_s = config.startup_timeout_s if timeout_s is None else float(timeout_s)
            deadline = time.monotonic() + wait_s
            root = open_tcp_store(
                config.host,
                config.port,
                is_master=world_rank == 0,
                timeout_s=wait_s,
                secret=deployment_secret(config.host),
            )
            if world_rank == 0:
                generation = int(root.add(_ROUND_KEY, 1))
            else:
                generation = int(root.add(_ROUND_KEY, 0))
                while generation == 0 and time.monotonic() < deadline:
                    time.sleep(_ROUND_POLL_S)
                    generation = int(root.add(_ROUND_KEY, 0))
                if generation == 0:
                    return False
            coord = StartupCoordinator(
                dist.PrefixStore(f"afd/g{generation}", root),
                rank=world_rank,
                world_size=topology.world_size,
                timeout_s=wait_s,
            )
            return coord.publish_failure(stage, reason)
        except Exception:
            return False

    def _remaining(self, deadline: float) -> float:
        return max(deadline - time.monotonic(), 0.001)

    def _handshake(self, store: Any, coord: StartupCoordinator, deadline: float) -> None:
        mine = self.handshake_fields()
        store.set(f"hs/{self.world_rank}", json.dumps(mine, sort_keys=True))
        others = [r for r in range(self.topology.world_size) if r != self.world_rank]
        coord.wait_keys(
            {r: f"hs/{r}" for r in others}, "handshake", timeout_s=self._remaining(deadline)
        )
        for peer in others:
            theirs = json.loads(store.get(f"hs/{peer}").decode("utf-8"))
            _compare_handshake(mine, theirs, peer)

    def abort(self, op: str, reason: str) -> None:
        """Publish this rank's failure (``op``, ``reason``) on the store, then close: the peers'
        waits fail at once (their connections drop) naming this rank and ``reason``."""
        coord = self._coordinator
        if coord is not None:
            coord.publish_failure(op, reason)
        self.close()

    def close(self) -> None:
        for handle in list(self._handles):
            handle.state = None
        self._handles = weakref.WeakSet()
        self._teardown()

    def _teardown(self) -> None:
        self._liveness_stop.set()
        # Pending works hold the gloo context (and its sockets) alive: drop them first.
        self._posted = collections.defaultdict(collections.deque)
        self._reply_queue = {}
        self._after_reply = {}
        self._unreplied = set()
        self._seen = set()
        self._streaming = set()
        self._peer_posted = {}
        self._ahead_stages = frozenset()
        self._last_received = None
        self._control_send = None
        self._control_posted = None
        self._headers_ahead = {}
        self._ep_announced = None
        self._ep_control = None
        for name in ("_data_pg", "_ctl_pg"):
            pg = getattr(self, name)
            setattr(self, name, None)
            if pg is not None and self.backend != "gloo" and name == "_data_pg":
                shutdown = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
                if shutdown is not None:
                    with contextlib.suppress(Exception):
                        shutdown()
            del pg
        self._coordinator = None
        self._store = None
        self._announced = None
        self._control = None
        self._buffers.clear()
        self._initialized = False

    # -- failure handling ------------------------------------------------------------------

    def _check_ready(self, role: AFDRole, op: str) -> None:
        if not self._initialized:
            raise AFDNotInitializedError(f"AFD P2P connector is not initialised ({op})")
        if self.config.role is not role:
            raise AFDConnectorError(f"{op} is a {role} operation; this rank's role is {self.role}")

    def _fail(self, err: BaseException, op: str, peer: int | None) -> NoReturn:
        """Classify ``err``, publish this rank's failure, tear down, raise.

        Preference: the failure the awaited ``peer`` published; else a timeout (attributed to a
        failed rank if one published); else the transport error attributed to ``peer`` (it
        died or closed); else any published failure.
        """
        coord = self._coordinator

        def published(rank: int | None) -> Any:
            if coord is None:
                return None
            try:
                return coord.first_failure() if rank is None else coord.failure_of(rank)
            except Exception:
                return None

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
                    f"AFD P2P {op} with world rank {peer} did not complete within "
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
        if coord is not None:
            coord.publish_failure(op, f"{type(exc).__name__}: {exc}")
        self._record_failure(exc)
        self.close()
        if exc is err:
            raise exc
        raise exc from err

    def _wait(
        self, works: list[tuple[Any, int]], op: str, timeout: timedelta | None = None
    ) -> None:
        peer: int | None = None
        try:
            for work, src in works:
                peer = src
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
        except RuntimeError as err:
            works.clear()
            work = None  # drop the last reference so a failed group can be torn down
            self._fail(err, op, peer)
        works.clear()

    # -- shared by both sides --------------------------------------------------------------

    def _finish_control_send(self) -> None:
        """Attention side: wait for the control message still in flight (to every FFN rank)."""
        pending = self._control_send
        if pending is not None:
            self._control_send = None
            self._wait(pending[0], "send_control", self._timeout)

    def _check_metadata(
        self, metadata: AFDTransferMetadata, expected: tuple[int, ...] | None
    ) -> None:
        if not isinstance(metadata, AFDTransferMetadata):
            raise AFDPayloadError("metadata", type(metadata).__name__, "an AFDTransferMetadata")
        if metadata.layer_idx >= self.num_layers:
            raise AFDPayloadError(
                "layer_idx", metadata.layer_idx, f"an int in 0..{self.num_layers - 1}"
            )
        is_attention = self.config.role is AFDRole.ATTENTION
        width = 1 if is_attention else len(self._served)
        if len(metadata.num_tokens) != width:
            raise AFDPayloadError(
                "num_tokens", metadata.num_tokens, f"{width} count(s) (one per peer)"
            )
        if expected is not None:
            if metadata.stage_idx >= len(expected):
                raise AFDPayloadError(
                    "stage_idx", metadata.stage_idx, f"an int in 0..{len(expected) - 1}"
                )
            announced = expected[metadata.stage_idx]
            if is_attention and metadata.num_tokens[0] != announced:
                raise AFDPayloadError(
                    "num_tokens", metadata.num_tokens, f"({announced},) as announced"
                )

    def _make_stage_tags(self, stage: int) -> _StageTags:
        tags = self._stage_tags[stage] = _StageTags(stage, self._wire_fields, self._served)
        return tags

    def _window(self, n: int) -> int:
        """This rank's :func:`~afd_core.p2p.recv_ahead._recv_window` for transfers of ``n``
        tokens (``recv_ahead`` on gloo only; ``recv_ahead_bytes``; ``reuse_buffers``)."""
        return _recv_window(
            n,
            self.recv_ahead and self._post_early,
            self.recv_ahead_bytes,
            self._token_bytes,
            self.reuse_buffers,
        )
