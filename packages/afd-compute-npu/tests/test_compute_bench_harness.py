"""The benchmark script runs in --quick mode and writes the documented JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks" / "bench_compute.py"


@pytest.mark.timeout(240)
def test_quick_bench_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("afd_bench_compute", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "quick.json"
    module.main(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["tokens"] for r in data["compute"]] == [1, 8]
    for row in data["compute"]:
        for key in ("bf16_ms", "w8a8_ms", "w4a8_per_channel_ms", "w4a8_per_group_ms"):
            assert row[key] > 0
    ratios = {r["scheme"]: r for r in data["bytes"]}
    h, i = data["params"]["bytes_hidden"], data["params"]["bytes_intermediate"]
    assert ratios["bf16"]["bytes"] == 2 * 3 * h * i
    # W8A8: int8 weights + fp32 scales [2I] + [H]
    assert ratios["w8a8"]["bytes"] == 3 * h * i + 4 * (2 * i + h)
    # W4A8 per channel: int4 weights + int64 scales + fp32 biases
    assert ratios["w4a8_per_channel"]["bytes"] == 3 * h * i // 2 + 12 * (2 * i + h)
    assert ratios["w4a8_per_channel"]["ratio_vs_bf16"] <= 0.3
    assert ratios["w4a8_per_group"]["ratio_vs_bf16"] <= 0.3
    assert "| tokens |" in capsys.readouterr().out
