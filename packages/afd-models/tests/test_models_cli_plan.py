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


# --------------------------------------------------------------------------------------------
# The format and routing flags, each asserted by its effect on the plan (moved here from
# test_models_cli_flags.py, beside the other `afd plan` tests).


def _plan(
    model: Path, capsys: pytest.CaptureFixture[str], *extra: str, hardware: str = "h100-sxm"
) -> dict[str, Any]:
    argv = ["plan", "--model", str(model), "--hardware", hardware, "--devices", "4", "--json"]
    rc = cli.main([*argv, *extra])
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_OK
    return data


def _by_deployment(data: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    keys = ("kind", "attention_ranks", "ffn_ranks", "stages", "batch_per_attention_rank")
    rows = [*data["candidates"], *data["colocated_baselines"].values()]
    out = {(*(c[k] for k in keys), c["expert_quant"]): c for c in rows}
    assert len(out) == len(rows)
    return out


def _attention_part(c: dict[str, Any], part: str) -> float:
    """Bytes of ``part`` on the device holding the attention (an AFD Attention rank, or a
    colocated rank)."""
    memory = c["memory_breakdown_bytes"]
    value: float = memory["attention" if "attention" in memory else "colocated"][part]
    return value


@pytest.mark.parametrize(("scheme", "ratio"), [("w8a8", 0.5), ("w4a8", 0.25)])
def test_plan_dense_quant_shrinks_the_dense_weights_only(
    scheme: str, ratio: float, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8-bit (4-bit) dense weights: every deployment's attention weights take half (a quarter)
    of the bf16 bytes, so each Attention device needs less memory and reads less per MoE
    layer; embeddings, KV cache and routed experts are untouched."""
    base = _plan(model, capsys)
    quant = _plan(model, capsys, "--dense-quant", scheme)
    assert (base["workload"]["dense_quant"], quant["workload"]["dense_quant"]) == ("none", scheme)
    before, after = _by_deployment(base), _by_deployment(quant)
    assert before.keys() == after.keys()
    for key, b in before.items():
        a = after[key]
        assert _attention_part(a, "attention_weights") == pytest.approx(
            ratio * _attention_part(b, "attention_weights")
        ), key
        for part in ("embeddings", "kv_cache"):
            assert _attention_part(a, part) == _attention_part(b, part), (key, part)
        if key[0] == "afd":
            assert a["memory_breakdown_bytes"]["ffn"] == b["memory_breakdown_bytes"]["ffn"], key
            assert a["memory_bytes"]["attention"] < b["memory_bytes"]["attention"], key
        assert a["moe_layer_us"]["attention"] <= b["moe_layer_us"]["attention"], key
        assert a["moe_layer_us"]["experts"] == b["moe_layer_us"]["experts"], key
    assert any(
        after[k]["moe_layer_us"]["attention"] < b["moe_layer_us"]["attention"]
        for k, b in before.items()
    )


def test_plan_kv_dtype_scales_the_kv_cache_and_the_batch_that_fits(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A device of 200 MB: int8 KV halves every candidate's KV cache against the model's bf16
    (float32 doubles it), so larger batches fit and fewer candidates are refused for memory."""
    from afd_plan.hardware import load_profile

    small = tmp_path / "small-device.json"
    small.write_text(json.dumps(load_profile("h100-sxm").to_mapping() | {"memory_bytes": 2e8}))
    runs = {
        kv: _plan(model, capsys, "--kv-dtype", kv, hardware=str(small))
        for kv in ("float32", "model", "int8")
    }
    assert {kv: d["workload"]["kv_dtype"] for kv, d in runs.items()} == {
        "float32": "float32",
        "model": "model",
        "int8": "int8",
    }
    rows = {kv: _by_deployment(d) for kv, d in runs.items()}
    common = rows["float32"].keys() & rows["model"].keys() & rows["int8"].keys()
    assert common
    for key in common:
        bf16 = _attention_part(rows["model"][key], "kv_cache")
        assert bf16 > 0
        assert _attention_part(rows["int8"][key], "kv_cache") == pytest.approx(bf16 / 2), key
        assert _attention_part(rows["float32"][key], "kv_cache") == pytest.approx(bf16 * 2), key
    largest = {
        kv: max(c["batch_per_attention_rank"] for c in d["candidates"]) for kv, d in runs.items()
    }
    assert largest["float32"] < largest["model"] < largest["int8"], largest
    refused = {kv: d["refused_memory_count"] for kv, d in runs.items()}
    assert refused["float32"] > refused["model"] > refused["int8"], refused


def test_plan_balanced_routing_reads_more_experts_per_step(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Forced balance spreads a step's tokens over as many experts as their picks allow, where
    uniform random picks collide: an FFN rank reads at least as many expert weights (strictly
    more where the batch does not already touch every expert); memory does not change."""
    uniform = _plan(model, capsys)
    balanced = _plan(model, capsys, "--routing", "balanced")
    assert (uniform["workload"]["routing"], balanced["workload"]["routing"]) == (
        "uniform",
        "balanced",
    )
    before, after = _by_deployment(uniform), _by_deployment(balanced)
    assert before.keys() == after.keys()
    for key, u in before.items():
        b = after[key]
        assert b["moe_layer_us"]["experts"] >= u["moe_layer_us"]["experts"], key
        assert b["memory_breakdown_bytes"] == u["memory_breakdown_bytes"], key
    slower = [k for k, u in before.items() if after[k]["moe_layer_us"]["experts"] > u["moe_layer_us"]["experts"]]  # fmt: skip
    assert slower
    assert min(k[4] for k in slower) <= 4  # the small batches, where collisions matter


@pytest.mark.parametrize(
    ("flag", "bad", "allowed"),
    [
        ("--dense-quant", "int4", ("none", "w8a8", "w4a8")),
        ("--kv-dtype", "fp8", ("model", "bfloat16", "float16", "float32", "int8")),
        ("--routing", "skewed", ("uniform", "balanced")),
    ],
)
def test_plan_format_flags_refuse_a_bad_value_naming_the_allowed_ones(
    flag: str,
    bad: str,
    allowed: tuple[str, ...],
    model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["plan", "--model", str(model), flag, bad])
    assert exit_.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "error:" in ln)
    assert f"argument {flag}: invalid choice: '{bad}'" in line
    listed = line.split("choose from", 1)[1]
    assert all(f"'{value}'" in listed for value in allowed), line


def test_plan_flags_accept_every_value_afd_plan_defines(
    model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI spells the choices itself: each of afd-plan's formats and routings is reachable
    and reaches the workload (none refused by argparse, none refused later by afd-plan)."""
    from afd_plan.workload import KV_DTYPES, QUANT_SCHEMES, ROUTINGS

    for flag, field, values in (
        ("--dense-quant", "dense_quant", QUANT_SCHEMES),
        ("--kv-dtype", "kv_dtype", tuple(KV_DTYPES)),
        ("--routing", "routing", ROUTINGS),
    ):
        for value in values:
            assert _plan(model, capsys, flag, value)["workload"][field] == value
