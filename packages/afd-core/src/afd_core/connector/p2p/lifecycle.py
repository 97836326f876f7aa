"""One P2P connector rank's state and transport lifecycle, shared by both sides.

:class:`_P2PLifecycle` holds the state of a rank (both roles' fields; a rank uses its role's). Its
session (rendezvous, rounds, handshake, liveness, failure publication, goodbye) is the shared one
of :class:`~afd_core.connector.session_base.AFDSessionConnector`; this module adds the P2P
transport: the rendezvous store (a TCPStore at ``host:port`` behind the access gate), the two
process groups on the session's store (and, on FFN ranks whose compute is a collective over them,
a third of the FFN ranks only), their teardown, and what both sides use (the wait that
turns a transport error into :meth:`_fail`, the metadata checks, the stage tags, the
receive-ahead window). The Attention side (:mod:`afd_core.connector.p2p.attention`) and the FFN
side (:mod:`afd_core.connector.p2p.ffn`) build on it.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import math
import weakref
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from afd_core.buffers import RecvBufferPool
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.base import AFDGroupInfo, AFDTransferHandle
from afd_core.connector.p2p.groups import _LONG_WAIT, backend_for_device, make_process_group
from afd_core.connector.p2p.recv_ahead import (
    RECV_AHEAD_BYTES,
    _PendingRecv,
    _PostedRecv,
    _recv_window,
)
from afd_core.connector.p2p.wire import CONTROL_WORDS, PROTOCOL_VERSION, _StageTags
from afd_core.connector.session_base import AFDSessionConnector
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDNotInitializedError,
    AFDPayloadError,
)
from afd_core.metadata import AFDControlMessage, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session.access import deployment_secret, local_address
from afd_core.session.session import AFDSession
from afd_core.session.startup import open_tcp_store
from afd_core.topology import AFDTopology


def _address_in_use(err: BaseException) -> bool:
    """Whether ``err`` is a listening socket's "address already in use": an ``OSError`` with
    ``EADDRINUSE`` from a socket bound here, or torch's ``DistNetworkError`` (which carries the
    errno only in its text) from ``TCPStore``'s own bind."""
    if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
        return True
    text = str(err)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


class _P2PLifecycle(AFDSessionConnector):
    """State and transport lifecycle of a P2P connector rank (see the module docstring)."""

    protocol_version = PROTOCOL_VERSION
    label = "P2P"

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
        # Attention side: (stage, FFN world rank) -> transfers awaiting its reply, in send order.
        self._reply_queue: dict[tuple[int, int], collections.deque[_PendingRecv]] = {}
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
        # One FFN rank (F = 1) gets every token of its Attention ranks: a transfer's count is
        # the step's announced one, so the FFN side posts its receives ahead from the control
        # message. With F > 1 the count of each (layer, stage) travels in a header first.
        self._counts_fixed = not topo.expert_parallel
        self._headers = self.check_sequence or not self._counts_fixed
        self._ffn_world_ranks: tuple[int, ...] = ()
        self._ffn_world_rank = -1
        self._served: tuple[int, ...] = ()
        self._bind_peers()
        # FFN side: the next header of each (stage, Attention world rank), posted ahead.
        self._headers_ahead: dict[tuple[int, int], tuple[torch.Tensor, Any]] = {}
        self._control_bufs = [torch.empty(CONTROL_WORDS, dtype=torch.int64) for _ in self._served]
        self._timeout = timedelta(seconds=config.timeout_s)
        self._ctl_pg: Any = None
        self._data_pg: Any = None
        self._ffn_pg: Any = None  # FFN side, config.needs_ffn_group: the FFN ranks' group
        self._announced: tuple[int, ...] | None = None
        self._control: AFDControlMessage | None = None
        self._step_last = self.step_last_layer(False)  # the current step's last layer index
        self._handles: weakref.WeakSet[AFDTransferHandle] = weakref.WeakSet()

    def _bind_peers(self) -> None:
        """The peers of the current round's topology (elastic worlds change them by round)."""
        topo = self.topology
        if self.role is AFDRole.ATTENTION:
            self._ffn_world_ranks = topo.peers_of(AFDRole.ATTENTION, self.role_rank)
            self._ffn_world_rank = self._ffn_world_ranks[0]
            self._served = ()
        else:
            self._ffn_world_ranks = ()
            self._ffn_world_rank = -1
            self._served = topo.peers_of(AFDRole.FFN, self.role_rank)
        self._stage_tags = {}

    # -- identity ------------------------------------------------------------------------

    @property
    def served_world_ranks(self) -> tuple[int, ...]:
        """FFN side: world ranks of the served Attention ranks (empty on the Attention side)."""
        return self._served

    def group_info(self) -> AFDGroupInfo:
        """The data group of this initialisation (valid from ``open_groups`` on).

        Name ``afd-p2p/<host>:<port>/g<generation>/data``: a label unique per store server and
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

    def data_process_group(self) -> Any:
        """The torch.distributed group the data plane runs on (valid from ``open_groups`` on)."""
        if self._data_pg is None:
            raise AFDNotInitializedError("AFD P2P connector has no data group (data_process_group)")
        return self._data_pg

    def ffn_group_info(self) -> AFDGroupInfo:
        """FFN side, with ``config.needs_ffn_group``: the group of the round's FFN ranks (valid
        from ``open_groups`` on). Name ``afd-p2p/<host>:<port>/g<generation>/ffn``; rank: this
        FFN rank's index in the round."""
        if self._ffn_pg is None:
            raise AFDNotInitializedError("AFD P2P connector has no FFN group (ffn_group_info)")
        return self._ffn_group(
            f"afd-p2p/{self.config.host}:{self.config.port}/g{self._generation}/ffn"
        )

    def ffn_process_group(self) -> Any:
        """The torch.distributed group of :meth:`ffn_group_info` (same backend as the data
        group)."""
        if self._ffn_pg is None:
            raise AFDNotInitializedError("AFD P2P connector has no FFN group (ffn_process_group)")
        return self._ffn_pg

    # -- transport lifecycle (the session runs the rest) ----------------------------------

    @classmethod
    def _rendezvous(cls, config: AFDConfig, world_rank: int, timeout_s: float) -> Any:
        """The rendezvous store (world rank 0 serves it on ``host:port``); a non-loopback host
        without ``AFD_SECRET`` is refused before any socket opens.

        Raises:
            AFDConfigError: ``port`` is already in use on this host (world rank 0 only: the
                store server cannot bind it). Without this, the bind failure would read as a
                failed peer, and the other role would wait out its startup timeout.
        """
        secret = deployment_secret(config.host)
        is_master = world_rank == 0
        try:
            return open_tcp_store(
                config.host, config.port, is_master=is_master, timeout_s=timeout_s, secret=secret
            )
        except Exception as err:
            if not (is_master and _address_in_use(err)):
                raise
            raise AFDConfigError(
                "port",
                config.port,
                f"a TCP port free on {config.host} (world rank 0, the first Attention "
                "rank, serves the AFD rendezvous store there; set the same free port on every "
                "role)",
                detail=f"{config.host}:{config.port} is already in use by another "
                f"process: {type(err).__name__}: {err}",
            ) from err

    def _open_transport(self, session: AFDSession, deadline: float) -> None:
        """The Gloo control group and the data group on the session's store."""
        self._bind_peers()
        bind_address = local_address(self.config.host, self.config.port)
        ns = session.store
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
        if self.config.needs_ffn_group:
            # Only the FFN ranks join it (their agreement on the compute was handshaken).
            shape = self._ffn_group("")
            self._ffn_pg = make_process_group(
                self.backend,
                dist.PrefixStore("pg/ffn", ns),
                shape.rank,
                shape.world_size,
                self._timeout,
                bind_address=bind_address,
            )

    def _close_transport(self) -> None:
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
        self._headers_ahead = {}
        for name in ("_ffn_pg", "_data_pg", "_ctl_pg"):
            pg = getattr(self, name)
            setattr(self, name, None)
            if pg is not None and self.backend != "gloo" and name != "_ctl_pg":
                shutdown = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
                if shutdown is not None:
                    with contextlib.suppress(Exception):
                        shutdown()
            del pg
        self._announced = None
        self._control = None
        # The current step's last layer index (draft steps run only the draft layers).
        self._step_last = self.step_last_layer(False)
        self._buffers.clear()

    # -- failure handling ------------------------------------------------------------------

    def _check_ready(self, role: AFDRole, op: str) -> None:
        if not self._initialized:
            raise AFDNotInitializedError(f"AFD P2P connector is not initialised ({op})")
        if self.config.role is not role:
            raise AFDConnectorError(f"{op} is a {role} operation; this rank's role is {self.role}")

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

    def _check_metadata(self, metadata: AFDTransferMetadata, width: int) -> None:
        """``metadata`` is an :class:`AFDTransferMetadata` of a layer this connector has, with
        ``width`` counts (one per peer)."""
        if not isinstance(metadata, AFDTransferMetadata):
            raise AFDPayloadError("metadata", type(metadata).__name__, "an AFDTransferMetadata")
        if metadata.layer_idx >= self.num_layers:
            raise AFDPayloadError(
                "layer_idx", metadata.layer_idx, f"an int in 0..{self.num_layers - 1}"
            )
        if len(metadata.num_tokens) != width:
            raise AFDPayloadError(
                "num_tokens", metadata.num_tokens, f"{width} count(s) (one per peer)"
            )

    def _make_stage_tags(self, stage: int) -> _StageTags:
        tags = self._stage_tags[stage] = _StageTags(
            stage, self._wire_fields, self._served, self._ffn_world_ranks
        )
        return tags

    def _window(self, n: int) -> int:
        """This rank's :func:`~afd_core.connector.p2p.recv_ahead._recv_window` for transfers of ``n``
        tokens (``recv_ahead`` on gloo only; ``recv_ahead_bytes``; ``reuse_buffers``)."""
        return _recv_window(
            n,
            self.recv_ahead and self._post_early,
            self.recv_ahead_bytes,
            self._token_bytes,
            self.reuse_buffers,
        )
