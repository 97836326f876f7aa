"""CAMStage / CAMStageLayout validation and constructors."""

from __future__ import annotations

import pytest
from afd_cam import AFDCamError, CAMStage, CAMStageLayout
from afd_core.errors import AFDError


def _stage(start: int, actual: int, inp: int | None = None) -> CAMStage:
    return CAMStage(start=start, actual_tokens=actual, input_tokens=actual if inp is None else inp)


def test_stage_properties() -> None:
    stage = CAMStage(start=3, actual_tokens=4, input_tokens=6)
    assert (stage.stop, stage.pad_tokens) == (7, 2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"start": -1, "actual_tokens": 1, "input_tokens": 1}, "start"),
        ({"start": 0, "actual_tokens": 0, "input_tokens": 1}, "actual_tokens"),
        ({"start": 0, "actual_tokens": 3, "input_tokens": 2}, "input_tokens"),
        ({"start": 0, "actual_tokens": True, "input_tokens": 2}, "actual_tokens"),
    ],
)
def test_stage_rejects(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(AFDCamError) as info:
        CAMStage(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, AFDError)
    assert isinstance(info.value, ValueError)


def test_layout_accepts_contiguous_stages() -> None:
    layout = CAMStageLayout(stages=(_stage(0, 3, 4), _stage(3, 2, 4)), parent_input_tokens=8)
    assert layout.num_stages == 2
    assert layout.real_tokens == 5
    assert not layout.is_sharded
    assert layout.local_rows(8) == 8
    assert layout.local_slice(8) == slice(0, 8)


def test_layout_sharded_local_rows() -> None:
    layout = CAMStageLayout(
        stages=(_stage(0, 3, 4), _stage(3, 2, 2)),
        parent_input_tokens=6,
        tp_size=2,
        tp_rank=1,
        use_sequence_parallel=True,
    )
    assert layout.is_sharded
    assert layout.local_rows(6) == 3
    assert layout.local_slice(6) == slice(3, 6)
    assert layout.local_slice(4) == slice(2, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stages": (), "parent_input_tokens": 1}, "stages"),
        ({"stages": [CAMStage(0, 1, 1)], "parent_input_tokens": 1}, "stages"),
        ({"stages": (CAMStage(1, 1, 1),), "parent_input_tokens": 2}, "stages[0].start"),
        (
            {"stages": (CAMStage(0, 2, 2), CAMStage(1, 1, 1)), "parent_input_tokens": 4},
            "stages[1].start",
        ),
        (
            {"stages": (CAMStage(0, 2, 2), CAMStage(3, 1, 1)), "parent_input_tokens": 4},
            "stages[1].start",
        ),
        ({"stages": (CAMStage(0, 3, 3),), "parent_input_tokens": 2}, "parent_input_tokens"),
        ({"stages": (CAMStage(0, 2, 2),), "parent_input_tokens": 2, "tp_size": 0}, "tp_size"),
        (
            {"stages": (CAMStage(0, 2, 2),), "parent_input_tokens": 2, "tp_size": 2, "tp_rank": 2},
            "tp_rank",
        ),
        (
            {
                "stages": (CAMStage(0, 2, 2),),
                "parent_input_tokens": 3,
                "tp_size": 2,
                "use_sequence_parallel": True,
            },
            "parent_input_tokens",
        ),
        (
            {
                "stages": (CAMStage(0, 2, 2), CAMStage(2, 1, 1)),
                "parent_input_tokens": 4,
                "tp_size": 2,
                "use_sequence_parallel": True,
            },
            "stages[1].input_tokens",
        ),
        (
            {"stages": (CAMStage(0, 2, 2),), "parent_input_tokens": 2, "use_sequence_parallel": 1},
            "use_sequence_parallel",
        ),
    ],
)
def test_layout_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(AFDCamError) as info:
        CAMStageLayout(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_sp_divisibility_only_applies_when_sharded() -> None:
    # Plain TP (replicated) and SP with one rank accept odd counts.
    CAMStageLayout(stages=(CAMStage(0, 3, 3),), parent_input_tokens=3, tp_size=2)
    CAMStageLayout(
        stages=(CAMStage(0, 3, 3),), parent_input_tokens=3, tp_size=1, use_sequence_parallel=True
    )


def test_from_token_counts_rounds_for_sp() -> None:
    layout = CAMStageLayout.from_token_counts(
        [3, 2], tp_size=4, tp_rank=1, use_sequence_parallel=True
    )
    assert layout.stages == (CAMStage(0, 3, 4), CAMStage(3, 2, 4))
    assert layout.parent_input_tokens == 8
    plain = CAMStageLayout.from_token_counts([3, 2], tp_size=4)
    assert plain.stages == (CAMStage(0, 3, 3), CAMStage(3, 2, 2))
    assert plain.parent_input_tokens == 5


def test_from_token_counts_explicit_inputs() -> None:
    layout = CAMStageLayout.from_token_counts([3, 2], input_tokens=[4, 8], parent_input_tokens=9)
    assert layout.stages == (CAMStage(0, 3, 4), CAMStage(3, 2, 8))
    assert layout.parent_input_tokens == 9
    with pytest.raises(AFDCamError) as info:
        CAMStageLayout.from_token_counts([3, 2], input_tokens=[4])
    assert info.value.field == "input_tokens"


def test_split_evenly() -> None:
    layout = CAMStageLayout.split_evenly(5)
    assert [s.actual_tokens for s in layout.stages] == [3, 2]
    three = CAMStageLayout.split_evenly(7, 3)
    assert [(s.start, s.actual_tokens) for s in three.stages] == [(0, 3), (3, 2), (5, 2)]
    with pytest.raises(AFDCamError) as info:
        CAMStageLayout.split_evenly(1, 2)
    assert info.value.field == "num_tokens"
    with pytest.raises(AFDCamError) as info:
        CAMStageLayout.split_evenly(4, 0)
    assert info.value.field == "num_stages"
