"""Receives posted ahead: the window rule both sides compute, and the posted-receive records.

On gloo a receive posted before its send lets the sender write at once; posted late, the sender
waits for the receive's notice. The FFN side keeps a *window* of receives posted per stage and
served Attention rank (:func:`_recv_window`); the Attention side computes the same window to
know which receives the FFN rank still has posted (a step may not change their size). The
Attention side's own reply receives are tracked by :class:`_PendingRecv`, the FFN side's posted
receives by :class:`_PostedRecv`.
"""

from __future__ import annotations

from typing import Any

import torch

from afd_core.metadata import AFDPayload

__all__ = ["RECV_AHEAD_BYTES"]

RECV_AHEAD_BYTES = 2 << 20
"""Default ``recv_ahead_bytes``: what the FFN rank keeps posted ahead per stage and peer (the
measurements behind 2 MiB are in the afd-core README, P2P connector)."""


def _recv_window(
    n: int, enabled: bool, budget_bytes: int, token_bytes: int, at_most_one: bool
) -> int:
    """Receives of one stage and served Attention rank kept posted ahead for transfers of ``n``
    tokens (``token_bytes`` each), before the cap by the layers left in the step.

    As many as fit in ``budget_bytes`` (``recv_ahead_bytes``), at most one when ``at_most_one``
    (``reuse_buffers``: three kept buffers), none for zero tokens or when not ``enabled``
    (``recv_ahead`` off, or a backend other than gloo). Part of the wire protocol: the Attention
    side computes the same to mirror the FFN side.
    """
    if not (n and enabled):
        return 0
    window = budget_bytes // (n * token_bytes)
    return min(window, 1) if at_most_one else window


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

    __slots__ = ("num_tokens", "payload", "tensors", "works")

    def __init__(self, num_tokens: int, tensors: list[torch.Tensor], payload: AFDPayload) -> None:
        self.num_tokens = num_tokens
        self.tensors = tensors  # one per payload field, in wire order
        self.payload = payload  # built when prepared: off the receive's path
        self.works: list[Any] = []
