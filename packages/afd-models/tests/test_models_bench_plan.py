"""``afd bench`` against ``afd plan``: the row mapping, the comparison and the engine overheads
``afd bench --profile`` derives (hand-computed cases; no engine runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from afd_models.demo.bench_plan import (
    TARGET_ERROR,
    PlannedRow,
    _misordered,
    candidate_for,
    compare_with_plan,
    render_plan_comparison,
)
from afd_models.demo.calibrate import EngineCalibration, engine_overheads
from afd_models.demo.tiny import TinySpec, model_config
from afd_plan import Candidate, profile_from_mapping

#: A device so fast that every layer term is negligible: what is left is the engine's.
INSTANT: dict[str, Any] = {
    "name": "instant",
    "source": "test",
    "peak_flops": {"fp32": 1e21},
    "memory_bandwidth": 1e21,
    "memory_bytes": 1e12,
    "link_bandwidth": 1e21,
    "link_latency": 0.0,
    "message_overhead": 0.0,
}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(model_config(TinySpec(), 1000)))
    return tmp_path


@pytest.mark.parametrize(
    ("setup", "batch", "expected"),
    [
        ("plain", 4, ("tiny", Candidate(1, 0, 1, 4))),
        ("plain wide", 16, ("wide", Candidate(1, 0, 1, 16))),
        ("afd 1:1", 1, ("tiny", Candidate(1, 1, 1, 1))),
        ("afd 2:1", 16, ("tiny", Candidate(2, 1, 1, 8))),  # 16 requests over 2 ranks
        ("afd 1:2 gate-attn", 4, ("tiny", Candidate(1, 2, 1, 4))),
        ("afd 1:1 stages=2", 16, ("tiny", Candidate(1, 1, 2, 16))),
        ("afd 1:1 wide stages=2", 4, ("wide", Candidate(1, 1, 2, 4))),
        ("plain (vLLM default threads)", 4, None),
        ("afd 1:1 layered w8a8", 4, None),
    ],
)
def test_bench_rows_map_to_candidates(
    setup: str, batch: int, expected: tuple[str, Candidate] | None
) -> None:
    assert candidate_for(setup, batch) == expected


def test_engine_overheads_solve_the_hand_computed_case(checkpoint: Path) -> None:
    # Plain: 3.0 ms at batch 1, 4.5 ms at 16 -> 0.1 ms per sequence, 2.9 ms per step. The pair
    # at batch 1: 3.0 ms of engine + 2 messages x 4 MoE layers x m = 5.4 ms -> m = 0.3 ms.
    eng = EngineCalibration(str(checkpoint), 48, {1: 3.0e-3, 16: 4.5e-3}, 5.4e-3)
    got = engine_overheads(INSTANT, eng)
    assert got == pytest.approx(
        {"step_overhead": 2.9e-3, "sequence_overhead": 0.1e-3, "message_overhead": 0.3e-3},
        rel=1e-6,
    )
    # Measurements the layer terms and the engine already explain clamp at 0, never below.
    clamped = engine_overheads(
        INSTANT, EngineCalibration(str(checkpoint), 48, {1: 3e-3, 16: 2e-3}, 1e-3)
    )
    assert clamped["sequence_overhead"] == 0.0 and clamped["message_overhead"] == 0.0
    assert "oversubscription_cost" not in got  # no 1:2 measurement, no shared host


@pytest.mark.parametrize(("shared_ms", "cost"), [(11.7, 1.0), (15.6, 2.0), (7.0, 0.0)])
def test_oversubscription_cost_from_three_engines_on_two_cores(
    checkpoint: Path, shared_ms: float, cost: float
) -> None:
    # The case above (step 2.9 ms, 0.1 ms a sequence, m = 0.3 ms). Unshared, 1:2 at batch 1 is
    # 3.0 ms of engine + 4 MoE layers x 4 messages (the Attention end posts and completes one
    # per FFN rank each way) x 0.3 ms = 7.8 ms. Measured 11.7 ms: a stretch of 1.5 = 1 + cost x
    # (3 - 2) / 2 -> cost 1 (the share of time); 15.6 ms -> 2; faster than unshared clamps at 0.
    eng = EngineCalibration(str(checkpoint), 48, {1: 3.0e-3, 16: 4.5e-3}, 5.4e-3, shared_ms / 1e3)
    got = engine_overheads({**INSTANT, "host_cores": 2}, eng)
    assert got["oversubscription_cost"] == pytest.approx(cost, abs=1e-9)
    # Three cores or more hold the three engines: nothing to fit.
    assert "oversubscription_cost" not in engine_overheads({**INSTANT, "host_cores": 3}, eng)


def test_the_comparison_prices_the_engine_and_the_exchange(checkpoint: Path) -> None:
    hw = profile_from_mapping(
        {**INSTANT, "step_overhead": 2.9e-3, "sequence_overhead": 0.1e-3, "message_overhead": 3e-4}
    )
    rows = [
        {"setup": "plain", "batch": 4, "tpot_ms": 3.3},
        {"setup": "afd 1:1", "batch": 4, "tpot_ms": 6.0},
        {"setup": "afd 1:2 gate-attn", "batch": 4, "tpot_ms": 4.0},  # measured faster: misordered
        {"setup": "plain (vLLM default threads)", "batch": 4, "tpot_ms": 9.0},  # not priced
    ]
    cmp = compare_with_plan(rows, {"tiny": checkpoint}, hw, max_tokens=48)
    got = {(r.setup, r.batch): round(r.predicted_ms, 6) for r in cmp.rows}
    # plain: 2.9 + 4 x 0.1; 1:1: + 4 layers x 2 x 0.3; 1:2: the Attention end posts 2 messages.
    assert got == {("plain", 4): 3.3, ("afd 1:1", 4): 5.7, ("afd 1:2 gate-attn", 4): 8.1}
    assert [r.within_target for r in cmp.rows] == [True, True, False]
    assert cmp.misordered == (("afd 1:1 b=4", "afd 1:2 gate-attn b=4"),)
    text = render_plan_comparison(cmp)
    assert (
        "2/3 predicted rows within 25%" in text and "afd 1:1 b=4 vs afd 1:2 gate-attn b=4" in text
    )
    assert cmp.to_json()["within_target"] == 2
    with pytest.raises(KeyError, match="checkpoints\\['wide'\\]"):
        compare_with_plan(
            [{"setup": "plain wide", "batch": 4, "tpot_ms": 1.0}], {}, hw, max_tokens=8
        )


def test_a_run_with_its_engine_anchors_fits_them_and_predicts_the_rest(checkpoint: Path) -> None:
    # The profile's engine overheads are wrong (another run's); the run measured plain at 1 and
    # 16 and the 1:1 pair at 1: the hand-computed case above, fitted from these rows.
    hw = profile_from_mapping({**INSTANT, "step_overhead": 9e-3, "sequence_overhead": 0.0})
    rows = [
        {"setup": "plain", "batch": 1, "tpot_ms": 3.0},
        {"setup": "plain", "batch": 4, "tpot_ms": 3.3},
        {"setup": "plain", "batch": 16, "tpot_ms": 4.5},
        {"setup": "afd 1:1", "batch": 1, "tpot_ms": 5.4},
        {"setup": "afd 1:1", "batch": 4, "tpot_ms": 5.7},
    ]
    cmp = compare_with_plan(rows, {"tiny": checkpoint}, hw, max_tokens=48)
    assert cmp.anchored == pytest.approx(
        {"step_overhead": 2.9e-3, "sequence_overhead": 0.1e-3, "message_overhead": 0.3e-3}
    )
    anchors = {(r.setup, r.batch) for r in cmp.rows if r.anchor}
    assert anchors == {("plain", 1), ("plain", 16), ("afd 1:1", 1)}
    got = {(r.setup, r.batch): round(r.predicted_ms, 6) for r in cmp.predicted}
    assert got == {("plain", 4): 3.3, ("afd 1:1", 4): 5.7}
    assert cmp.within_target == 2 and cmp.to_json()["predicted_rows"] == 2
    assert "(anchor)" in render_plan_comparison(cmp)
    # On a host of two cores the run's 1:2 at batch 1 anchors the oversubscription (the case
    # above: 15.6 ms -> cost 2, so 1:2 at batch 4, 8.1 ms unshared, is predicted 16.2 ms).
    shared_rows = [
        *rows,
        {"setup": "afd 1:2 gate-attn", "batch": 1, "tpot_ms": 15.6},
        {"setup": "afd 1:2 gate-attn", "batch": 4, "tpot_ms": 17.0},
    ]
    host = hw.with_overrides(host_cores=2)
    shared = compare_with_plan(shared_rows, {"tiny": checkpoint}, host, max_tokens=48)
    assert shared.anchored is not None
    assert shared.anchored["oversubscription_cost"] == pytest.approx(2.0)
    assert {(r.setup, r.batch) for r in shared.rows if r.anchor} == {
        *anchors,
        ("afd 1:2 gate-attn", 1),
    }
    got = {(r.setup, r.batch): round(r.predicted_ms, 6) for r in shared.predicted}
    assert got == {("plain", 4): 3.3, ("afd 1:1", 4): 5.7, ("afd 1:2 gate-attn", 4): 16.2}
    assert "oversubscription_cost 2.00" in render_plan_comparison(shared)
    # Own devices (no host_cores): the 1:2 row is a prediction like any other.
    own = compare_with_plan(shared_rows, {"tiny": checkpoint}, hw, max_tokens=48)
    assert own.anchored is not None and "oversubscription_cost" not in own.anchored
    assert ("afd 1:2 gate-attn", 1) in {(r.setup, r.batch) for r in own.predicted}
    # Without the anchor rows (or asked not to) the profile's overheads price every row.
    plain = compare_with_plan(rows, {"tiny": checkpoint}, hw, max_tokens=48, anchor=False)
    assert plain.anchored is None and not any(r.anchor for r in plain.rows)
    assert plain.rows[0].predicted_ms == pytest.approx(9.0)


def test_rows_within_five_percent_are_a_tie_not_an_order() -> None:
    a = PlannedRow("x", 4, 10.0, 1.0, "link")
    b = PlannedRow("y", 4, 10.4, 2.0, "link")  # measured 4 % apart: not compared
    c = PlannedRow("z", 16, 5.0, 9.0, "link")  # another batch: not compared
    assert _misordered([a, b, c]) == ()
    assert a.error == pytest.approx(-0.9) and not a.within_target
    assert PlannedRow("w", 1, 10.0, 10.0 * (1 + TARGET_ERROR), "link").within_target


def test_with_several_starts_overlapping_ranges_are_a_tie_and_disjoint_ones_an_order() -> None:
    # Medians 15 % apart, but one start of x measured above one of y: the run cannot order them.
    x = PlannedRow("x", 4, 7.3, 8.0, "link", start_ms=(8.45, 7.31, 7.19))
    y = PlannedRow("y", 4, 8.4, 8.0 - 1e-9, "link", start_ms=(8.16, 9.56, 8.4))
    assert x.tied_with(y) and y.tied_with(x)
    assert _misordered([x, y]) == ()
    # Disjoint ranges: measured x < y, predicted x > y: misordered, even within 5 %.
    z = PlannedRow("z", 4, 7.6, 7.0, "link", start_ms=(7.5, 7.6, 7.7))
    w = PlannedRow("w", 4, 7.9, 6.0, "link", start_ms=(7.8, 7.9, 8.0))
    assert not z.tied_with(w)
    assert _misordered([z, w]) == (("z b=4", "w b=4"),)
    # One start only: the 5 % rule.
    one = PlannedRow("one", 4, 7.6, 7.0, "link", start_ms=(7.6,))
    assert one.tied_with(w)
