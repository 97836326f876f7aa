"""afd-cam's TP row gather on a real gloo group (TP = 2): the SP round trip is exact."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import afd_cam_gloo_worker as worker
from afd_cam import CAMStageLayout
from afd_core.testing import free_port, run_world


@pytest.mark.timeout(300)
def test_sequence_parallel_round_trip_over_gloo(tmp_path: Path) -> None:
    tp = 2
    outcomes = run_world(worker.run, tp, tp, free_port(), str(tmp_path), timeout_s=240)
    assert all(outcome[0] == "ok" for outcome in outcomes.values()), outcomes
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(tp)]
    full_layout = CAMStageLayout.from_token_counts(
        worker.COUNTS, tp_size=tp, use_sequence_parallel=True
    )
    x = worker.parent(full_layout)
    expected = x * 2 + 1
    expected[full_layout.real_tokens :] = 0
    for rank, res in enumerate(results):
        rows = full_layout.parent_input_tokens // tp
        sl = slice(rank * rows, (rank + 1) * rows)
        assert torch.equal(res["local"], x[sl])
        assert torch.equal(res["hidden"], expected[sl])
        assert torch.equal(res["residual"], -x[sl])
        # Stage 0: 5 real tokens padded to 6, this rank's 3 rows.
        stage0 = torch.cat((x[:5], torch.zeros(1, worker.WIDTH)))[rank * 3 : (rank + 1) * 3]
        assert torch.equal(res["stages"][0], stage0)
