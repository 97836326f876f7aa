"""The FFN side of the P2P connector: control messages in, dispatches in, replies out.

:meth:`_FFNSide.recv_control` merges the served Attention ranks' messages, then posts the
step's first data receives (one FFN rank: the counts are the announced ones) and the next step's
control receive. :meth:`_FFNSide.recv_dispatch` takes each served rank's header first when
transfers carry one (F > 1: the count; ``check_sequence``: checked against the announced one),
then its rows. Receives are posted ahead on
gloo within the window of :mod:`afd_core.connector.p2p.recv_ahead`: request/reply (the service loop) keeps
one ahead, posted with the reply; a stream (several layers received before replying) gets the
whole window, now and at the next step's control message. Off gloo every receive is posted when
it is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from afd_core.config import AFDRole
from afd_core.connector.base import (
    check_transfer_counts,
    merge_control_messages,
    split_ffn_outputs,
)
from afd_core.connector.p2p.groups import _LONG_WAIT
from afd_core.connector.p2p.lifecycle import _P2PLifecycle
from afd_core.connector.p2p.recv_ahead import _PostedRecv
from afd_core.connector.p2p.wire import (
    _CONTROL_TAG,
    HEADER_WORDS,
    _decode_control,
    _header_mismatch,
)
from afd_core.errors import AFDConfigError, AFDPayloadError, AFDProtocolError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata


class _FFNSide(_P2PLifecycle):
    """The FFN role's operations of :class:`~afd_core.connector.p2p.P2PConnector`."""

    # -- control plane ---------------------------------------------------------------------

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
            try:
                msg = _decode_control(buf)
            except AFDProtocolError as err:
                self._fail(err, f"recv_control from world rank {src}", src)
            messages.append(msg)
        try:
            merged = merge_control_messages(messages, self._served)
        except AFDProtocolError as mismatch:
            self._fail(mismatch, "recv_control", None)
        self._control = None if merged.shutdown else merged
        last = self._step_last
        self._step_last = self.step_last_layer(merged.is_draft)
        if self._control is None:
            self._ahead_stages = frozenset()
        else:
            # The step's first data receives first (the Attention ranks' sends wait for their
            # notices; only when the counts are the announced ones), then the next step's
            # control receive, so its sender never waits for it.
            if self._counts_fixed:
                self._post_step_recvs(self._control, last)
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

    # -- data plane ------------------------------------------------------------------------

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        control = self._control
        if not (  # the hot path
            self._initialized
            and self._is_ffn
            and control is not None
            and type(layer_idx) is int
            and 0 <= layer_idx < self.num_layers
            and type(stage_idx) is int
            and 0 <= stage_idx < len(control.stage_token_counts)
        ):
            control = self._check_receive(layer_idx, stage_idx)
        limits = control.stage_token_counts[stage_idx]
        counts = self._recv_headers(layer_idx, stage_idx, limits) if self._headers else limits
        if self._counts_fixed:
            payloads = self._recv_posted(layer_idx, stage_idx, counts)
        else:
            payloads = self._recv_rows(stage_idx, counts)
        metadata = AFDTransferMetadata._of_counts(layer_idx, stage_idx, counts)
        self._last_received = metadata
        return metadata, payloads

    def _check_receive(self, layer_idx: object, stage_idx: object) -> AFDControlMessage:
        """The full checks of :meth:`recv_dispatch` (they name what is wrong); the step's
        control message."""
        self._check_ready(AFDRole.FFN, "recv_dispatch")
        control = self._control
        if control is None:
            raise AFDProtocolError("recv_dispatch before this step's recv_control")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        if not 0 <= layer_idx < self.num_layers:
            raise AFDPayloadError("layer_idx", layer_idx, f"an int in 0..{self.num_layers - 1}")
        last = control.num_stages - 1
        if isinstance(stage_idx, bool) or not isinstance(stage_idx, int):
            raise AFDPayloadError("stage_idx", stage_idx, f"an int in 0..{last}")
        if not 0 <= stage_idx <= last:
            raise AFDPayloadError("stage_idx", stage_idx, f"an int in 0..{last}")
        return control

    def _post_header(self, stage: int, src: int) -> tuple[torch.Tensor, Any]:
        tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
        header = torch.empty(HEADER_WORDS, dtype=torch.int64, device=self.device)
        try:
            work = self._data_pg.recv([header], src, tags.sequence)
        except RuntimeError as err:
            self._fail(err, "recv_dispatch", src)
        return header, work

    def _recv_headers(
        self, layer_idx: int, stage_idx: int, limits: tuple[int, ...]
    ) -> tuple[int, ...]:
        """Wait for the ``(layer, stage, tokens)`` header of every served rank and return the
        counts. Headers have a fixed size and travel in order per (stage, peer), so on gloo the
        next one is posted ahead (now, for the next call); nccl/hccl post every receive when it
        is asked for (see ``_post_early``)."""
        served = self._served
        posted = []
        for src in served:
            ahead = self._headers_ahead.pop((stage_idx, src), None)
            posted.append(ahead if ahead is not None else self._post_header(stage_idx, src))
        self._wait(
            [(work, src) for (_, work), src in zip(posted, served, strict=True)], "recv_dispatch"
        )
        if self._post_early:
            for src in served:
                self._headers_ahead[stage_idx, src] = self._post_header(stage_idx, src)
        exact = self._counts_fixed
        counts: list[int] = []
        for (header, _), src, limit in zip(posted, served, limits, strict=True):
            values = header.tolist()  # one conversion: (layer, stage, tokens)
            wrong = _header_mismatch(values, layer_idx, stage_idx, limit, exact)
            if wrong is not None:
                self._fail(AFDProtocolError(f"world rank {src} sent {wrong}"), "recv_dispatch", src)
            counts.append(values[2])
        return tuple(counts)

    def _recv_rows(self, stage: int, counts: tuple[int, ...]) -> list[AFDPayload]:
        """The rows of a transfer whose counts came in its headers, posted now."""
        served = self._served
        recvs = [self._prepare_recv(stage, src, n) for src, n in zip(served, counts, strict=True)]
        works: list[tuple[Any, int]] = []
        for src, posted in zip(served, recvs, strict=True):
            self._start_recv(posted, stage, src)
            for work in posted.works:
                works.append((work, src))
            posted.works = []
        self._wait(works, "recv_dispatch")
        return [posted.payload for posted in recvs]

    def _post_recv(self, stage: int, src: int, n: int) -> _PostedRecv:
        """Post the receives of ``stage``'s next transfer (``n`` tokens) from world rank ``src``.

        The common case (hidden states only) posts before it builds the
        payload objects: on a receive posted when asked for, everything before the posting
        delays the sender (it waits for the receive's notice), and on a busy host that code
        runs with cold caches right after this thread woke up."""
        if n and self._hidden_only:
            tags = self._stage_tags.get(stage) or self._make_stage_tags(stage)
            buf = self._buffers.get(tags.recv_keys[src][0], (n, self._hidden), self._out_dtype)
            try:
                work = self._data_pg.recv([buf], src, tags.fields[0][1])
            except RuntimeError as err:
                self._fail(err, "recv_dispatch", src)
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
            if posted.num_tokens:
                for (_, tag), buf in zip(tags.fields, posted.tensors):  # noqa: B905
                    works.append(pg.recv([buf], src, tag))
        except RuntimeError as err:
            works.clear()
            self._fail(err, "recv_dispatch", src)

    def _post_ahead(self, stage: int, counts: Sequence[int], left: int, full: bool) -> None:
        """Top ``stage``'s posted receives up to their window (``full``: a stream) or one
        (request/reply), at most ``left`` (the layers left in the step)."""
        for src, n in zip(self._served, counts, strict=True):
            want = min(self._window(n), left if full else min(left, 1))
            if want:
                queue = self._posted[stage, src]
                while len(queue) < want:
                    queue.append(self._post_recv(stage, src, n))

    def _post_step_recvs(
        self, control: AFDControlMessage, previous_last: int | None = None
    ) -> None:
        """New step: keep receives left posted when their count holds, post every first one
        (``previous_last``: the previous step's last layer index, for the error text)."""
        if previous_last is None:
            previous_last = self.step_last_layer(False)
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
                        f"{previous_last}), but the new step announces {n}; end every "
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
        # Layer indices the step spans: a bound on the receives worth posting.
        draft = self.num_draft_layers
        span = draft if control.is_draft else self.num_layers - draft
        for stage in self._ahead_stages:
            counts = control.stage_token_counts[stage]
            self._post_ahead(stage, counts, span, stage in self._streaming)

    def _recv_posted(self, layer_idx: int, stage: int, counts: tuple[int, ...]) -> list[AFDPayload]:
        """The rows of a transfer whose counts the control message fixed (one FFN rank), from
        the receives posted ahead (or posted now), keeping the stage's window topped up."""
        posted_map = self._posted
        recvs: list[_PostedRecv] = []
        works: list[tuple[Any, int]] = []
        for src, n in zip(self._served, counts):  # noqa: B905
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
        left = self._step_last - layer_idx
        if left and stage in self._ahead_stages:
            self._schedule_ahead(stage, counts, left)
        self._unreplied.add(stage)
        self._wait(works, "recv_dispatch")
        return payloads

    def _schedule_ahead(self, stage: int, counts: tuple[int, ...], left: int) -> None:
        """Top ``stage``'s receives up, now or right with this transfer's reply (``left``:
        layers after this one).

        Request/reply (the service loop, where the previous transfer of the stage was replied
        to): one receive ahead, posted with the reply (just before it), so the receive notice
        reaches the Attention rank while it waits for that reply; posted earlier, it meets the
        Attention rank in the middle of its next send, which a busy host can stall. The
        Attention rank cannot send the next layer before it has the reply, so a deeper window
        would only cycle more buffers through the cache. A stream (the previous transfer not
        replied yet): the whole window, now, before waiting; a stage that streamed has its whole
        window posted at the next step's control message too.
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

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        if not (self._initialized and self._is_ffn):
            self._check_ready(AFDRole.FFN, "send_combine")
        if metadata is not self._last_received:  # that one was checked by recv_dispatch
            self._check_reply_metadata(metadata)
        spec = self._reply_spec
        counts = metadata.num_tokens
        parts = split_ffn_outputs(outputs, metadata, spec.width, len(self._served))
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
        if prepared:  # the receives prepared by recv_dispatch go just before this reply
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
            self._fail(err, "send_combine", None)
        self._wait(works, "send_combine")

    def _check_reply_metadata(self, metadata: AFDTransferMetadata) -> None:
        """A reply's metadata that is not the last one received: one count per served rank,
        each fitting this step's announced count of its rank (``check_transfer_counts``)."""
        self._check_metadata(metadata, len(self._served))
        control = self._control
        if control is None:
            return
        if metadata.stage_idx >= control.num_stages:
            raise AFDPayloadError(
                "stage_idx", metadata.stage_idx, f"an int in 0..{control.num_stages - 1}"
            )
        announced = control.stage_token_counts[metadata.stage_idx]
        check_transfer_counts(metadata.num_tokens, announced, self._counts_fixed)
