"""The benchmark harness runs (``--quick``), writes JSON and prints the markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks" / "bench_cam.py"


@pytest.mark.timeout(120)
def test_bench_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("afd_cam_bench_cam", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "cam.json"
    assert module.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] is True
    cases = {(r["tp_size"], r["layout"]): r["stage_input_rows"] for r in data["rows"]}
    # 8 tokens in two stages of 4: replicated layouts hold 4 rows per stage, SP (TP=4) holds 1.
    assert cases == {(1, "TP"): [4, 4], (4, "TP"): [4, 4], (4, "SP"): [1, 1]}
    assert all(r["median_us"] > 0 for r in data["rows"])
    table = capsys.readouterr().out
    assert table.startswith("| layout | TP |")
    assert len(table.strip().splitlines()) == len(data["rows"]) + 2
