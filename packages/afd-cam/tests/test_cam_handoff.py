"""The DBO receive handoff: each receive runs once, misuse errors, DBO yields."""

from __future__ import annotations

import pytest
import torch
from afd_cam import AFDCamError, AFDCamHandoffError, ReceiveHandoff
from afd_core.forward_context import install_stage_hooks


def test_receive_handoff_runs_each_receive_once() -> None:
    handoff: ReceiveHandoff[torch.Tensor] = ReceiveHandoff()
    calls: list[int] = []

    def make(stage: int) -> torch.Tensor:
        calls.append(stage)
        return torch.tensor([stage])

    assert handoff.take_if_pending(0) is None
    handoff.hand_off(1, lambda: make(1))
    handoff.hand_off(0, lambda: make(0))
    assert handoff.pending_stages == (1, 0)
    assert calls == []  # nothing received until taken
    assert torch.equal(handoff.take(0), torch.tensor([0]))
    assert handoff.has_pending(1) and not handoff.has_pending(0)
    out = handoff.take_if_pending(1)
    assert out is not None and torch.equal(out, torch.tensor([1]))
    assert calls == [0, 1]
    assert handoff.pending_stages == ()


def test_receive_handoff_misuse() -> None:
    handoff: ReceiveHandoff[int] = ReceiveHandoff()
    with pytest.raises(
        AFDCamHandoffError, match="Async CAM stage 0 receive has no pending"
    ) as info:
        handoff.take(0)
    assert info.value.stage_idx == 0
    handoff.hand_off(1, lambda: 1)
    with pytest.raises(AFDCamHandoffError, match="stage 1 already has a pending receive"):
        handoff.hand_off(1, lambda: 2)
    assert handoff.take(1) == 1  # the first receive was kept
    with pytest.raises(AFDCamError) as err:
        handoff.hand_off(-1, lambda: 0)
    assert err.value.field == "stage_idx"


class _RecordingHooks:
    """The runtime's stage hooks as a recording fake: every yield is logged."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def current_stage(self) -> int | None:
        return 0

    def yield_stage(self) -> None:
        self.events.append("yield")

    def lookup_metadata(self) -> None:
        return None


def test_hand_off_yields_to_dbo_after_recording() -> None:
    events: list[str] = []
    previous = install_stage_hooks(_RecordingHooks(events))
    try:
        handoff: ReceiveHandoff[str] = ReceiveHandoff()
        handoff.hand_off(0, lambda: "r0", yield_to_dbo=True)
        assert events == ["yield"]
        assert handoff.pending_stages == (0,)
        handoff.hand_off(1, lambda: "r1")
        assert events == ["yield"]  # no yield unless asked
        assert handoff.take(0) == "r0"
    finally:
        install_stage_hooks(previous)


def test_discard_drops_a_pending_receive_without_running_it() -> None:
    handoff: ReceiveHandoff[int] = ReceiveHandoff()
    ran: list[int] = []
    handoff.hand_off(0, lambda: ran.append(0) or 0)
    assert handoff.discard(0) is True
    assert handoff.discard(0) is False
    assert ran == [] and handoff.pending_stages == ()
    handoff.hand_off(0, lambda: 5)  # the stage can hand off again
    assert handoff.take(0) == 5
    with pytest.raises(AFDCamError) as err:
        handoff.discard(-2)
    assert err.value.field == "stage_idx"


def test_hand_offs_of_two_overlapped_stages_interleave() -> None:
    """Under a two-stage overlap (afd-core's test stand-in for the runtime's executor) each stage
    hands its receive off, yields (the other stage runs) and takes it back: one handoff serves
    both stages, none is lost."""
    from afd_core.testing import run_stages_in_turns

    handoff: ReceiveHandoff[str] = ReceiveHandoff()
    order: list[str] = []

    def stage(idx: int) -> object:
        def run() -> list[str]:
            got = []
            for layer in range(2):
                order.append(f"send{layer}.{idx}")
                handoff.hand_off(idx, lambda layer=layer: f"out{layer}.{idx}", yield_to_dbo=True)
                got.append(handoff.take(idx))
            return got

        return run

    results = run_stages_in_turns([stage(0), stage(1)], timeout_s=10)
    assert results == [["out0.0", "out1.0"], ["out0.1", "out1.1"]]
    assert order == ["send0.0", "send0.1", "send1.0", "send1.1"]
    assert handoff.pending_stages == ()
