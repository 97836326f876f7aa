"""The P2P benchmark harness runs (``--quick``), writes its JSON and prints its table."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_p2p.py"


@pytest.mark.timeout(180)
def test_bench_p2p_quick(tmp_path: Path) -> None:
    out = tmp_path / "p2p.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["quick"] is True
    sizes = doc["config"]["sizes_bytes"]
    assert [row["size_bytes"] for row in doc["rows"]] == sizes
    for row in doc["rows"]:
        raws = ("raw", "raw_reuse", "raw_late")
        for kind in (*raws, "raw_ahead", "p2p", "p2p_reuse", "p2p_late"):
            assert row[f"{kind}_rtt_us_p99"] >= row[f"{kind}_rtt_us_median"] > 0
        for kind in (*raws, "rawpipe", "p2p", "p2p_reuse", "p2p_late"):
            assert row[f"{kind}_oneway_MBps_median"] >= row[f"{kind}_oneway_MBps_min"] > 0
        repeats = doc["config"]["repeats"]
        assert doc["config"]["oneway_steps_per_repeat"][str(row["size_bytes"])] == 1  # quick
        for kind, raw in zip(("p2p", "p2p_reuse", "p2p_late"), raws, strict=True):
            # Paired by repeat against the raw baseline on the same connector's groups: medians
            # over repeats of the per-repeat ratio and difference.
            tp, tp_raw = row[f"{kind}_oneway_MBps_per_repeat"], row[f"{raw}_oneway_MBps_per_repeat"]
            assert len(tp) == len(tp_raw) == repeats
            assert row[f"{kind}_throughput_ratio"] == pytest.approx(
                statistics.median(p / r for p, r in zip(tp, tp_raw, strict=True))
            )
            low, high = row[f"{kind}_throughput_ratio_ci95"]
            assert low <= row[f"{kind}_throughput_ratio"] <= high
            rtt, rtt_raw = row[f"{kind}_rtt_us_per_repeat"], row[f"{raw}_rtt_us_per_repeat"]
            added = statistics.median(p - r for p, r in zip(rtt, rtt_raw, strict=True))
            assert row[f"{kind}_added_us_per_call"] == pytest.approx(added / 4)
            assert row[f"{kind}_added_us_per_transfer"] == pytest.approx(added / 2)
        # Interleaved pairs: one P2P and one raw round trip per pair, every layer of every step;
        # the placement control pairs two raw round trips the same way.
        steps = doc["config"]["pair_steps_per_repeat"][str(row["size_bytes"])]
        assert row["interleaved_pairs"] == repeats * steps * 48
        for kind in ("p2p", "raw"):
            assert (
                row[f"interleaved_{kind}_rtt_us_p99"]
                >= row[f"interleaved_{kind}_rtt_us_median"]
                > 0
            )
        for name in ("p2p", "placement"):
            low, high = row[f"{name}_added_us_per_call_interleaved_ci95"]
            assert low <= row[f"{name}_added_us_per_call_interleaved"] <= high
    targets = doc["targets"]
    assert targets["p2p_latency_met_interleaved"] == all(
        r["p2p_added_us_per_call_interleaved"] <= 20.0 for r in doc["rows"]
    )
    assert targets["p2p_throughput_met"] == all(
        r["p2p_throughput_ratio"] >= 0.9 for r in doc["rows"]
    )
    assert targets["p2p_latency_met"] == all(
        r["p2p_added_us_per_call"] <= 20.0 for r in doc["rows"]
    )
    assert doc["overhead_no_io"]["attention_added_us_per_call"] > 0
    assert "interleaved pair by pair" in proc.stdout
    assert "| size |" in proc.stdout and "4 KiB" in proc.stdout and "64 KiB" in proc.stdout


def _load_bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_p2p", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_median_ci_resamples_whole_repeats() -> None:
    bench = _load_bench()
    # Three repeats; the median over all pairs is 2.0; every resample's median lies within the
    # repeats' range, and a seeded bootstrap reproduces.
    per_repeat = [[1.0, 1.0], [2.0, 2.0, 2.0], [9.0, 9.0]]
    median, low, high = bench._median_ci(per_repeat)  # type: ignore[attr-defined]
    assert median == 2.0
    assert 1.0 <= low <= median <= high <= 9.0
    assert bench._median_ci(per_repeat) == (median, low, high)  # type: ignore[attr-defined]
    # A single repeat resamples to itself: the interval collapses onto the median.
    assert bench._median_ci([[3.0, 5.0, 4.0]]) == (4.0, 4.0, 4.0)  # type: ignore[attr-defined]


def test_pair_diffs_are_per_repeat_microseconds() -> None:
    bench = _load_bench()
    diffs = bench._pair_diffs_us(  # type: ignore[attr-defined]
        [[0.002, 0.003], [0.001]], [[0.001, 0.001], [0.001]]
    )
    assert diffs == [[pytest.approx(1000.0), pytest.approx(2000.0)], [0.0]]
    with pytest.raises(ValueError):  # pairs must line up
        bench._pair_diffs_us([[0.1, 0.2]], [[0.1]])  # type: ignore[attr-defined]
