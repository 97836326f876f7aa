"""The benchmark harness runs (``--quick``), writes JSON and prints the markdown table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks" / "bench_remote.py"


@pytest.mark.timeout(120)
def test_bench_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("afd_remote_bench_remote", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "remote.json"
    assert module.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["quick"] is True
    padding = [r for r in data["rows"] if r["kind"] == "padding"]
    proxy = [r for r in data["rows"] if r["kind"] == "proxy"]
    assert {(r["tokens"], r["tp_size"]) for r in padding} == {(1, 1), (1, 2), (17, 1), (17, 2)}
    routed = {(r["tokens"], r["tp_size"]): r["rows_per_rank_routed"] for r in padding}
    # The last rank's real rows: 1 token over 2 ranks leaves it none; 17 over 2: 9 + 8.
    assert routed == {(1, 1): 1, (1, 2): 0, (17, 1): 17, (17, 2): 8}
    assert {r["mode"] for r in proxy} == {"dense", "moe_logits", "moe_topk"}
    assert all(r["median_us"] > 0 for r in data["rows"])
    table = capsys.readouterr().out
    assert table.startswith("| kind | mode / TP |")
    assert len(table.strip().splitlines()) == len(data["rows"]) + 2
