"""The Attention side of the P2P connector: control messages out, dispatches out, replies in.

Per step, :meth:`_AttentionSide.send_control` sends this rank's per-stage token counts to each
of its FFN ranks without waiting for them (the step's first reply implies the FFN rank has them;
the shutdown message is waited for), after refusing a count that differs from a receive an FFN
rank still has posted (the window rule mirrored, see :mod:`afd_core.connector.p2p.recv_ahead`).
Per layer and stage, :meth:`_AttentionSide.send_dispatch` sends each FFN rank its rows: the
reply's receive first (gloo; at most one per stage and FFN rank ahead, the rest queued in send
order), then the header when the transfer has one (F > 1 or ``check_sequence``), then a send per
payload field; it returns at once. :meth:`_AttentionSide.recv_combine` only waits.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from afd_core.config import AFDRole
from afd_core.connector.base import AFDTransferHandle, check_transfer_counts
from afd_core.connector.p2p.lifecycle import _P2PLifecycle
from afd_core.connector.p2p.recv_ahead import _PendingRecv
from afd_core.connector.p2p.wire import (
    _CONTROL_TAG,
    CONTROL_WORDS,
    _header,
    _pack_control,
    _StageTags,
)
from afd_core.errors import AFDConnectorError, AFDPayloadError, AFDProtocolError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDTransferMetadata


class _AttentionSide(_P2PLifecycle):
    """The Attention role's operations of :class:`~afd_core.connector.p2p.P2PConnector`."""

    # -- control plane ---------------------------------------------------------------------

    def send_control(self, message: AFDControlMessage) -> None:
        """Send this rank's per-stage counts; ``message`` describes this rank (width 1) or all
        Attention ranks (width ``A``, this rank's column is taken)."""
        self._check_ready(AFDRole.ATTENTION, "send_control")
        if not isinstance(message, AFDControlMessage):
            raise AFDPayloadError("message", type(message).__name__, "an AFDControlMessage")
        width = message.width
        peers = self.topology.num_attention_peers
        if message.num_stages and width not in (1, peers):
            raise AFDPayloadError(
                "stage_token_counts",
                message.stage_token_counts,
                f"1 or {peers} entries per stage (one per Attention peer)",
            )
        if message.num_stages and width != 1:
            message = message.select([self.role_rank])
        words = message.words()
        if len(words) > CONTROL_WORDS:
            raise AFDPayloadError(
                "stage_token_counts", message.num_stages, f"at most {CONTROL_WORDS - 5} stages"
            )
        announced = None if message.shutdown else tuple(s[0] for s in message.stage_token_counts)
        if announced is not None and self._counts_fixed:
            self._check_peer_posted(announced)
        self._finish_control_send()
        _pack_control(self._control_bytes, words)
        wire = self._control_wire
        self._announced = announced
        self._step_last = self.step_last_layer(message.is_draft)
        works: list[tuple[Any, int]] = []
        dst = self._ffn_world_rank
        try:
            for dst in self._ffn_world_ranks:
                works.append((self._ctl_pg.send([wire], dst, _CONTROL_TAG), dst))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "send_control", dst)
        # A step's control message completes in the background (the step's first reply cannot
        # arrive before the FFN rank got it, so recv_combine finishes it at no cost); the
        # shutdown message is waited for here, since close() usually follows at once. Only
        # ``self`` holds the works: after a failure nothing else may keep the groups alive.
        self._control_send = (works, wire)
        if message.shutdown:
            self._finish_control_send()

    def _check_peer_posted(self, announced: tuple[int, ...]) -> None:
        """Refuse a step whose count differs from a receive the FFN rank still has posted.

        Mirrors the FFN side's receive-ahead rule (see :mod:`afd_core.connector.p2p.recv_ahead` and
        :meth:`_window`): the FFN rank has receives posted for stage ``s`` when the previous
        step's last transfer of ``s`` carried tokens, was not of the step's last layer
        (:meth:`step_last_layer`) and had a window of at least one receive. Sending another
        count there would make gloo abort the FFN process, so this raises (and tears down)
        before anything is sent.
        """
        for stage, n_posted in self._peer_posted.items():
            n = announced[stage] if stage < len(announced) else None
            if n != n_posted:
                self._fail(
                    AFDProtocolError(
                        f"stage {stage}: the FFN rank still has a receive posted for {n_posted} "
                        f"tokens (the previous step ended before layer {self._step_last}), "
                        f"but this step announces {n}; end every step at the last layer or set "
                        "connector_extra_config.recv_ahead=false"
                    ),
                    "send_control",
                    None,
                )
        for stage, n in enumerate(announced):
            if n and self._window(n):
                self._peer_posted.setdefault(stage, n)

    # -- data plane ------------------------------------------------------------------------

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        announced = self._announced
        ranks = self._ffn_world_ranks
        if type(payloads) is not list:
            payloads = list(payloads)
        if not (  # the hot path (one FFN rank): the count this step's control message announced
            self._counts_fixed
            and self._initialized
            and not self._is_ffn
            and type(metadata) is AFDTransferMetadata
            and announced is not None
            and metadata.layer_idx < self.num_layers
            and metadata.stage_idx < len(announced)
            and metadata.num_tokens == (announced[metadata.stage_idx],)
            and len(payloads) == 1
        ):
            self._check_dispatch(payloads, metadata, announced)
        counts = metadata.num_tokens
        spec = self.payload_spec
        device_type = self._device_type
        for payload, n in zip(payloads, counts):  # noqa: B905 (lengths checked)
            spec.validate_payload(payload, n, device_type)
        layer = metadata.layer_idx
        stage = metadata.stage_idx
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        pg = self._data_pg
        headers = self._headers
        device = self.device
        states: list[_PendingRecv] = []
        dst = ranks[0]
        try:
            for dst, payload, n in zip(ranks, payloads, counts):  # noqa: B905
                state = _PendingRecv(dst, stage, n)
                states.append(state)
                works = state.send_works
                if n:
                    # The reply's receive first (when no earlier reply of this stage and FFN rank
                    # is still awaited): a gloo receive notifies the sender, so the FFN rank can
                    # write its reply as soon as it has it while this rank overlaps other work
                    # (recv_combine only waits). Posted before the data, the notice is out of
                    # the way of the sends (after them, it stalls them now and then on a busy
                    # host).
                    key = (stage, dst)
                    queue = self._reply_queue.get(key)
                    if queue is None:
                        queue = self._reply_queue[key] = collections.deque()
                    queue.append(state)
                    if len(queue) == 1 and self._post_early:
                        self._post_reply(state, tags)
                if headers:
                    works.append(pg.send([_header(layer, stage, n, device)], dst, tags.sequence))
                if n:
                    for name, tag in tags.fields:
                        tensor = getattr(payload, name).contiguous()
                        works.append(pg.send([tensor], dst, tag))
        except RuntimeError as err:
            for state in states:
                state.send_works.clear()
                state.recv_work = None
            self._fail(err, "send_dispatch", dst)
        if self._counts_fixed:
            n = counts[0]
            if n and self._window(n):
                # Mirror of the FFN side: this transfer used a posted receive; the FFN rank keeps
                # receives posted while the step has layers left.
                if layer < self._step_last:
                    self._peer_posted[stage] = n
                else:
                    self._peer_posted.pop(stage, None)
        handle = AFDTransferHandle(metadata, states, self._id)
        self._handles.add(handle)
        return handle

    def _check_dispatch(
        self,
        payloads: list[AFDPayload],
        metadata: AFDTransferMetadata,
        announced: tuple[int, ...] | None,
    ) -> None:
        """The full checks of :meth:`send_dispatch` (they name what is wrong)."""
        self._check_ready(AFDRole.ATTENTION, "send_dispatch")
        width = len(self._ffn_world_ranks)
        self._check_metadata(metadata, width)
        if announced is None:
            raise AFDProtocolError("send_dispatch before this step's send_control")
        stage = metadata.stage_idx
        if stage >= len(announced):
            raise AFDPayloadError("stage_idx", stage, f"an int in 0..{len(announced) - 1}")
        if len(payloads) != width:
            raise AFDPayloadError(
                "payloads", len(payloads), f"{width} payload(s) (one per FFN rank)"
            )
        counts = metadata.num_tokens
        check_transfer_counts(counts, (announced[stage],) * len(counts), self._counts_fixed)

    def _post_reply(self, state: _PendingRecv, tags: _StageTags) -> None:
        """Post the receive of ``state``'s reply into a buffer from the pool.

        At most one reply receive per stage and FFN rank is posted ahead of its
        ``recv_combine``: in a stream (several transfers of a stage sent before any reply is
        received) the others wait in their queue, so the FFN rank is not sent a receive notice
        per transfer while it is busy receiving. ``_reply_queue[stage, dst]`` holds the
        transfers in send order, every posted one before every unposted one.
        """
        buffer = self._buffers.get(
            tags.reply_keys[state.peer], (state.num_tokens, self._hidden), self._out_dtype
        )
        state.buffer = buffer
        state.recv_work = self._data_pg.recv([buffer], state.peer, tags.reply)
        state.posted = True

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        if not self._initialized or self._is_ffn:
            self._check_ready(AFDRole.ATTENTION, "recv_combine")
        if not isinstance(handle, AFDTransferHandle) or handle.connector_id != self._id:
            raise AFDConnectorError("recv_combine needs a handle from this connector")
        states = handle.state
        if type(states) is not list:
            raise AFDConnectorError("AFD transfer handle was invalidated by close()")
        handle.consume()
        handle.state = None
        works: list[tuple[Any, int]] = []
        tags = self._stage_tags[handle.metadata.stage_idx]
        for state in states:
            peer = state.peer
            for work in state.send_works:
                works.append((work, peer))
            state.send_works = []
            if state.num_tokens and not state.posted:
                # Replies of a (stage, FFN rank) arrive in order and gloo matches receives in
                # the order they were posted: post every earlier queued receive first.
                try:
                    for queued in self._reply_queue[state.stage, peer]:
                        if not queued.posted:
                            self._post_reply(queued, tags)
                        if queued is state:
                            break
                except RuntimeError as err:
                    self._fail(err, "recv_combine", peer)
            if state.recv_work is not None:
                works.append((state.recv_work, peer))
                state.recv_work = None
        self._wait(works, "recv_combine")
        out: list[torch.Tensor] = []
        empty: torch.Tensor | None = None  # one for every zero-row reply of this call
        for state in states:
            if state.num_tokens:
                queue = self._reply_queue[state.stage, state.peer]
                if queue[0] is state:
                    queue.popleft()
                else:  # received out of order
                    queue.remove(state)
                if queue and not queue[0].posted and self._post_early:
                    # A stream of transfers (several sent before any reply): keep the next
                    # reply's receive posted ahead, one at a time.
                    try:
                        self._post_reply(queue[0], tags)
                    except RuntimeError as err:
                        self._fail(err, "recv_combine", state.peer)
            result = state.buffer
            state.buffer = None
            if result is None:  # zero tokens: nothing was on the wire
                if empty is None:
                    empty = torch.empty(
                        (0, self._hidden), dtype=self._out_dtype, device=self.device
                    )
                result = empty
            out.append(result)
        if self._control_send is not None:  # complete: the FFN ranks replied, so they have it
            self._finish_control_send()
        return out
