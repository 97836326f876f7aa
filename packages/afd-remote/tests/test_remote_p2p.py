"""End to end with afd-core's real P2PConnector: 2 Attention ranks, 1 FFN rank, gloo.

The Attention ranks run AFDAttentionFusedMoE for gate on FFN (forward), gate on Attention with
router logits (forward), with top-k (two stages interleaved through dispatch/receive) and gate on
FFN with token ids (``input_ids``, DeepSeek-V4's hash routing); the FFN rank checks every
routing payload (ids included, per rank and stage) and replies. Stage 1 of Attention rank 1 is empty.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import afd_remote_p2p_worker as worker
from afd_core.testing import free_port, run_world


@pytest.mark.timeout(300)
def test_proxies_round_trip_through_the_p2p_connector() -> None:
    outcomes = run_world(worker.run, 3, free_port(), 2, 1, timeout_s=240)
    assert sorted(outcomes) == [0, 1, 2]
    for rank, outcome in outcomes.items():
        assert outcome[0] == "ok", (rank, outcome)
        report = outcome[1]
        assert report["problems"] == [], (rank, report)
        assert report["variants"] == len(worker.VARIANTS)
    assert [outcomes[r][1]["role"] for r in range(3)] == ["attention", "attention", "ffn"]
