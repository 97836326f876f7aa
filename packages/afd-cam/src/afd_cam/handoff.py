"""The DBO receive handoff: when a dispatched stage's FFN result is received.

A CAM dispatch (send) returns immediately; its combine-receive must wait until the device has had
something else to do, or the round trip is not hidden. Two shapes of that handoff exist:

* **Single batch** (:class:`ReceiveHandoff`): the receive of layer ``i`` is handed to the start of
  layer ``i + 1`` (after the DBO yield), so the next layer's residual add consumes it.
* **Two (or more) stages** (:func:`run_staged_pipeline`): the receive of one stage is issued right
  after the *other* stage's attention, so every receive overlaps a different stage's compute.

Model-specific work (attention, gate, routing, shared experts, merge order) stays in the adapter's
callbacks; this module only fixes the order and checks that no receive is lost or duplicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from afd_core.forward_context import dbo_yield

from afd_cam.errors import AFDCamError, AFDCamHandoffError

T = TypeVar("T")
P = TypeVar("P")
H = TypeVar("H")


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


@dataclass(frozen=True)
class PipelineStep:
    """One event of a staged pipeline: ``kind`` is "attend", "dispatch" or "receive"."""

    kind: str
    layer: int
    stage: int


def pipeline_order(num_layers: int, num_stages: int = 2) -> tuple[PipelineStep, ...]:
    """The event order :func:`run_staged_pipeline` follows, without running anything.

    With ``k = layer * num_stages + stage``: ``attend(k)`` (preceded by ``receive(k - 1)`` when
    ``num_stages == 1``), then ``receive(k - 1)``, then ``dispatch(k)``; a final receive closes the
    last dispatch. For two stages and layers ``L0, L1`` this is
    ``A(L0,s0) D(L0,s0) A(L0,s1) R(L0,s0) D(L0,s1) A(L1,s0) R(L0,s1) D(L1,s0) A(L1,s1) R(L1,s0)
    D(L1,s1) R(L1,s1)``.
    """
    _check_count("num_layers", num_layers)
    _check_count("num_stages", num_stages)
    steps: list[PipelineStep] = []
    pending: tuple[int, int] | None = None
    for k in range(num_layers * num_stages):
        layer, stage = divmod(k, num_stages)
        if pending is not None and pending[1] == stage:
            steps.append(PipelineStep("receive", *pending))
            pending = None
        steps.append(PipelineStep("attend", layer, stage))
        if pending is not None:
            steps.append(PipelineStep("receive", *pending))
        steps.append(PipelineStep("dispatch", layer, stage))
        pending = (layer, stage)
    assert pending is not None
    steps.append(PipelineStep("receive", *pending))
    return tuple(steps)


def run_staged_pipeline(
    num_layers: int,
    attend: Callable[[int, int, T | None], P],
    dispatch: Callable[[int, int, P], H],
    receive: Callable[[int, int, H], T],
    *,
    num_stages: int = 2,
) -> list[T]:
    """Run ``num_layers`` remote-FFN layers over ``num_stages`` stages in :func:`pipeline_order`.

    Args:
        attend: ``(layer, stage, previous)`` -> dispatch payload; ``previous`` is the stage's
            received output of the previous layer (None at layer 0).
        dispatch: ``(layer, stage, payload)`` -> transfer handle (the send).
        receive: ``(layer, stage, handle)`` -> the stage's restored FFN output (combine-receive
            plus layout restoration).

    Returns:
        Each stage's output of the last layer, indexed by stage.

    Invariants: every dispatch is received exactly once, in dispatch order; ``attend`` for
    ``(layer, stage)`` runs only after ``receive`` for ``(layer - 1, stage)``.
    """
    outputs: list[T | None] = [None] * num_stages
    handles: dict[tuple[int, int], H] = {}
    payloads: dict[tuple[int, int], P] = {}
    for step in pipeline_order(num_layers, num_stages):
        key = (step.layer, step.stage)
        if step.kind == "attend":
            payloads[key] = attend(step.layer, step.stage, outputs[step.stage])
        elif step.kind == "dispatch":
            handles[key] = dispatch(step.layer, step.stage, payloads.pop(key))
        else:
            outputs[step.stage] = receive(step.layer, step.stage, handles.pop(key))
    final: list[T] = []
    for out in outputs:
        assert out is not None
        final.append(out)
    return final


def _check_stage(stage_idx: object) -> None:
    if isinstance(stage_idx, bool) or not isinstance(stage_idx, int) or stage_idx < 0:
        raise AFDCamError("stage_idx", stage_idx, "an int >= 0")


def _check_count(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AFDCamError(field, value, "an int >= 1")
