"""Where the Attention runner splits a step into its two stages (afd_runtime.stages)."""

from __future__ import annotations

import pytest
from afd_runtime.stages import split_point


@pytest.mark.parametrize(
    ("query_lens", "computed", "expected"),
    [
        ([1, 1, 1, 1], [5, 6, 7, 8], 2),  # decode: half the requests each
        ([1, 1, 1], [5, 6, 7], 1),
        ([6, 4, 5], [0, 0, 0], 6),  # fresh prefills: cut after the first (6 | 9)
        ([1, 9], [12, 0], 1),  # a decode beside a fresh prefill
        ([3, 1], [0, 8], 3),
    ],
)
def test_split_at_the_balanced_request_boundary(
    query_lens: list[int], computed: list[int], expected: int
) -> None:
    assert split_point(query_lens, computed, 2) == expected


@pytest.mark.parametrize(
    ("query_lens", "computed", "stages"),
    [
        ([1], [4], 2),  # one request runs one stage
        ([7], [0], 2),
        ([1, 1], [3, 4], 1),  # one stage configured
        # A request that reads KV it did not write in an earlier step (prefix-cache hit or
        # chunked-prefill continuation): vLLM's own rule keeps such a step whole.
        ([1, 4], [3, 16], 2),
        ([5, 5], [0, 2], 2),
    ],
)
def test_steps_that_stay_whole(query_lens: list[int], computed: list[int], stages: int) -> None:
    assert split_point(query_lens, computed, stages) is None


@pytest.mark.parametrize(
    ("query_lens", "computed", "expected"),
    [
        ([1] * 31, [4] * 31, None),  # decodes below the decode threshold (32)
        ([1] * 32, [4] * 32, 16),
        ([300, 200], [0, 0], None),  # prefills below the prefill threshold (512)
        ([300, 212], [0, 0], 300),
        ([1, 511], [9, 0], 1),  # a mixed step counts against the prefill threshold
        ([1, 30], [9, 0], None),
    ],
)
def test_vllm_dbo_thresholds_decide_which_steps_split(
    query_lens: list[int], computed: list[int], expected: int | None
) -> None:
    assert split_point(query_lens, computed, 2, 32, 512) == expected
