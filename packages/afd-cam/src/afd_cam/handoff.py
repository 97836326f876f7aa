"""The DBO receive handoff: when a dispatched stage's FFN result is received.

A CAM dispatch (send) returns immediately; its combine-receive must wait until the device has had
something else to do, or the round trip is not hidden. :class:`ReceiveHandoff` holds each stage's
pending receive from the dispatch to the consumer that takes it (in serving: afd-models'
``afd::remote_ffn*`` ops hand the receive off, yield to the other stage of afd-core's two-stage
overlap, and take it back). It only checks that no receive is lost or duplicated; model-specific
work (attention, gate, routing, shared experts, merge order) stays in the adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from afd_core.forward_context import dbo_yield

from afd_cam.errors import AFDCamError, AFDCamHandoffError

T = TypeVar("T")


class ReceiveHandoff(Generic[T]):
    """At most one pending receive per stage, handed from a dispatch to a later consumer.

    Invariants: :meth:`hand_off` on a stage that already has a pending receive raises (a second
    dispatch would lose the first result); :meth:`take` on a stage without one raises; a taken
    receive runs exactly once.
    """

    def __init__(self) -> None:
        self._pending: dict[int, Callable[[], T]] = {}

    def hand_off(
        self, stage_idx: int, receive: Callable[[], T], *, yield_to_dbo: bool = False
    ) -> None:
        """Record ``receive`` (a zero-argument callable) as ``stage_idx``'s pending receive.

        With ``yield_to_dbo``, then yield to vLLM's other DBO micro-batch
        (:func:`afd_core.forward_context.dbo_yield`, a no-op without DBO), so it computes while
        this stage's round trip is in flight.
        """
        _check_stage(stage_idx)
        if stage_idx in self._pending:
            raise AFDCamHandoffError(stage_idx, "already has a pending receive")
        self._pending[stage_idx] = receive
        if yield_to_dbo:
            dbo_yield()

    def has_pending(self, stage_idx: int) -> bool:
        """True when ``stage_idx`` has a receive waiting."""
        return stage_idx in self._pending

    @property
    def pending_stages(self) -> tuple[int, ...]:
        """Stages with a pending receive, in hand-off order."""
        return tuple(self._pending)

    def take(self, stage_idx: int) -> T:
        """Run and forget ``stage_idx``'s pending receive; return its result."""
        _check_stage(stage_idx)
        receive = self._pending.pop(stage_idx, None)
        if receive is None:
            raise AFDCamHandoffError(stage_idx, "receive has no pending dispatch")
        return receive()

    def discard(self, stage_idx: int) -> bool:
        """Forget ``stage_idx``'s pending receive without running it (its step failed before
        the receive); True when one was pending."""
        _check_stage(stage_idx)
        return self._pending.pop(stage_idx, None) is not None

    def take_if_pending(self, stage_idx: int) -> T | None:
        """:meth:`take` when a receive is pending, else None (the first layer of a batch)."""
        return self.take(stage_idx) if stage_idx in self._pending else None


def _check_stage(stage_idx: object) -> None:
    if isinstance(stage_idx, bool) or not isinstance(stage_idx, int) or stage_idx < 0:
        raise AFDCamError("stage_idx", stage_idx, "an int >= 0")
