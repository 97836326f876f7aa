"""The DBO receive handoff: pipeline order, data flow between layers, and misuse errors."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from afd_cam import (
    AFDCamError,
    AFDCamHandoffError,
    PipelineStep,
    ReceiveHandoff,
    pipeline_order,
    run_staged_pipeline,
)


def _short(steps: tuple[PipelineStep, ...]) -> list[str]:
    return [f"{s.kind[0].upper()}(L{s.layer},s{s.stage})" for s in steps]


def test_two_stage_order_matches_the_async_cam_pipeline() -> None:
    # A = attend, D = dispatch, R = receive: each receive follows the other stage's attention.
    assert _short(pipeline_order(3, 2)) == [
        "A(L0,s0)", "D(L0,s0)",
        "A(L0,s1)", "R(L0,s0)", "D(L0,s1)",
        "A(L1,s0)", "R(L0,s1)", "D(L1,s0)",
        "A(L1,s1)", "R(L1,s0)", "D(L1,s1)",
        "A(L2,s0)", "R(L1,s1)", "D(L2,s0)",
        "A(L2,s1)", "R(L2,s0)", "D(L2,s1)",
        "R(L2,s1)",
    ]  # fmt: skip


def test_single_stage_defers_each_receive_to_the_next_layer() -> None:
    assert _short(pipeline_order(3, 1)) == [
        "A(L0,s0)", "D(L0,s0)",
        "R(L0,s0)", "A(L1,s0)", "D(L1,s0)",
        "R(L1,s0)", "A(L2,s0)", "D(L2,s0)",
        "R(L2,s0)",
    ]  # fmt: skip


@pytest.mark.parametrize(("layers", "stages"), [(1, 1), (1, 2), (4, 2), (3, 3), (2, 4)])
def test_every_dispatch_received_once_after_and_before_next_attend(
    layers: int, stages: int
) -> None:
    steps = pipeline_order(layers, stages)
    seen: dict[tuple[str, int, int], int] = {}
    for pos, step in enumerate(steps):
        key = (step.kind, step.layer, step.stage)
        assert key not in seen
        seen[key] = pos
    for layer in range(layers):
        for stage in range(stages):
            a, d, r = (seen[(k, layer, stage)] for k in ("attend", "dispatch", "receive"))
            assert a < d < r
            if layer + 1 < layers:
                assert r < seen[("attend", layer + 1, stage)]
    assert len(steps) == 3 * layers * stages


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_run_staged_pipeline_threads_outputs_between_layers(stages: int) -> None:
    events: list[tuple[str, int, int]] = []
    inputs = [torch.full((2, 3), float(s + 1)) for s in range(stages)]

    def attend(layer: int, stage: int, previous: torch.Tensor | None) -> torch.Tensor:
        events.append(("attend", layer, stage))
        x = inputs[stage] if previous is None else previous
        return x + 1

    def dispatch(layer: int, stage: int, payload: torch.Tensor) -> tuple[int, torch.Tensor]:
        events.append(("dispatch", layer, stage))
        return layer, payload * 2

    def receive(layer: int, stage: int, handle: tuple[int, torch.Tensor]) -> torch.Tensor:
        events.append(("receive", layer, stage))
        assert handle[0] == layer
        return handle[1]

    outs = run_staged_pipeline(3, attend, dispatch, receive, num_stages=stages)
    assert [(s.kind, s.layer, s.stage) for s in pipeline_order(3, stages)] == events
    for stage, out in enumerate(outs):
        expected = inputs[stage]
        for _ in range(3):
            expected = (expected + 1) * 2
        assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("layers", "stages", "field"), [(0, 2, "num_layers"), (2, 0, "num_stages")]
)
def test_pipeline_rejects_counts(layers: int, stages: int, field: str) -> None:
    with pytest.raises(AFDCamError) as info:
        pipeline_order(layers, stages)
    assert info.value.field == field


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


class _FakeUbatching(types.ModuleType):
    """Stands in for ``vllm.v1.worker.ubatching`` (afd-core only reads it from sys.modules)."""

    def __init__(self, events: list[str]) -> None:
        super().__init__("vllm.v1.worker.ubatching")
        self.events = events

    def dbo_enabled(self) -> bool:
        return True

    def dbo_yield(self) -> None:
        self.events.append("yield")


def test_hand_off_yields_to_dbo_after_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.ubatching", _FakeUbatching(events))
    handoff: ReceiveHandoff[str] = ReceiveHandoff()
    handoff.hand_off(0, lambda: "r0", yield_to_dbo=True)
    assert events == ["yield"]
    assert handoff.pending_stages == (0,)
    handoff.hand_off(1, lambda: "r1")
    assert events == ["yield"]  # no yield unless asked
    assert handoff.take(0) == "r0"


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


def test_hand_offs_of_two_overlapped_stages_interleave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under afd-core's two-stage overlap each stage hands its receive off, yields (the other
    stage runs) and takes it back: one handoff serves both stages, none is lost."""
    from afd_core.overlap import run_overlapped

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

    results = run_overlapped([stage(0), stage(1)], timeout_s=10)  # type: ignore[list-item]
    assert results == [["out0.0", "out1.0"], ["out0.1", "out1.1"]]
    assert order == ["send0.0", "send0.1", "send1.0", "send1.1"]
    assert handoff.pending_stages == ()
