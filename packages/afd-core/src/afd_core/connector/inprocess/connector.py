"""Both roles as objects in one process, moving tensors through queues (``"inprocess"``).

Like httpx's ``MockTransport``: the layers above a connector (afd-remote's proxies, afd-runtime's
FFN service and Attention link) are tested on it without gloo and without spawned processes, and
it proves the contract: everything but byte movement is the shared session
(:class:`~afd_core.connector.session_base.AFDSessionConnector`: round claim, handshake with the
same :class:`AFDHandshakeError` as over P2P, ``open_groups``/``confirm_ready``, liveness, failure publication, goodbye),
here on an in-memory ``torch.distributed.HashStore``.

A world is the *hub* of ``(config.host, config.port)`` in this process (nothing listens on that
port): its store and one FIFO queue per ``(round, sender, receiver, kind, stage)``. Every
transfer is one request ``(layer, stage, tokens, tensors)`` from an Attention rank to an FFN rank
(sent for every stage, also with 0 tokens) and, when it had tokens, one reply. Sent
tensors are copied, so a sender may reuse its buffers. A wait polls its peer's published failure
and goodbye between queue reads, and is bounded by ``config.timeout_s``. The one process group it
opens is the FFN ranks' own (gloo between their threads) when their compute is a collective over
them (``config.needs_ffn_group``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.base import (
    AFDGroupInfo,
    AFDTransferHandle,
    check_transfer_counts,
    merge_control_messages,
    split_ffn_outputs,
)
from afd_core.connector.session_base import AFDSessionConnector
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDNotInitializedError,
    AFDPayloadError,
    AFDProtocolError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session.session import AFDSession

__all__ = ["InProcessConnector", "release_hubs"]

_POLL_S = 0.02  # how often a wait looks at its peer's failure / goodbye


class _Hub:
    """One in-process world: its rendezvous store and its queues."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self._lock = threading.Lock()
        self._queues: dict[tuple[int, ...], queue.SimpleQueue[Any]] = {}

    def queue(self, key: tuple[int, ...]) -> queue.SimpleQueue[Any]:
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.SimpleQueue()
            return q


_HUBS: dict[tuple[str, int], _Hub] = {}
_HUBS_LOCK = threading.Lock()


def _hub(config: AFDConfig) -> _Hub:
    with _HUBS_LOCK:
        return _HUBS.setdefault((config.host, config.port), _Hub())


def release_hubs() -> None:
    """Forget every in-process world of this process (tests; connectors still open keep theirs)."""
    with _HUBS_LOCK:
        _HUBS.clear()


_CTL, _REQ, _REPLY = 0, 1, 2


class InProcessConnector(AFDSessionConnector):
    """Both roles in one process (see the module docstring)."""

    name = "inprocess"
    label = "in-process"
    protocol_version = 1
    has_control_plane = True

    _hub_: _Hub | None = None
    _round = 0
    _announced: tuple[int, ...] | None = None
    _control: AFDControlMessage | None = None
    _ffn_pg: Any = None

    # -- transport lifecycle ---------------------------------------------------------------

    @classmethod
    def _rendezvous(cls, config: AFDConfig, world_rank: int, timeout_s: float) -> Any:
        return _hub(config).store

    def _open_transport(self, session: AFDSession, deadline: float) -> None:
        self._hub_ = _hub(self.config)
        self._round = session.generation
        self._announced = self._control = None
        if self.config.needs_ffn_group:
            # A collective compute over the FFN ranks (Mega) needs a real group: gloo between
            # the FFN ranks' threads, on this world's store.
            info = self.ffn_group_info()
            self._ffn_pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"pg/ffn/{self._round}", session.store),
                info.rank,
                info.world_size,
                timedelta(seconds=self.config.timeout_s),
            )

    def _close_transport(self) -> None:
        self._hub_ = None
        self._announced = self._control = None
        self._ffn_pg = None

    def ffn_group_info(self) -> AFDGroupInfo:
        """FFN side, with ``config.needs_ffn_group``: the FFN ranks' gloo group (see
        :meth:`~afd_core.connector.base.AFDConnectorBase.ffn_group_info`)."""
        if not (self.config.needs_ffn_group and self._hub_ is not None):
            raise AFDNotInitializedError("AFD in-process connector has no FFN group")
        name = f"afd-inprocess/{self.config.host}:{self.config.port}/g{self._round}/ffn"
        return self._ffn_group(name)

    def ffn_process_group(self) -> Any:
        """The gloo group of :meth:`ffn_group_info`."""
        if self._ffn_pg is None:
            raise AFDNotInitializedError("AFD in-process connector has no FFN group")
        return self._ffn_pg

    # -- moving objects --------------------------------------------------------------------

    def _check(self, role: AFDRole, op: str) -> None:
        if not self._initialized:
            raise AFDNotInitializedError(f"AFD in-process connector is not initialised ({op})")
        if self.role is not role:
            raise AFDConnectorError(f"{op} is a {role} operation; this rank's role is {self.role}")

    def _queue(self, src: int, dst: int, kind: int, stage: int) -> queue.SimpleQueue[Any]:
        hub = self._hub_
        if hub is None:
            raise AFDNotInitializedError("AFD in-process connector was closed")
        return hub.queue((self._round, src, dst, kind, stage))

    def _put(self, dst: int, kind: int, stage: int, item: Any) -> None:
        self._queue(self.world_rank, dst, kind, stage).put(item)

    def _get(self, src: int, kind: int, stage: int, op: str, timeout_s: float | None = None) -> Any:
        """The next item from ``src``; fails (published, closed) when ``src`` failed or left, or
        after ``timeout_s`` (default ``config.timeout_s``)."""
        wait_s = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        q = self._queue(src, self.world_rank, kind, stage)
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            session = self._session
            if session is None:
                raise AFDNotInitializedError(f"AFD in-process connector was closed ({op})")
            gone = session.peer_gone(src)
            if gone is not None:
                self._fail(gone, op, src)
            if time.monotonic() >= deadline:
                self._fail(
                    AFDTimeoutError(
                        f"AFD in-process {op} with world rank {src} did not complete within "
                        f"{wait_s:g}s"
                    ),
                    op,
                    src,
                )

    def _request(self, dst: int, meta: AFDTransferMetadata, n: int, payload: AFDPayload) -> None:
        tensors = {k: t.detach().clone() for k, t in payload.tensors().items()}
        self._put(dst, _REQ, meta.stage_idx, (meta.layer_idx, meta.stage_idx, n, tensors))

    def _take_request(self, src: int, layer: int, stage: int, limit: int, op: str) -> Any:
        got_layer, got_stage, n, tensors = self._get(src, _REQ, stage, op)
        if (got_layer, got_stage) != (layer, stage) or not 0 <= n <= limit:
            self._fail(
                AFDProtocolError(
                    f"request header from world rank {src} is (layer, stage, tokens)="
                    f"{(got_layer, got_stage, n)}; this FFN rank expected layer {layer}, stage "
                    f"{stage} and at most {limit} tokens"
                ),
                op,
                src,
            )
        return n, AFDPayload(**tensors)

    def _take_reply(self, src: int, stage: int, n: int, op: str) -> torch.Tensor:
        if n == 0:
            return torch.empty(
                self.payload_spec.output_shape(0), dtype=self.payload_spec.dtype, device=self.device
            )
        reply: torch.Tensor = self._get(src, _REPLY, stage, op)
        return reply

    def _check_layer(self, meta: AFDTransferMetadata) -> None:
        if not isinstance(meta, AFDTransferMetadata):
            raise AFDPayloadError("metadata", type(meta).__name__, "an AFDTransferMetadata")
        if meta.layer_idx >= self.num_layers:
            raise AFDPayloadError(
                "layer_idx", meta.layer_idx, f"an int in 0..{self.num_layers - 1}"
            )

    def _announced_count(self, stage: int, op: str) -> int:
        if self._announced is None:
            raise AFDProtocolError(f"{op} before this step's send_control")
        if stage >= len(self._announced):
            raise AFDPayloadError("stage_idx", stage, f"an int in 0..{len(self._announced) - 1}")
        return self._announced[stage]

    def _handle(self, handle: AFDTransferHandle, op: str) -> Any:
        if not isinstance(handle, AFDTransferHandle) or handle.connector_id != id(self):
            raise AFDConnectorError(f"{op} needs a handle from this connector")
        if handle.state is None or handle.state[0] != self._round or self._hub_ is None:
            raise AFDConnectorError("AFD transfer handle was invalidated by close()")
        handle.consume()
        return handle.state

    # -- control plane ---------------------------------------------------------------------

    def send_control(self, message: AFDControlMessage) -> None:
        self._check(AFDRole.ATTENTION, "send_control")
        if not isinstance(message, AFDControlMessage):
            raise AFDPayloadError("message", type(message).__name__, "an AFDControlMessage")
        a = self.topology.num_attention_peers
        if message.num_stages and message.width not in (1, a):
            raise AFDPayloadError(
                "stage_token_counts",
                message.stage_token_counts,
                f"1 or {a} entries per stage (one per Attention peer)",
            )
        if message.num_stages and message.width != 1:
            message = message.select([self.role_rank])
        self._announced = (
            None if message.shutdown else tuple(s[0] for s in message.stage_token_counts)
        )
        for dst in self.topology.peers_of(AFDRole.ATTENTION, self.role_rank):
            self._put(dst, _CTL, 0, message)

    def recv_control(self, timeout_s: float | None = None) -> AFDControlMessage:
        self._check(AFDRole.FFN, "recv_control")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
        ):
            raise AFDConfigError("timeout_s", timeout_s, "None, math.inf or seconds > 0")
        served = self.topology.peers_of(AFDRole.FFN, self.role_rank)
        messages = [self._get(src, _CTL, 0, "recv_control", timeout_s) for src in served]
        try:
            merged = merge_control_messages(messages, served)
        except AFDProtocolError as mismatch:
            self._fail(mismatch, "recv_control", None)
        self._control = None if merged.shutdown else merged
        return merged

    def _control_counts(self, stage: int, op: str) -> tuple[int, ...]:
        control = self._control
        if control is None:
            raise AFDProtocolError(f"{op} before this step's recv_control")
        if not 0 <= stage < control.num_stages:
            raise AFDPayloadError("stage_idx", stage, f"an int in 0..{control.num_stages - 1}")
        return control.stage_token_counts[stage]

    # -- Attention side --------------------------------------------------------------------

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        self._check(AFDRole.ATTENTION, "send_dispatch")
        self._check_layer(metadata)
        announced = self._announced_count(metadata.stage_idx, "send_dispatch")
        ranks = self.topology.peers_of(AFDRole.ATTENTION, self.role_rank)
        payloads = list(payloads)
        if len(metadata.num_tokens) != len(ranks):
            raise AFDPayloadError(
                "num_tokens", metadata.num_tokens, f"{len(ranks)} count(s) (one per FFN rank)"
            )
        if len(payloads) != len(ranks):
            raise AFDPayloadError("payloads", len(payloads), f"{len(ranks)} (one per FFN rank)")
        counts = metadata.num_tokens
        check_transfer_counts(counts, (announced,) * len(counts), len(ranks) == 1)
        for payload, n in zip(payloads, metadata.num_tokens, strict=True):
            self.payload_spec.validate_payload(payload, n, self.device.type)
        for dst, payload, n in zip(ranks, payloads, metadata.num_tokens, strict=True):
            self._request(dst, metadata, n, payload)
        return AFDTransferHandle(metadata, (self._round, ranks), id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        self._check(AFDRole.ATTENTION, "recv_combine")
        _, ranks = self._handle(handle, "recv_combine")
        stage = handle.metadata.stage_idx
        return [
            self._take_reply(src, stage, n, "recv_combine")
            for src, n in zip(ranks, handle.metadata.num_tokens, strict=True)
        ]

    # -- FFN side --------------------------------------------------------------------------

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        self._check(AFDRole.FFN, "recv_dispatch")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        if not 0 <= layer_idx < self.num_layers:
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        if isinstance(stage_idx, bool) or not isinstance(stage_idx, int):
            raise AFDPayloadError("stage_idx", stage_idx, "an int")
        limits = self._control_counts(stage_idx, "recv_dispatch")
        served = self.topology.peers_of(AFDRole.FFN, self.role_rank)
        taken = [
            self._take_request(src, layer_idx, stage_idx, limit, "recv_dispatch")
            for src, limit in zip(served, limits, strict=True)
        ]
        counts = tuple(n for n, _ in taken)
        return AFDTransferMetadata(layer_idx, stage_idx, counts), [p for _, p in taken]

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        self._check(AFDRole.FFN, "send_combine")
        self._check_layer(metadata)
        served = self.topology.peers_of(AFDRole.FFN, self.role_rank)
        counts = metadata.num_tokens
        if len(counts) != len(served):
            raise AFDPayloadError("num_tokens", counts, f"{len(served)} count(s) (one per peer)")
        spec = self.payload_spec.fields[0]
        parts = split_ffn_outputs(outputs, metadata, spec.width, len(served))
        for part, n in zip(parts, counts, strict=True):
            if not isinstance(part, torch.Tensor):
                raise AFDPayloadError("outputs", type(part).__name__, "torch.Tensor items")
            AFDPayloadSpec.validate_tensor(spec, part, n, self.device.type, name="outputs")
        for dst, part, n in zip(served, parts, counts, strict=True):
            if n:
                self._put(dst, _REPLY, metadata.stage_idx, part.detach().clone())
