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
