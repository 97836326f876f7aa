"""The P2P wire protocol: its version, the control-message layout and codec, and the tags.

Control messages travel on the control group as :data:`CONTROL_WORDS` native ``int64`` words
(the :meth:`~afd_core.metadata.AFDControlMessage.words` of one Attention rank's message,
zero-padded) under one tag. Data travels on the data group under a tag per stage, payload field
and direction (:func:`_data_tag`); a stage's transfers on one (peer, tag) are matched in order.
"""

from __future__ import annotations

import struct

import torch

from afd_core.errors import AFDProtocolError
from afd_core.metadata import AFDControlMessage

__all__ = ["CONTROL_WORDS", "HEADER_WORDS", "PROTOCOL_VERSION"]

PROTOCOL_VERSION = 8
"""Version of the P2P wire protocol (handshake, tags, message layout, which receives are posted
ahead: the Attention side mirrors the FFN side's rule).

2: the ``check_sequence`` header has a tag per stage (receives may be posted ahead).
3: the FFN side's receive-ahead window (``recv_ahead_bytes``); nothing ahead off gloo.
4: expert parallelism (``num_ffn_ranks > 1``): every Attention rank talks to every FFN rank;
   per layer and stage a ``(layer, stage, tokens)`` header on the sequence tag, then the rows.
5: the handshake carries ``role`` and ``role_agreement``; init runs the ready hook before the
   ``ready`` barrier.
6: initialisation rounds opened by world rank 0 (``afd/round``; a rank claimed in a stale round
   waits for the next); FFN ranks beat a heartbeat (``alive/<rank>``) the Attention ranks
   watch; the handshake carries ``model_identity`` (compared across both roles).
7: one data plane for every F: the ``(layer, stage, tokens)`` header precedes a transfer's rows
   when its count is not fixed by the control message (F > 1) or with ``check_sequence``, and is
   received ahead on the FFN side (fixed size) in both cases.
8: tensor-parallel Attention: every TP worker is a peer (``A x T`` Attention world ranks); the
   handshake's topology is ``[A, F, T]`` and the config agreement carries ``attention_tp_size``.
   Speculative draft layers: the control flag ``is_draft`` (a step of only the last
   ``num_draft_layers`` layer indices; other steps end before them), ``num_draft_layers`` in the
   handshake."""

HEADER_WORDS = 3
"""Length (int64 words) of a transfer's header ``(layer, stage, tokens)``."""

CONTROL_WORDS = 64
"""Fixed length (int64 words) of a control message on the wire (room for 59 stages)."""

_CONTROL_TAG = 1
_CONTROL_STRUCT = struct.Struct(f"={CONTROL_WORDS}q")  # native int64, as torch.int64 reads it
_SEQ_FIELD = 7  # the sequence header takes the last of the 8 per-stage field slots
_DATA_TAG_BASE = 64


def _pack_control(buffer: bytearray, words: list[int]) -> None:
    """Write a control message's ``words`` (at most :data:`CONTROL_WORDS`) into the wire
    ``buffer``, zero-padded to its fixed length."""
    _CONTROL_STRUCT.pack_into(buffer, 0, *words, *[0] * (CONTROL_WORDS - len(words)))


def _decode_control(buf: torch.Tensor) -> AFDControlMessage:
    """Decode one Attention rank's control message (width 1) from its received wire buffer.

    Raises:
        AFDProtocolError: a length that does not fit the wire, a malformed message, or a width
            other than 1.
    """
    words = buf.tolist()  # one conversion; indexing the tensor costs µs per element
    header = words[3] * words[4] + 5
    if not 5 <= header <= CONTROL_WORDS:
        raise AFDProtocolError(f"control message of {header} words")
    msg = AFDControlMessage.decode_words(words[:header])
    if msg.num_stages and msg.width != 1:
        raise AFDProtocolError(f"control message width {msg.width}, expected 1")
    return msg


def _header(layer_idx: int, stage_idx: int, num_tokens: int, device: torch.device) -> torch.Tensor:
    """A transfer's header on the wire: ``(layer, stage, tokens)`` as int64 on the data group's
    device."""
    return torch.tensor([layer_idx, stage_idx, num_tokens], dtype=torch.int64, device=device)


def _header_mismatch(
    header: list[int], layer_idx: int, stage_idx: int, limit: int, exact: bool
) -> str | None:
    """What is wrong with a received header's ``(layer, stage, tokens)`` (``None``: it is the
    expected one): its (layer, stage) must be the one asked for and its count ``limit``
    (``exact``, the count is fixed by the control message) or at most ``limit``."""
    layer, stage, n = header
    if (layer, stage) == (layer_idx, stage_idx) and (n == limit if exact else 0 <= n <= limit):
        return None
    want = f"{limit}" if exact else f"at most {limit}"
    return (
        f"header (layer, stage, tokens)={(layer, stage, n)}; expected layer {layer_idx}, stage "
        f"{stage_idx} and {want} tokens"
    )


def _data_tag(stage_idx: int, field_idx: int, to_ffn: bool) -> int:
    return _DATA_TAG_BASE + (stage_idx * 8 + field_idx) * 2 + (0 if to_ffn else 1)


class _StageTags:
    """One stage's wire tags and receive-buffer keys (computed once per stage: hot path)."""

    __slots__ = ("fields", "recv_keys", "reply", "reply_keys", "sequence")

    def __init__(
        self,
        stage: int,
        wire_fields: tuple[tuple[str, int], ...],
        served: tuple[int, ...],
        ffn_ranks: tuple[int, ...],
    ) -> None:
        self.fields = tuple((name, _data_tag(stage, idx, True)) for name, idx in wire_fields)
        self.reply = _data_tag(stage, 0, False)
        self.sequence = _data_tag(stage, _SEQ_FIELD, True)
        # Attention side: per FFN world rank, the buffer key of its reply.
        self.reply_keys = {dst: (-1, stage, dst) for dst in ffn_ranks}
        # FFN side: per served Attention world rank, the buffer key of each field.
        self.recv_keys = {src: tuple((stage, src, idx) for _, idx in wire_fields) for src in served}
