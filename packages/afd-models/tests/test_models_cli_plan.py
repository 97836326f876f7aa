"""``afd plan`` in-process: table and JSON output, the default-hardware note, usage errors naming
the field, the memory refusal surfacing, and ``--plot`` without matplotlib (no engine starts)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from afd_models import cli

#: A small Qwen3-MoE: hidden 256, 4 MoE layers, 16 experts top-4.
SMALL_QWEN3: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(SMALL_QWEN3))
    return tmp_path


@pytest.fixture(autouse=True)
def _no_calibrated_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_table_best_first_with_baseline(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["plan", "--model", str(model), "--hardware", "h100-sxm", "--devices", "8"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_OK
    assert "model: qwen3_moe, 4 layers (4 MoE), 16 experts top-4" in out
    assert "colocated baseline" in out and "tok/s/dev" in out and "binds" in out


def test_json_is_the_same_data_best_first(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(model / "config.json"), "--hardware", "h200-sxm", "--json"]
    rc = cli.main([*argv, "--devices", "6", "--tpot-ms", "5", "--expert-quant", "w8a8"])
    data = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_OK
    rates = [c["tokens_per_s_per_device"] for c in data["candidates"]]
    assert rates and rates == sorted(rates, reverse=True)
    assert all(c["devices"] <= 6 and c["tpot_ms"] <= 5 for c in data["candidates"])
    assert {c["expert_quant"] for c in data["candidates"]} == {"w8a8"}
    first = data["candidates"][0]
    assert set(first["memory_bytes"]) == {"attention", "ffn"} and first["binding"]
    assert data["hardware"]["name"] == "h200-sxm" and data["colocated_baselines"]


def test_default_hardware_note_and_calibrated_profile(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--model", str(model), "--devices", "4"]) == cli.EXIT_OK
    assert "no calibrated profile" in capsys.readouterr().err
    from afd_plan.hardware import load_profile

    calibrated = tmp_path / "cache" / "afd" / "profile.json"
    calibrated.parent.mkdir(parents=True)
    data = load_profile("cpu-2core").to_mapping() | {"name": "this-host"}
    calibrated.write_text(json.dumps(data))
    assert cli.main(["plan", "--model", str(model), "--devices", "4", "--json"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert "using the calibrated profile" in captured.err
    assert json.loads(captured.out)["hardware"]["name"] == "this-host"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--hardware", "tpu-v9"], "'hardware': got 'tpu-v9'"),
        (["--expert-skew", "0.5"], "'expert_skew': got 0.5"),
    ],
)
def test_usage_errors_name_the_field(
    model: Path, extra: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--model", str(model), *extra]) == cli.EXIT_USAGE
    assert expected in capsys.readouterr().err


def test_bad_config_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SMALL_QWEN3, "num_experts_per_tok": 0}))
    assert cli.main(["plan", "--model", str(tmp_path)]) == cli.EXIT_USAGE
    assert "'config.json:num_experts_per_tok': got 0" in capsys.readouterr().err


def test_bad_flag_value_exits_2(model: Path) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(["plan", "--model", str(model), "--input-len", "0"])
    assert err.value.code == 2


def test_nothing_fits_exits_1_naming_the_role(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_plan.hardware import load_profile

    tiny_device = tmp_path / "tiny.json"
    data = load_profile("cpu-2core").to_mapping() | {"memory_bytes": 1e6}
    tiny_device.write_text(json.dumps(data))
    rc = cli.main(["plan", "--model", str(model), "--hardware", str(tiny_device), "--devices", "4"])
    out = capsys.readouterr().out
    assert rc == cli.EXIT_MISMATCH
    assert "no AFD candidate fits" in out and "role does not fit: needs" in out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="has matplotlib")
def test_plot_without_matplotlib_says_what_to_install(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["plan", "--model", str(model), "--plot", str(tmp_path / "p.png")])
    assert rc == cli.EXIT_USAGE
    assert "pip install matplotlib" in capsys.readouterr().err
