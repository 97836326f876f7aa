"""The P2P connector's expert-parallel data plane (``num_ffn_ranks > 1``).

Every Attention rank exchanges data with every FFN rank. Per layer and stage, Attention rank
``a`` sends FFN rank ``f`` a 3-word header ``(layer, stage, n)`` (int64, on the stage's sequence
tag) and then, when ``n > 0``, the ``n`` rows dispatched to ``f`` (one send per payload field);
``f`` answers the ``n`` rows with one reply. ``n == 0`` moves only the header: an FFN rank that
gets no tokens for a layer still learns so at once (it never waits for rows that do not come),
and the Attention rank does not wait for a reply of zero rows.

Receive order: gloo matches a (peer, tag)'s receives in posting order, and each stage's headers,
rows and replies travel in layer order, so nothing needs a sequence number beyond the header.
The Attention side posts a transfer's reply receives before its sends (as the request/reply path
does); the FFN side keeps the next header of each (stage, Attention rank) posted ahead (headers
have a fixed size, so a receive posted early can never meet a transfer of another size).

Invariants:

* a header whose (layer, stage) differs from the one asked for, or whose ``n`` exceeds the
  tokens its rank announced for the step, is an :class:`AFDProtocolError` (and a teardown);
* every wait is bounded by ``timeout_s`` and ends early with :class:`AFDPeerError` when a peer
  fails (as on the other paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from afd_core.config import AFDRole
from afd_core.connector.base import AFDTransferHandle
from afd_core.connector.p2p.lifecycle import _P2PLifecycle
from afd_core.errors import AFDConnectorError, AFDPayloadError, AFDProtocolError
from afd_core.metadata import AFDPayload, AFDTransferMetadata

_HEADER_WORDS = 3


class _DispatchState:
    """Attention side: one dispatched transfer's works and reply buffers (per FFN rank)."""

    __slots__ = ("buffers", "keep", "works")

    def __init__(self) -> None:
        self.works: list[tuple[Any, int]] = []  # sends first, then reply receives
        self.buffers: list[torch.Tensor | None] = []  # per FFN rank; None: zero rows
        self.keep: list[torch.Tensor] = []  # what the sends read (alive until waited)


class _ExpertParallelSide(_P2PLifecycle):
    """Both roles' expert-parallel operations of :class:`~afd_core.connector.p2p.P2PConnector`."""

    def _check_expert_parallel(self, role: AFDRole, op: str) -> None:
        self._check_ready(role, op)
        if not self._expert_parallel:
            other = "send_attn_output" if role is AFDRole.ATTENTION else "recv_attn_output"
            raise AFDConnectorError(
                f"{op} needs num_ffn_ranks > 1 (expert parallelism); with one FFN rank use {other}"
            )

    # -- Attention side --------------------------------------------------------------------

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        self._check_expert_parallel(AFDRole.ATTENTION, "send_dispatch")
        if not isinstance(metadata, AFDTransferMetadata):
            raise AFDPayloadError("metadata", type(metadata).__name__, "an AFDTransferMetadata")
        if metadata.layer_idx >= self.num_layers:
            raise AFDPayloadError(
                "layer_idx", metadata.layer_idx, f"an int in 0..{self.num_layers - 1}"
            )
        announced = self._ep_announced
        if announced is None:
            raise AFDProtocolError("send_dispatch before this step's send_control")
        stage = metadata.stage_idx
        if stage >= len(announced):
            raise AFDPayloadError("stage_idx", stage, f"an int in 0..{len(announced) - 1}")
        ranks = self._ffn_world_ranks
        counts = metadata.num_tokens
        if len(counts) != len(ranks):
            raise AFDPayloadError("num_tokens", counts, f"{len(ranks)} counts (one per FFN rank)")
        payloads = list(payloads)
        if len(payloads) != len(ranks):
            raise AFDPayloadError(
                "payloads", len(payloads), f"{len(ranks)} payloads (one per FFN rank)"
            )
        for n in counts:
            if n > announced[stage]:
                raise AFDPayloadError(
                    "num_tokens",
                    counts,
                    f"at most {announced[stage]} rows per FFN rank (this step's announced count)",
                )
        for payload, n in zip(payloads, counts, strict=True):
            self.payload_spec.validate_payload(payload, n, self._device_type)
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        pg = self._data_pg
        state = _DispatchState()
        dst = ranks[0]
        try:
            for dst, payload, n in zip(ranks, payloads, counts, strict=True):
                header = torch.tensor([metadata.layer_idx, stage, n], dtype=torch.int64)
                if n:
                    buf = torch.empty((n, self._hidden), dtype=self._out_dtype, device=self.device)
                    state.buffers.append(buf)
                    reply = pg.recv([buf], dst, tags.reply)
                else:
                    state.buffers.append(None)
                    reply = None
                state.keep.append(header)
                state.works.append((pg.send([header], dst, tags.sequence), dst))
                if n:
                    for name, tag in tags.fields:
                        tensor = getattr(payload, name).contiguous()
                        state.keep.append(tensor)
                        state.works.append((pg.send([tensor], dst, tag), dst))
                    state.works.append((reply, dst))
        except RuntimeError as err:
            state.works.clear()
            self._fail(err, "send_dispatch", dst)
        handle = AFDTransferHandle(metadata, state, self._id)
        self._handles.add(handle)
        return handle

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        self._check_expert_parallel(AFDRole.ATTENTION, "recv_combine")
        if not isinstance(handle, AFDTransferHandle) or handle.connector_id != self._id:
            raise AFDConnectorError("recv_combine needs a handle from this connector")
        state = handle.state
        if not isinstance(state, _DispatchState):
            raise AFDConnectorError("AFD transfer handle was invalidated by close()")
        handle.consume()
        handle.state = None
        self._wait(state.works, "recv_combine")
        state.keep.clear()
        if self._control_send is not None:  # complete: the FFN ranks replied or got headers
            self._finish_control_send()
        empty = None
        out: list[torch.Tensor] = []
        for buf in state.buffers:
            if buf is None:
                if empty is None:
                    empty = torch.empty(
                        (0, self._hidden), dtype=self._out_dtype, device=self.device
                    )
                buf = empty
            out.append(buf)
        return out

    # -- FFN side --------------------------------------------------------------------------

    def _post_header(self, stage: int, src: int) -> tuple[torch.Tensor, Any]:
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        header = torch.empty(_HEADER_WORDS, dtype=torch.int64)
        try:
            work = self._data_pg.recv([header], src, tags.sequence)
        except RuntimeError as err:
            self._fail(err, "recv_dispatch", src)
        return header, work

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        self._check_expert_parallel(AFDRole.FFN, "recv_dispatch")
        control = self._ep_control
        if control is None:
            raise AFDProtocolError("recv_dispatch before this step's recv_control")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        if not 0 <= layer_idx < self.num_layers:
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        if isinstance(stage_idx, bool) or not isinstance(stage_idx, int):
            raise AFDPayloadError("stage_idx", stage_idx, f"an int in 0..{control.num_stages - 1}")
        if not 0 <= stage_idx < control.num_stages:
            raise AFDPayloadError("stage_idx", stage_idx, f"an int in 0..{control.num_stages - 1}")
        served = self._served
        posted = []
        for src in served:
            ahead = self._headers_ahead.pop((stage_idx, src), None)
            posted.append(ahead if ahead is not None else self._post_header(stage_idx, src))
        self._wait(
            [(work, src) for (_, work), src in zip(posted, served, strict=True)], "recv_dispatch"
        )
        counts: list[int] = []
        for col, ((header, _), src) in enumerate(zip(posted, served, strict=True)):
            layer, stage, n = (int(v) for v in header.tolist())
            limit = control.stage_token_counts[stage_idx][col]
            if (layer, stage) != (layer_idx, stage_idx) or not 0 <= n <= limit:
                self._fail(
                    AFDProtocolError(
                        f"dispatch header from world rank {src} is (layer, stage, tokens)="
                        f"{(layer, stage, n)}; this FFN rank expected layer {layer_idx}, stage "
                        f"{stage_idx} and at most {limit} tokens"
                    ),
                    "recv_dispatch",
                    src,
                )
            counts.append(n)
        # The next header of every (stage, peer) goes ahead now: fixed size, same order.
        for src in served:
            self._headers_ahead[stage_idx, src] = self._post_header(stage_idx, src)
        tags = self._stage_tags[stage_idx]
        specs = self.payload_spec.fields
        payloads: list[AFDPayload] = []
        works: list[tuple[Any, int]] = []
        src = served[0]
        try:
            for src, n in zip(served, counts, strict=True):
                tensors = [
                    torch.empty(spec.shape(n), dtype=spec.dtype, device=self.device)
                    for spec in specs
                ]
                if n:
                    for (_, tag), buf in zip(tags.fields, tensors, strict=True):
                        works.append((self._data_pg.recv([buf], src, tag), src))
                payloads.append(
                    AFDPayload(**{spec.name: t for spec, t in zip(specs, tensors, strict=True)})
                )
        except RuntimeError as err:
            works.clear()
            self._fail(err, "recv_dispatch", src)
        self._wait(works, "recv_dispatch")
        metadata = AFDTransferMetadata(layer_idx, stage_idx, tuple(counts))
        self._last_received = metadata
        return metadata, payloads
