"""The Attention side of the P2P connector: control messages out, payloads out, replies in.

Per step, :meth:`_AttentionSide.send_control` sends this rank's per-stage token counts without
waiting for them (the step's first reply implies the FFN rank has them; the shutdown message is
waited for), after refusing a count that differs from a receive the FFN rank still has posted
(the window rule mirrored, see :mod:`afd_core.connector.p2p.recv_ahead`). Per layer and stage,
:meth:`_AttentionSide.send_attn_output` posts the reply's receive first (gloo; at most one per
stage ahead, the rest queued in send order) and then a send per payload field, and returns;
:meth:`_AttentionSide.recv_ffn_output` only waits.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from afd_core.config import AFDRole
from afd_core.connector.base import AFDTransferHandle
from afd_core.connector.p2p.lifecycle import _P2PLifecycle
from afd_core.connector.p2p.recv_ahead import _PendingRecv
from afd_core.connector.p2p.wire import _CONTROL_TAG, CONTROL_WORDS, _pack_control, _StageTags
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
        if announced is not None and not self._expert_parallel:
            self._check_peer_posted(announced)
        self._finish_control_send()
        _pack_control(self._control_bytes, words)
        wire = self._control_wire
        if self._expert_parallel:  # the request/reply path stays closed (see send_attn_output)
            self._ep_announced = announced
        else:
            self._announced = announced
        works: list[tuple[Any, int]] = []
        dst = self._ffn_world_rank
        try:
            for dst in self._ffn_world_ranks:
                works.append((self._ctl_pg.send([wire], dst, _CONTROL_TAG), dst))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "send_control", dst)
        # A step's control message completes in the background (the step's first reply cannot
        # arrive before the FFN rank got it, so recv_ffn_output finishes it at no cost); the
        # shutdown message is waited for here, since close() usually follows at once. Only
        # ``self`` holds the works: after a failure nothing else may keep the groups alive.
        self._control_send = (works, wire)
        if message.shutdown:
            self._finish_control_send()

    def _check_peer_posted(self, announced: tuple[int, ...]) -> None:
        """Refuse a step whose count differs from a receive the FFN rank still has posted.

        Mirrors the FFN side's receive-ahead rule (see :mod:`afd_core.connector.p2p.recv_ahead` and
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

    # -- data plane ------------------------------------------------------------------------

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
            if self._expert_parallel:
                raise AFDConnectorError(
                    f"send_attn_output serves one FFN rank; with num_ffn_ranks="
                    f"{self.topology.num_ffn_ranks} use send_dispatch / recv_combine"
                )
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
