"""The P2P benchmark harness runs (``--quick``), writes its JSON and prints its table."""

from __future__ import annotations

import json
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
        for kind in ("raw", "p2p"):
            assert row[f"{kind}_rtt_us_median"] > 0
            assert row[f"{kind}_rtt_us_p99"] > 0
            assert row[f"{kind}_oneway_MBps_median"] >= row[f"{kind}_oneway_MBps_min"] > 0
        assert row["throughput_ratio"] == pytest.approx(
            row["p2p_oneway_MBps_median"] / row["raw_oneway_MBps_median"]
        )
        assert row["added_latency_us_per_call"] == pytest.approx(
            (row["p2p_rtt_us_median"] - row["raw_rtt_us_median"]) / 2
        )
    assert set(doc["targets"]) >= {"throughput_met", "latency_met"}
    assert "| size |" in proc.stdout and "4 KiB" in proc.stdout and "64 KiB" in proc.stdout
