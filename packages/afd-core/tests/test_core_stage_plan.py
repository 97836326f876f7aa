"""afd-core's stage plan: where a two-stage step is split (request boundaries, balanced tokens)."""

from __future__ import annotations

import pytest
from afd_core.errors import AFDConfigError
from afd_core.stage_plan import plan_stages


@pytest.mark.parametrize(
    ("query_lens", "expected"),
    [
        ([1, 1], (1, 1)),
        ([1, 1, 1, 1], (2, 2)),
        ([1, 1, 1], (1, 2)),  # tie (1 vs 2, 2 vs 1): the earlier cut
        ([10, 1, 1], (1, 2)),
        ([1, 1, 10], (2, 1)),
        ([3, 4, 5], (2, 1)),
        ([7, 2, 2, 2, 1], (1, 4)),
    ],
)
def test_plan_cuts_at_the_request_boundary_that_best_balances_tokens(
    query_lens: list[int], expected: tuple[int, int]
) -> None:
    assert plan_stages(query_lens, 2) == expected


@pytest.mark.parametrize(("query_lens", "stages"), [([5], 2), ([1], 2), ([3, 4], 1)])
def test_plan_keeps_one_request_or_one_stage_whole(query_lens: list[int], stages: int) -> None:
    assert plan_stages(query_lens, stages) is None


@pytest.mark.parametrize(
    ("query_lens", "stages", "field"),
    [([1, 1], 3, "num_stages"), ([1, 1], True, "num_stages"), ([1, 0], 2, "query_lens")],
)
def test_plan_rejects_bad_input_naming_it(
    query_lens: list[int], stages: object, field: str
) -> None:
    with pytest.raises(AFDConfigError, match=field):
        plan_stages(query_lens, stages)  # type: ignore[arg-type]
