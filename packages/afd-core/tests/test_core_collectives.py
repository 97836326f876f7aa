"""torch_row_gather: rows of every rank, concatenated in rank order, over real gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from afd_core.testing import free_port, run_world

sys.path.insert(0, str(Path(__file__).parent))
import afd_core_worlds as worlds


@pytest.mark.timeout(120)
def test_row_gather_concatenates_in_rank_order() -> None:
    world_size = 3
    results = run_world(worlds.row_gather, world_size, free_port(), world_size, timeout_s=90)
    expected = torch.cat(
        [torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * r for r in range(world_size)]
    ).tolist()
    for rank in range(world_size):
        assert results[rank] == ("ok", expected), f"rank {rank}: {results[rank]}"


@pytest.mark.parametrize(
    ("n", "t", "rows"), [(0, 2, 0), (1, 2, 1), (2, 2, 1), (3, 2, 2), (5, 1, 5), (17, 4, 5)]
)
def test_rows_per_tp_rank_is_the_ceiling_share(n: int, t: int, rows: int) -> None:
    from afd_core.collectives import rows_per_tp_rank

    assert rows_per_tp_rank(n, t) == rows
    # T slices of that size cover the tokens with fewer than T padding rows.
    assert 0 <= rows * t - n < t


def test_rows_per_tp_rank_refuses_bad_input() -> None:
    from afd_core.collectives import rows_per_tp_rank
    from afd_core.errors import AFDPayloadError

    for n, t, field in ((-1, 2, "num_tokens"), (3, 0, "tp_size"), (True, 2, "num_tokens")):
        with pytest.raises(AFDPayloadError) as info:
            rows_per_tp_rank(n, t)  # type: ignore[arg-type]
        assert info.value.field == field


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_tp_slices_add_up_to_the_tokens(t: int) -> None:
    """Every TP rank's real rows: the slices cover exactly n (N not divisible by T, N < T,
    N = 0), none longer than rows_per_tp_rank, so no padding row is ever announced or sent."""
    from afd_core.collectives import rows_per_tp_rank, tp_slice_rows
    from afd_core.errors import AFDPayloadError

    for n in range(0, 12):
        rows = [tp_slice_rows(n, t, r) for r in range(t)]
        assert sum(rows) == n and all(0 <= x <= rows_per_tp_rank(n, t) for x in rows)
    assert [tp_slice_rows(1, 2, r) for r in range(2)] == [1, 0]
    assert [tp_slice_rows(17, 4, r) for r in range(4)] == [5, 5, 5, 2]
    with pytest.raises(AFDPayloadError) as info:
        tp_slice_rows(3, t, t)
    assert info.value.field == "tp_rank"
