"""The torch.distributed point-to-point connector (registered as ``"p2p"``).

World: its own ``A + F`` ranks (Attention first, see :mod:`afd_core.topology`) on a TCPStore at
``config.host:config.port`` served by world rank 0; vLLM's process groups are never used.

Per initialisation (generation ``g``, counted per rank on the store so re-init after close works):

1. connect to the store; namespace ``afd/g<g>``; claim the world rank (a duplicate fails);
2. handshake: every rank publishes protocol version, config agreement fields and hash, hidden
   size, dtype, layer count, topology, payload spec and device type, reads everyone else's, and
   raises :class:`AFDHandshakeError` naming the first differing field (so a mismatch fails on
   both sides); a failing rank publishes its failure so no peer waits for it;
3. a barrier, then two process groups: a Gloo *control* group (CPU ``int64`` control messages)
   and a *data* group whose backend follows the device (``cpu``: gloo, ``cuda``: nccl,
   ``npu``: hccl), with ``config.timeout_s`` as its timeout. Steps 1-3 wait at most
   ``config.startup_timeout_s`` in all (a peer role may still be loading its model).

Per step (see :mod:`afd_core.connector` for the call order): every Attention rank sends its
per-stage token counts to its FFN rank (fixed-size control message, tag per direction); per layer
and stage the Attention rank posts the receive of the reply (gloo; see below) and then a send per
payload field (tag per stage and field), and returns (``recv_ffn_output`` only waits), so two stages
can be in flight (DBO). At most one reply receive per stage is posted ahead: when a caller sends
several layers of a stage before it receives any reply (a stream), the later receives are posted in
send order, the next one as each reply comes in (or all up to the one asked for, when replies are
received out of order), so the FFN rank is not handed a receive notice per layer while it is busy
receiving. The FFN rank receives from each served Attention rank and sends back
``[tokens_i, hidden]``. Zero-token peers move no bytes.

Receives are posted ahead on gloo. A gloo receive notifies the sender, which writes the data at once
if the receive was posted first and otherwise waits for that notice: posting late costs a network
round trip (and a wake-up of the sender's I/O thread) per transfer. Besides the Attention side's
early reply receive, the FFN side (``recv_ahead``, on by default) uses what the control message
tells it (every stage's token counts for the whole step) to keep a *window* of receives posted per
stage and served Attention rank: as many transfers as fit in ``recv_ahead_bytes`` (2 MiB by default;
at most the layers left in the step, at most one with ``reuse_buffers``, none for a transfer larger
than the budget). The whole window serves streams (the caller receives several layers of a stage
before replying): it opens once a stream shows, and a stage that streamed has it posted when the
next control message arrives (small transfers: every layer of the step, so a stream moves with no
notice round trip at all). Request/reply keeps one receive ahead (the Attention rank cannot send the
next layer before it has the reply, so more would only cycle more buffers through the cache): posted
with the reply of layer ``l`` (its buffers and payload are taken earlier, when the caller asks for
layer ``l``, so only the posting sits between the data's arrival and the reply). The next step's
control receive is likewise posted when a control message arrives (after that step's first data
receives), and ``send_control`` does not wait for its message (except shutdown); the control wire
buffers are allocated once. Matching on the wire is unchanged (the first message on a (peer, tag)
goes to the first receive); only the moment a receive is posted moves. A step that stops before its
last layer leaves receives posted when its window was not empty: the next step may keep that stage's
count (the receives are then used); another count is refused with :class:`AFDProtocolError` by
``send_control`` before anything is sent (and checked again on the FFN side), because a posted gloo
receive cannot be withdrawn and a size mismatch aborts the receiving process. The Attention side
mirrors the window rule (both sides compute it from the handshaked payload spec and
``connector_extra_config``).

nccl and hccl post nothing ahead: they run a rank's sends and receives in call order on one device
stream, where a receive posted before a send its peer waits for would block that send (a
deadlock). There every receive is posted when it is asked for (the Attention side's reply receive
in ``recv_ffn_output``, after the transfer's sends), and the call order on both roles must match
(these backends ignore tags).

Receive buffers come from :class:`afd_core.buffers.RecvBufferPool` (recycled on CPU, kept with
``reuse_buffers``, fresh elsewhere).

Invariants:
* Shapes, dtypes, devices, token counts (against the announced control counts) and layer index
  are validated before any byte is sent.
* Every wait is bounded by ``config.timeout_s`` (``recv_control`` may wait longer when asked, for
  idle service loops). Any transport error publishes this rank's failure on the store and tears
  the groups down (closing its connections so peers fail fast), then raises
  :class:`AFDPeerError` (naming the failed rank when one published a failure) or
  :class:`AFDTimeoutError`.
* ``close()`` is idempotent and safe after a partial init; ``init()`` after ``close()`` works.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import struct
import time
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from afd_core.buffers import RecvBufferPool
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnectorBase, AFDTransferHandle
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDHandshakeError,
    AFDNotInitializedError,
    AFDPayloadError,
    AFDPeerError,
    AFDProtocolError,
    AFDStartupError,
    AFDTimeoutError,
)
from afd_core.metadata import (
    PAYLOAD_FIELDS,
    AFDControlMessage,
    AFDPayload,
    AFDPayloadSpec,
    AFDTransferMetadata,
    dtype_name,
)
from afd_core.startup import StartupCoordinator, open_tcp_store
from afd_core.topology import AFDTopology

__all__ = [
    "CONTROL_WORDS",
    "PROTOCOL_VERSION",
    "RECV_AHEAD_BYTES",
    "P2PConnector",
    "backend_for_device",
    "make_process_group",
]

PROTOCOL_VERSION = 3
"""Version of the P2P wire protocol (handshake, tags, message layout, which receives are posted
ahead: the Attention side mirrors the FFN side's rule).

2: the ``check_sequence`` header has a tag per stage (receives may be posted ahead).
3: the FFN side's receive-ahead window (``recv_ahead_bytes``); nothing ahead off gloo."""

CONTROL_WORDS = 64
"""Fixed length (int64 words) of a control message on the wire (room for 59 stages)."""

_CONTROL_TAG = 1
_CONTROL_STRUCT = struct.Struct(f"={CONTROL_WORDS}q")  # native int64, as torch.int64 reads it
_SEQ_FIELD = 7  # the sequence header takes the last of the 8 per-stage field slots
_DATA_TAG_BASE = 64
_LONG_WAIT = timedelta(days=30)

_BACKENDS: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_BOOL_KEYS = frozenset({"check_sequence", "recv_ahead", "reuse_buffers"})
_INT_KEYS = frozenset({"recv_ahead_bytes"})
_EXTRA_KEYS = _BOOL_KEYS | _INT_KEYS

RECV_AHEAD_BYTES = 2 << 20
"""Default ``recv_ahead_bytes``: what the FFN rank keeps posted ahead per stage and peer. Measured
on a 2-vCPU VM with 4 MiB of L2 per core: 4 MiB transfers posted one ahead (two buffers in turn)
ran 0.90-0.91x raw one-way and +58-88 µs per round-trip call, received when asked 1.23x and
-27 µs (the median of two runs of ``p2p_late``); at 1 MiB the two were alike (1.02x)."""


def backend_for_device(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on ``device`` (cpu: gloo, cuda: nccl, npu: hccl)."""
    # Parse strings by hand: "npu" is only a torch device type once torch_npu is imported.
    kind = device.split(":", 1)[0].strip() if isinstance(device, str) else device.type
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise AFDConfigError(
            "device", str(device), f"a device of type {sorted(_BACKENDS)}"
        ) from None


def make_process_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> Any:
    """A standalone process group (not registered as torch's default group)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if backend == "hccl":  # pragma: no cover - needs torch_npu
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        hopts = ProcessGroupHCCL.Options()
        hopts._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, hopts)
    raise AFDConfigError("backend", backend, f"one of {sorted(set(_BACKENDS.values()))}")


def _data_tag(stage_idx: int, field_idx: int, to_ffn: bool) -> int:
    return _DATA_TAG_BASE + (stage_idx * 8 + field_idx) * 2 + (0 if to_ffn else 1)


class _StageTags:
    """One stage's wire tags and receive-buffer keys (computed once per stage: hot path)."""

    __slots__ = ("fields", "recv_keys", "reply", "reply_key", "sequence")

    def __init__(
        self, stage: int, wire_fields: tuple[tuple[str, int], ...], served: tuple[int, ...]
    ) -> None:
        self.fields = tuple((name, _data_tag(stage, idx, True)) for name, idx in wire_fields)
        self.reply = _data_tag(stage, 0, False)
        self.sequence = _data_tag(stage, _SEQ_FIELD, True)
        self.reply_key = (-1, stage)  # Attention side: the reply's buffer
        # FFN side: per served Attention world rank, the buffer key of each field.
        self.recv_keys = {src: tuple((stage, src, idx) for _, idx in wire_fields) for src in served}


class _PendingRecv:
    """Attention-side state of one transfer: send works, the reply buffer and its receive.

    ``posted`` is false while the reply's receive waits in its stage's queue (see
    ``P2PConnector._post_reply``)."""

    __slots__ = ("buffer", "num_tokens", "peer", "posted", "recv_work", "send_works", "stage")

    def __init__(self, peer: int, stage: int, num_tokens: int) -> None:
        self.peer = peer
        self.stage = stage
        self.num_tokens = num_tokens
        self.send_works: list[Any] = []
        self.recv_work: Any = None
        self.buffer: torch.Tensor | None = None
        self.posted = False


class _PostedRecv:
    """FFN side: the posted receive of one stage's next transfer from one Attention rank."""

    __slots__ = ("header", "num_tokens", "payload", "tensors", "works")

    def __init__(self, num_tokens: int, tensors: list[torch.Tensor], payload: AFDPayload) -> None:
        self.num_tokens = num_tokens
        self.header: torch.Tensor | None = None
        self.tensors = tensors  # one per payload field, in wire order
        self.payload = payload  # built when prepared: off the receive's path
        self.works: list[Any] = []


class P2PConnector(AFDConnectorBase):
    """Point-to-point AFD connector on torch.distributed (see the module docstring)."""

    name = "p2p"
    has_control_plane = True

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        """Accepted keys (all bool):

        * ``check_sequence`` (default false): send a 3-word header (layer, stage, tokens) before
          every Attention payload and verify it on the FFN side (catches out-of-order calls).
        * ``recv_ahead`` (default true): the FFN side posts each stage's next receives early (see
          the module docstring). Set false for call patterns where a step ends before layer
          ``num_layers - 1`` and the next step changes that stage's token counts.
        * ``recv_ahead_bytes`` (int >= 0, default :data:`RECV_AHEAD_BYTES`, 2 MiB): how many of
          a stage's receives per served Attention rank the FFN side keeps posted ahead: as many
          transfers as fit in these bytes (at most the layers left in the step), none for a
          transfer larger than this (it is received into the buffer its caller just released,
          which is still in cache, and the notice round trip is small beside its transfer).
        * ``reuse_buffers`` (default false): receive into buffers kept by the connector (three
          per stage, peer and field, used in turn: stable addresses) instead of recycled ones
          (see :mod:`afd_core.buffers`). A returned tensor is then only valid until the next
          receive call of the same stage returns (Attention side: until the next
          ``recv_ffn_output`` of that stage returns): consume or copy it before.
        """
        out: dict[str, Any] = {}
        for key, value in extra.items():
            if key in _BOOL_KEYS:
                if not isinstance(value, bool):
                    raise AFDConfigError(f"connector_extra_config.{key}", value, "a bool")
                out[key] = value
            elif key in _INT_KEYS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise AFDConfigError(
                        f"connector_extra_config.{key}", value, "an int >= 0 (bytes)"
                    )
                out[key] = value
            else:
                raise AFDConfigError(
                    f"connector_extra_config.{key}",
                    value,
                    f"keys among {sorted(_EXTRA_KEYS)} for connector 'p2p'",
                )
        return out

    def __init__(
        self,
        config: AFDConfig,
        topology: AFDTopology | None = None,
        role_rank: int = 0,
        *,
        payload_spec: AFDPayloadSpec,
        num_layers: int,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            config,
            topology,
            role_rank,
            payload_spec=payload_spec,
            num_layers=num_layers,
            device=device,
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
        self._control_send: tuple[Any, torch.Tensor] | None = None
        self._control_posted: tuple[list[torch.Tensor], list[tuple[Any, int]]] | None = None
        topo = self.topology
        if self.role is AFDRole.ATTENTION:
            self._ffn_world_rank = topo.world_rank(AFDRole.FFN, topo.ffn_rank_for(role_rank))
            self._served: tuple[int, ...] = ()
        else:
            self._ffn_world_rank = -1
            self._served = tuple(
                topo.world_rank(AFDRole.ATTENTION, a) for a in topo.attention_ranks_for(role_rank)
            )
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
        """What this rank publishes at init; every field must match on every rank."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "config": self.config.agreement_fields(),
            "config_hash": self.config.agreement_hash(),
            "hidden_size": self.payload_spec.hidden_size,
            "dtype": dtype_name(self.payload_spec.dtype),
            "num_layers": self.num_layers,
            "topology": [self.topology.num_attention_ranks, self.topology.num_ffn_ranks],
            "payload_spec": self.payload_spec.to_wire(),
            "device_type": self.device.type,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def init(self) -> None:
        if self._initialized:
            return
        stage = "connect"
        try:
            startup_s = self.config.startup_timeout_s
            deadline = time.monotonic() + startup_s
            root = open_tcp_store(
                self.config.host,
                self.config.port,
                is_master=self.world_rank == 0,
                timeout_s=startup_s,
            )
            self._store = root
            self._generation = int(root.add(f"afd/inits/{self.world_rank}", 1))
            ns = dist.PrefixStore(f"afd/g{self._generation}", root)
            self._store = ns
            coord = StartupCoordinator(
                ns,
                rank=self.world_rank,
                world_size=self.topology.world_size,
                timeout_s=startup_s,
            )
            self._coordinator = coord
            stage = "claim"
            if ns.add(f"claim/{self.world_rank}", 1) != 1:
                raise AFDStartupError(
                    self.world_rank,
                    stage,
                    f"world rank {self.world_rank} ({self.role} {self.role_rank}) was claimed "
                    "by two processes",
                )
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
            )
            self._data_pg = make_process_group(
                self.backend,
                dist.PrefixStore("pg/data", ns),
                self.world_rank,
                self.topology.world_size,
                self._timeout,
            )
            coord.barrier("ready", timeout_s=self._remaining(deadline))
        except BaseException as err:
            if self._coordinator is not None and not isinstance(
                err, AFDStartupError | AFDPeerError
            ):
                self._coordinator.publish_failure(stage, f"{type(err).__name__}: {err}")
            self._teardown()
            if isinstance(err, AFDConnectorError | AFDConfigError | KeyboardInterrupt):
                raise
            text = str(err).lower()
            if isinstance(err, TimeoutError) or "timeout" in text or "timed out" in text:
                raise AFDTimeoutError(
                    f"AFD P2P init of world rank {self.world_rank} timed out in stage "
                    f"{stage!r}: {err}"
                ) from err
            raise AFDPeerError(None, stage, f"{type(err).__name__}: {err}") from err
        self._initialized = True

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
            self._compare_handshake(mine, theirs, peer)

    @staticmethod
    def _compare_handshake(mine: Mapping[str, Any], theirs: Mapping[str, Any], peer: int) -> None:
        # Protocol version first: other fields may not be comparable across versions.
        if theirs.get("protocol_version") != mine["protocol_version"]:
            raise AFDHandshakeError(
                "protocol_version", mine["protocol_version"], theirs.get("protocol_version"), peer
            )
        their_config = theirs.get("config", {})
        for key, value in mine["config"].items():
            if their_config.get(key) != value:
                raise AFDHandshakeError(f"config.{key}", value, their_config.get(key), peer)
        for key in (
            "config_hash",
            "hidden_size",
            "dtype",
            "num_layers",
            "topology",
            "payload_spec",
            "device_type",
        ):
            if theirs.get(key) != mine[key]:
                if key == "payload_spec":
                    mine_spec, their_spec = mine[key], theirs.get(key) or {}
                    for name in PAYLOAD_FIELDS:
                        if mine_spec.get(name) != their_spec.get(name):
                            raise AFDHandshakeError(
                                f"payload_spec.{name}",
                                mine_spec.get(name),
                                their_spec.get(name),
                                peer,
                            )
                raise AFDHandshakeError(key, mine[key], theirs.get(key), peer)

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

    # -- control plane ---------------------------------------------------------------------

    def send_control(self, message: AFDControlMessage) -> None:
        """Send this rank's per-stage counts; ``message`` describes this rank (width 1) or all
        Attention ranks (width ``A``, this rank's column is taken)."""
        self._check_ready(AFDRole.ATTENTION, "send_control")
        if not isinstance(message, AFDControlMessage):
            raise AFDPayloadError("message", type(message).__name__, "an AFDControlMessage")
        width = message.width
        if message.num_stages and width not in (1, self.topology.num_attention_ranks):
            raise AFDPayloadError(
                "stage_token_counts",
                message.stage_token_counts,
                f"1 or num_attention_ranks={self.topology.num_attention_ranks} entries per stage",
            )
        if message.num_stages and width != 1:
            message = message.select([self.role_rank])
        words = message.words()
        if len(words) > CONTROL_WORDS:
            raise AFDPayloadError(
                "stage_token_counts", message.num_stages, f"at most {CONTROL_WORDS - 5} stages"
            )
        announced = None if message.shutdown else tuple(s[0] for s in message.stage_token_counts)
        if announced is not None:
            self._check_peer_posted(announced)
        self._finish_control_send()
        _CONTROL_STRUCT.pack_into(
            self._control_bytes, 0, *words, *[0] * (CONTROL_WORDS - len(words))
        )
        wire = self._control_wire
        self._announced = announced
        dst = self._ffn_world_rank
        try:
            work = self._ctl_pg.send([wire], dst, _CONTROL_TAG)
        except RuntimeError as err:
            self._fail(err, "send_control", dst)
        # A step's control message completes in the background (the step's first reply cannot
        # arrive before the FFN rank got it, so recv_ffn_output finishes it at no cost); the
        # shutdown message is waited for here, since close() usually follows at once. Only
        # ``self`` holds the work: after a failure nothing else may keep the groups alive.
        self._control_send = (work, wire)
        if message.shutdown:
            self._finish_control_send()

    def _finish_control_send(self) -> None:
        pending = self._control_send
        if pending is not None:
            self._control_send = None
            self._wait([(pending[0], self._ffn_world_rank)], "send_control", self._timeout)

    def _check_peer_posted(self, announced: tuple[int, ...]) -> None:
        """Refuse a step whose count differs from a receive the FFN rank still has posted.

        Mirrors the FFN side's receive-ahead rule (see the module docstring and
        :meth:`_window`): the FFN rank has receives posted for stage ``s`` when the previous
        step's last transfer of ``s`` carried tokens, was not of layer ``num_layers - 1`` and
        had a window of at least one receive. Sending another count there would make
        gloo abort the FFN process, so this raises (and tears down) before anything is sent.
        """
        for stage, n_posted in self._peer_posted.items():
            n = announced[stage] if stage < len(announced) else None
            if n != n_posted:
                self._fail(
                    AFDProtocolError(
                        f"stage {stage}: the FFN rank still has a receive posted for {n_posted} "
                        f"tokens (the previous step ended before layer {self.num_layers - 1}), "
                        f"but this step announces {n}; end every step at the last layer or set "
                        "connector_extra_config.recv_ahead=false"
                    ),
                    "send_control",
                    None,
                )
        for stage, n in enumerate(announced):
            if n and self._window(n):
                self._peer_posted.setdefault(stage, n)

    def recv_control(self, timeout_s: float | None = None) -> AFDControlMessage:
        """Receive one control message from every served Attention rank and merge them.

        ``timeout_s``: ``None`` uses ``config.timeout_s``; ``math.inf`` waits until a message
        arrives or a peer fails (for idle service loops). Served ranks must agree on the number
        of stages and on the flags (else :class:`AFDProtocolError`).
        """
        self._check_ready(AFDRole.FFN, "recv_control")
        if timeout_s is None:
            timeout = self._timeout
        elif (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
        ):
            raise AFDConfigError("timeout_s", timeout_s, "None, math.inf or seconds > 0")
        else:
            timeout = _LONG_WAIT if math.isinf(timeout_s) else timedelta(seconds=timeout_s)
        buffers, works = self._control_posted or self._post_control_recv()
        self._control_posted = None
        self._wait(works, "recv_control", timeout)
        messages: list[AFDControlMessage] = []
        for buf, src in zip(buffers, self._served, strict=True):
            words = buf.tolist()  # one conversion; indexing the tensor costs µs per element
            header = words[3] * words[4] + 5
            try:
                if not 5 <= header <= CONTROL_WORDS:
                    raise AFDProtocolError(f"control message of {header} words")
                msg = AFDControlMessage.decode_words(words[:header])
                if msg.num_stages and msg.width != 1:
                    raise AFDProtocolError(f"control message width {msg.width}, expected 1")
            except AFDProtocolError as err:
                self._fail(err, f"recv_control from world rank {src}", src)
            messages.append(msg)
        first = messages[0]
        for src, msg in zip(self._served[1:], messages[1:], strict=True):
            for name in ("num_stages", "is_warmup", "is_capture", "shutdown"):
                if getattr(msg, name) != getattr(first, name):
                    mismatch = AFDProtocolError(
                        f"served Attention ranks disagree on {name}: world rank "
                        f"{self._served[0]} sent {getattr(first, name)!r}, world rank {src} "
                        f"sent {getattr(msg, name)!r}"
                    )
                    self._fail(mismatch, "recv_control", src)
        merged = (
            first  # one served rank: its message is already the merged one
            if len(messages) == 1
            else AFDControlMessage(
                tuple(
                    tuple(m.stage_token_counts[s][0] for m in messages)
                    for s in range(first.num_stages)
                ),
                is_warmup=first.is_warmup,
                is_capture=first.is_capture,
                shutdown=first.shutdown,
            )
        )
        self._control = None if merged.shutdown else merged
        if self._control is None:
            self._ahead_stages = frozenset()
        else:
            # The step's first data receives first (the Attention ranks' sends wait for their
            # notices), then the next step's control receive, so its sender never waits for it.
            self._post_step_recvs(self._control)
            self._control_posted = self._post_control_recv()
        return merged

    def _post_control_recv(self) -> tuple[list[torch.Tensor], list[tuple[Any, int]]]:
        buffers = self._control_bufs
        works: list[tuple[Any, int]] = []
        try:
            for buf, src in zip(buffers, self._served, strict=True):
                works.append((self._ctl_pg.recv([buf], src, _CONTROL_TAG), src))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "recv_control", None)
        return buffers, works

    # -- validation ------------------------------------------------------------------------

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

    # -- Attention side --------------------------------------------------------------------

    def send_attn_output(
        self, payload: AFDPayload, metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        announced = self._announced
        if not (  # the hot path: the count this step's control message announced
            self._initialized
            and not self._is_ffn
            and type(metadata) is AFDTransferMetadata
            and announced is not None
            and metadata.layer_idx < self.num_layers
            and metadata.stage_idx < len(announced)
            and metadata.num_tokens == (announced[metadata.stage_idx],)
        ):
            self._check_ready(AFDRole.ATTENTION, "send_attn_output")
            self._check_metadata(metadata, announced)
        n = metadata.num_tokens[0]
        self.payload_spec.validate_payload(payload, n, self._device_type)
        dst = self._ffn_world_rank
        stage = metadata.stage_idx
        state = _PendingRecv(dst, stage, n)
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        pg = self._data_pg
        works = state.send_works
        try:
            if n:
                # The reply's receive first (when no earlier reply of this stage is still
                # awaited): a gloo receive notifies the sender, so the FFN rank can write its
                # reply as soon as it has it while this rank overlaps other work (DBO;
                # recv_ffn_output only waits). Posted before the data, the notice is out of the
                # way of the sends (after them, it stalls them now and then on a busy host).
                queue = self._reply_queue.get(stage)
                if queue is None:
                    queue = self._reply_queue[stage] = collections.deque()
                queue.append(state)
                if len(queue) == 1 and self._post_early:
                    self._post_reply(state, tags)
            if self.check_sequence:
                header = torch.tensor(
                    [metadata.layer_idx, stage, n], dtype=torch.int64, device=self.device
                )
                works.append(pg.send([header], dst, tags.sequence))
            if n:
                for name, tag in tags.fields:
                    tensor = getattr(payload, name).contiguous()
                    works.append(pg.send([tensor], dst, tag))
        except RuntimeError as err:
            state.send_works.clear()
            state.recv_work = None
            self._fail(err, "send_attn_output", dst)
        if n and self._announced is not None and self._window(n):
            # Mirror of the FFN side: this transfer used a posted receive; the FFN rank keeps
            # receives posted while the step has layers left.
            if metadata.layer_idx + 1 < self.num_layers:
                self._peer_posted[stage] = n
            else:
                self._peer_posted.pop(stage, None)
        handle = AFDTransferHandle(metadata, state, self._id)
        self._handles.add(handle)
        return handle

    def _post_reply(self, state: _PendingRecv, tags: _StageTags) -> None:
        """Post the receive of ``state``'s reply into a buffer from the pool.

        At most one reply receive per stage is posted ahead of its ``recv_ffn_output``: in a
        stream (several transfers of a stage sent before any reply is received) the others wait
        in the stage's queue, so the FFN rank is not sent a receive notice per transfer while it
        is busy receiving. ``_reply_queue[stage]`` holds the stage's transfers in send order,
        every posted one before every unposted one.
        """
        buffer = self._buffers.get(
            tags.reply_key, (state.num_tokens, self._hidden), self._out_dtype
        )
        state.buffer = buffer
        state.recv_work = self._data_pg.recv([buffer], state.peer, tags.reply)
        state.posted = True

    def _make_stage_tags(self, stage: int) -> _StageTags:
        tags = self._stage_tags[stage] = _StageTags(stage, self._wire_fields, self._served)
        return tags

    def recv_ffn_output(
        self, handle: AFDTransferHandle, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self._initialized or self._is_ffn:
            self._check_ready(AFDRole.ATTENTION, "recv_ffn_output")
        if not isinstance(handle, AFDTransferHandle) or handle.connector_id != self._id:
            raise AFDConnectorError("recv_ffn_output needs a handle from this connector")
        state = handle.state
        if not isinstance(state, _PendingRecv):
            raise AFDConnectorError("AFD transfer handle was invalidated by close()")
        n = handle.metadata.num_tokens[0]
        shape = (n, self._hidden)
        if out is not None and (
            tuple(out.shape) != shape
            or out.dtype != self.payload_spec.dtype
            or out.device.type != self._device_type
        ):
            raise AFDPayloadError(
                "out",
                (tuple(out.shape), out.dtype, str(out.device)),
                f"shape {shape}, dtype {self.payload_spec.dtype}, a {self.device.type} tensor",
            )
        handle.consume()
        handle.state = None
        peer = state.peer
        works = [(w, peer) for w in state.send_works]
        queue = self._reply_queue.get(state.stage) if n else None
        if queue is not None and not state.posted:
            # Replies of a stage arrive in order and gloo matches receives in the order they
            # were posted: post every earlier queued receive first, then this one.
            tags = self._stage_tags[state.stage]
            try:
                for queued in queue:
                    if not queued.posted:
                        self._post_reply(queued, tags)
                    if queued is state:
                        break
            except RuntimeError as err:
                state.send_works.clear()
                self._fail(err, "recv_ffn_output", peer)
        if state.recv_work is not None:
            works.append((state.recv_work, peer))
        state.send_works = []
        state.recv_work = None
        self._wait(works, "recv_ffn_output")
        if queue is not None:
            if queue[0] is state:
                queue.popleft()
            else:  # received out of order
                queue.remove(state)
            if queue and not queue[0].posted and self._post_early:
                # A stream of transfers (several sent before any reply): keep the next reply's
                # receive posted ahead, one at a time.
                try:
                    self._post_reply(queue[0], self._stage_tags[state.stage])
                except RuntimeError as err:
                    self._fail(err, "recv_ffn_output", peer)
        if self._control_send is not None:  # complete: the FFN rank replied, so it has it
            self._finish_control_send()
        result = state.buffer
        state.buffer = None
        if result is None:  # zero tokens: nothing was on the wire
            result = torch.empty(shape, dtype=self.payload_spec.dtype, device=self.device)
        if out is not None:
            out.copy_(result)
            return out
        return result

    # -- FFN side --------------------------------------------------------------------------

    def _expected_ffn_counts(self, metadata: AFDTransferMetadata) -> None:
        control = self._control
        if control is None:
            return
        if metadata.stage_idx >= control.num_stages:
            raise AFDPayloadError(
                "stage_idx", metadata.stage_idx, f"an int in 0..{control.num_stages - 1}"
            )
        announced = control.stage_token_counts[metadata.stage_idx]
        if metadata.num_tokens != announced:
            raise AFDPayloadError("num_tokens", metadata.num_tokens, f"{announced} as announced")

    def _post_recv(self, stage: int, src: int, n: int) -> _PostedRecv:
        """Post the receives of ``stage``'s next transfer (``n`` tokens) from world rank ``src``.

        The common case (hidden states only, no sequence header) posts before it builds the
        payload objects: on a receive posted when asked for, everything before the posting
        delays the sender (it waits for the receive's notice), and on a busy host that code
        runs with cold caches right after this thread woke up."""
        if n and self._hidden_only and not self.check_sequence:
            tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
            buf = self._buffers.get(tags.recv_keys[src][0], (n, self._hidden), self._out_dtype)
            try:
                work = self._data_pg.recv([buf], src, tags.fields[0][1])
            except RuntimeError as err:
                self._fail(err, "recv_attn_output", src)
            posted = _PostedRecv(n, [buf], AFDPayload._of_hidden_states(buf))
            posted.works.append(work)
            return posted
        posted = self._prepare_recv(stage, src, n)
        self._start_recv(posted, stage, src)
        return posted

    def _prepare_recv(self, stage: int, src: int, n: int) -> _PostedRecv:
        """The buffers and payload of ``stage``'s next transfer from ``src``, not yet posted."""
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        keys = tags.recv_keys[src]
        if self._hidden_only:
            buf = self._buffers.get(keys[0], (n, self._hidden), self._out_dtype)
            return _PostedRecv(n, [buf], AFDPayload._of_hidden_states(buf))
        specs = self.payload_spec.fields
        tensors = [
            self._buffers.get(key, spec.shape(n), spec.dtype)
            for spec, key in zip(specs, keys)  # noqa: B905
        ]
        payload = AFDPayload(**{spec.name: t for spec, t in zip(specs, tensors)})  # noqa: B905
        return _PostedRecv(n, tensors, payload)

    def _start_recv(self, posted: _PostedRecv, stage: int, src: int) -> None:
        """Post the receives of a prepared transfer (nothing is posted for zero tokens)."""
        tags = self._stage_tags[stage]
        pg = self._data_pg
        works = posted.works
        try:
            if self.check_sequence:
                posted.header = torch.empty(3, dtype=torch.int64, device=self.device)
                works.append(pg.recv([posted.header], src, tags.sequence))
            if posted.num_tokens:
                for (_, tag), buf in zip(tags.fields, posted.tensors):  # noqa: B905
                    works.append(pg.recv([buf], src, tag))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "recv_attn_output", src)

    def _window(self, n: int) -> int:
        """Receives of one stage and served Attention rank kept posted ahead for transfers of
        ``n`` tokens, before the cap by the layers left in the step (the Attention side computes
        the same to mirror it): as many as fit in ``recv_ahead_bytes``, at most one with
        ``reuse_buffers`` (three kept buffers), none with ``recv_ahead`` off or off gloo."""
        if not (n and self.recv_ahead and self._post_early):
            return 0
        window = self.recv_ahead_bytes // (n * self._token_bytes)
        return min(window, 1) if self.reuse_buffers else window

    def _post_ahead(self, stage: int, counts: Sequence[int], left: int, full: bool) -> None:
        """Top ``stage``'s posted receives up to their window (``full``: a stream) or one
        (request/reply), at most ``left`` (the layers left in the step)."""
        for src, n in zip(self._served, counts, strict=True):
            want = min(self._window(n), left if full else min(left, 1))
            if want:
                queue = self._posted[stage, src]
                while len(queue) < want:
                    queue.append(self._post_recv(stage, src, n))

    def _post_step_recvs(self, control: AFDControlMessage) -> None:
        """New step: keep receives left posted when their count holds, post every first one."""
        self._after_reply.clear()  # nothing on the wire for these yet
        self._unreplied.clear()
        self._seen.clear()
        for (stage, src), queue in list(self._posted.items()):
            posted = queue[0]
            col = self._served.index(src)
            n = control.stage_token_counts[stage][col] if stage < control.num_stages else None
            if n != posted.num_tokens:
                # The peer's next transfer would land in a receive of the wrong size (gloo
                # aborts the process on that); the Attention side refuses first, see
                # send_control, so this is the second line of defence.
                self._fail(
                    AFDProtocolError(
                        f"stage {stage} still has a receive posted for {posted.num_tokens} "
                        f"tokens from world rank {src} (its previous step ended before layer "
                        f"{self.num_layers - 1}), but the new step announces {n}; end every "
                        "step at the last layer or set connector_extra_config.recv_ahead=false"
                    ),
                    "recv_control",
                    src,
                )
        # Stages with a window for some served rank (the others never post ahead this step).
        self._ahead_stages = frozenset(
            stage
            for stage, counts in enumerate(control.stage_token_counts)
            if any(self._window(n) for n in counts)
        )
        for stage in self._ahead_stages:
            counts = control.stage_token_counts[stage]
            self._post_ahead(stage, counts, self.num_layers, stage in self._streaming)

    def recv_attn_output(self, metadata: AFDTransferMetadata) -> list[AFDPayload]:
        control = self._control
        if not (  # the hot path: counts as announced by this step's control message
            self._initialized
            and self._is_ffn
            and type(metadata) is AFDTransferMetadata
            and control is not None
            and metadata.layer_idx < self.num_layers
            and metadata.stage_idx < len(control.stage_token_counts)
            and metadata.num_tokens == control.stage_token_counts[metadata.stage_idx]
        ):
            self._check_ready(AFDRole.FFN, "recv_attn_output")
            self._check_metadata(metadata, None)
            self._expected_ffn_counts(metadata)
        stage = metadata.stage_idx
        posted_map = self._posted
        recvs: list[_PostedRecv] = []
        works: list[tuple[Any, int]] = []
        # One count per served rank (checked by _check_metadata).
        for src, n in zip(self._served, metadata.num_tokens):  # noqa: B905
            queue = posted_map.get((stage, src))
            if queue is None:
                posted = self._post_recv(stage, src, n)
            else:
                posted = queue.popleft()
                if not queue:
                    del posted_map[stage, src]
            recvs.append(posted)
            for work in posted.works:
                works.append((work, src))
            posted.works = []
        # Everything but the wait happens before it, so the caller gets the data as soon as it
        # is in: the result objects, and (see _schedule_ahead) perhaps the next receive.
        payloads = [posted.payload for posted in recvs]
        self._after_reply.pop(stage, None)
        # The call pattern decides the window (see _schedule_ahead); the last one seen is
        # kept for the next step's first receives.
        if stage in self._unreplied:
            self._streaming.add(stage)
        elif stage in self._seen:
            self._streaming.discard(stage)
        self._seen.add(stage)
        left = self.num_layers - 1 - metadata.layer_idx
        if left and stage in self._ahead_stages:
            self._schedule_ahead(stage, metadata.num_tokens, left)
        self._unreplied.add(stage)
        self._wait(works, "recv_attn_output")
        if self.check_sequence:
            self._check_headers(metadata, recvs)
        self._last_received = metadata
        return payloads

    def _schedule_ahead(self, stage: int, counts: tuple[int, ...], left: int) -> None:
        """Top ``stage``'s receives up, now or right with this transfer's reply (``left``:
        layers after this one).

        Request/reply (the service loop, where the previous transfer of the stage was replied
        to): one receive ahead, posted with the reply (just before it), so the receive notice
        reaches the Attention rank while it waits for that reply; posted earlier, it meets the
        Attention rank in the middle of its next send, which on a busy host stalls that send for
        milliseconds now and then. The Attention rank cannot send the next layer before it has
        the reply, so a deeper window would only cycle more buffers through the cache. A stream
        (the previous transfer not replied yet): the whole window, now, before waiting; a stage
        that streamed has its whole window posted at the next step's control message too.
        """
        if stage in self._unreplied:
            self._post_ahead(stage, counts, left, True)
            return
        # Buffers and payloads now, before the wait (off the path between the data's arrival
        # and the reply); only the posting waits for the reply.
        prepared = []
        for src, n in zip(self._served, counts, strict=True):
            want = min(self._window(n), 1)
            if want:
                queue = self._posted.get((stage, src))
                for _ in range(want - (len(queue) if queue else 0)):
                    prepared.append((src, self._prepare_recv(stage, src, n)))
        if prepared:
            self._after_reply[stage] = prepared

    def _check_headers(self, metadata: AFDTransferMetadata, recvs: list[_PostedRecv]) -> None:
        stage = metadata.stage_idx
        for src, n, posted in zip(self._served, metadata.num_tokens, recvs, strict=True):
            if posted.header is None:
                continue
            got = tuple(int(v) for v in posted.header.tolist())
            want = (metadata.layer_idx, stage, n)
            if got != want:
                self._fail(
                    AFDProtocolError(
                        f"sequence check failed: world rank {src} sent (layer, stage, tokens)="
                        f"{got}, this FFN rank expected {want}"
                    ),
                    "recv_attn_output",
                    src,
                )

    def send_ffn_output(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        if not (self._initialized and self._is_ffn):
            self._check_ready(AFDRole.FFN, "send_ffn_output")
        if metadata is not self._last_received:  # that one was checked by recv_attn_output
            self._check_metadata(metadata, None)
            self._expected_ffn_counts(metadata)
        spec = self._reply_spec
        counts = metadata.num_tokens
        if isinstance(outputs, torch.Tensor):
            total = metadata.total_tokens
            if outputs.dim() != 2 or outputs.shape[0] != total:
                raise AFDPayloadError(
                    "outputs", tuple(outputs.shape), f"shape {(total, spec.width)} (all peers)"
                )
            parts: Sequence[torch.Tensor] = torch.split(outputs, list(counts))
        else:
            parts = outputs if type(outputs) is list else list(outputs)
            if len(parts) != len(self._served):
                raise AFDPayloadError(
                    "outputs", len(parts), f"{len(self._served)} tensors (one per served rank)"
                )
        device_type = self._device_type
        hidden, dtype, on_cpu = self._hidden, self._out_dtype, device_type == "cpu"
        for part, n in zip(parts, counts):  # noqa: B905 (lengths checked above)
            if (  # the full checks only when the cheap one fails (they name what is wrong)
                type(part) is not torch.Tensor
                or part.dtype is not dtype
                or part.shape != (n, hidden)
                or not (part.is_cpu if on_cpu else part.device.type == device_type)
            ):
                if not isinstance(part, torch.Tensor):
                    raise AFDPayloadError("outputs", type(part).__name__, "torch.Tensor items")
                AFDPayloadSpec.validate_tensor(spec, part, n, device_type, name="outputs")
        stage = metadata.stage_idx
        self._unreplied.discard(stage)
        prepared = self._after_reply.pop(stage, None)
        if prepared:  # the receives prepared by recv_attn_output go just before this reply
            for src, posted in prepared:
                self._start_recv(posted, stage, src)
                self._posted[stage, src].append(posted)
        tag = (self._stage_tags.get(stage) or self._make_stage_tags(stage)).reply
        pg = self._data_pg
        works: list[tuple[Any, int]] = []
        try:
            for part, n, dst in zip(parts, counts, self._served):  # noqa: B905
                if n:
                    works.append((pg.send([part.contiguous()], dst, tag), dst))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "send_ffn_output", None)
        self._wait(works, "send_ffn_output")
