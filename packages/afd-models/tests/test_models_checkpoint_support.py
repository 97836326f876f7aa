"""Checkpoints AFD does not serve are refused before any engine starts, naming the field.

Planted fixtures: a published config whose ``architectures`` has no AFD adapter (Mixtral-8x7B,
an MoE family vLLM serves), and the published Qwen3-30B-A3B-FP8 config
(``quantization_config``, FP8 block). Both paths are checked: ``afd serve`` on a local checkpoint
(refused before vLLM is imported: nothing of vLLM, let alone an engine, runs) and vLLM building
its engine config with the ``afd`` mapping (``EngineArgs.create_engine_config``, in the API
server process, before any engine core starts: the check afd-runtime runs for ``vllm serve``).
The checkpoints AFD serves pass both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from afd_core.errors import AFDModelError
from afd_models.demo.published import PublishedSpec, published_keys
from afd_models.plugin import SERVED_MODELS
from afd_models.vllm_cli import check_serve_args, serve_model_arg
from afd_runtime.checkpoint_checks import check_checkpoint_config

AFD_FFN = json.dumps({"afd": {"role": "ffn"}})


def _planted(tmp_path: Path, spec: PublishedSpec) -> Path:
    """A checkpoint folder holding only ``spec``'s config.json: every refusal here happens
    before a weight is read."""
    config = spec.config(1024)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def mixtral(tmp_path: Path) -> Path:
    return _planted(tmp_path / "mixtral", PublishedSpec("mixtral-8x7b-v0.1"))


@pytest.fixture
def fp8(tmp_path: Path) -> Path:
    return _planted(tmp_path / "fp8", PublishedSpec("qwen3-30b-a3b-fp8"))


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, "architectures"),
        # A drafter is built from a served checkpoint, never served itself.
        ({"architectures": ["DeepSeekMTPModel"]}, "architectures"),
        ({"architectures": []}, "architectures"),
        ({}, "architectures"),
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "quantization_config": {"quant_method": "awq"},
            },
            "quantization_config.quant_method",
        ),
    ],
)
def test_each_refusal_names_the_checkpoint_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(AFDModelError) as info:
        check_checkpoint_config(config, "checkpoint 'x'", SERVED_MODELS)
    assert info.value.field == field
    assert "checkpoint 'x'" in str(info.value)
    if field == "architectures":
        assert "Qwen3MoeForCausalLM" in str(info.value)  # the supported ones are listed


@pytest.mark.parametrize("key", [k for k in published_keys() if k != "mixtral-8x7b-v0.1"])
def test_published_checkpoints_pass_unquantized_and_are_refused_quantized(key: str) -> None:
    """Every published fixture with an adapted architecture: accepted without a
    quantization_config, refused with one (the FP8 releases as published)."""
    published = PublishedSpec(key).config(1024)
    check_checkpoint_config(PublishedSpec(key, dequantized=True).config(1024), key, SERVED_MODELS)
    if "quantization_config" in published:
        with pytest.raises(AFDModelError) as info:
            check_checkpoint_config(published, key, SERVED_MODELS)
        assert info.value.field == "quantization_config.quant_method"
        assert info.value.value == "fp8"


@pytest.mark.parametrize(
    ("argv", "model"),
    [
        (["serve", "/m", "--port", "1"], "/m"),
        (["serve", "--model", "/m"], "/m"),
        (["serve", "--port", "1", "--model=/m"], "/m"),
        (["serve", "--port", "1"], None),
    ],
)
def test_the_served_model_is_found_in_the_arguments(argv: list[str], model: str | None) -> None:
    assert serve_model_arg(argv) == model


def test_serve_args_without_an_afd_role_are_not_checked(mixtral: Path) -> None:
    check_serve_args(["serve", str(mixtral)])  # plain vLLM serves what it serves


@pytest.mark.parametrize(
    ("planted", "field"),
    [("mixtral", "architectures"), ("fp8", "quantization_config.quant_method")],
)
def test_afd_serve_refuses_before_vllm_is_imported(
    planted: str, field: str, request: pytest.FixtureRequest
) -> None:
    model = request.getfixturevalue(planted)
    code = (
        "import sys\n"
        "from afd_models.cli import main\n"
        f"rc = main(['serve', {str(model)!r}, '--additional-config', {AFD_FFN!r}])\n"
        "assert 'vllm' not in sys.modules, 'vLLM was imported'\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2, done.stderr
    assert f"'{field}'" in done.stderr and "afd serve: error:" in done.stderr, done.stderr


@pytest.mark.vllm_runtime
@pytest.mark.parametrize("planted", ["mixtral", "fp8"])
def test_vllm_engine_config_refuses_before_any_engine(
    planted: str, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("vllm")
    from afd_models.plugin import register
    from vllm.engine.arg_utils import EngineArgs

    register()
    model = request.getfixturevalue(planted)
    args = EngineArgs(
        model=str(model),
        max_model_len=256,
        dtype="bfloat16",  # vLLM accepts an FP8 config in bfloat16: the AFD check decides
        additional_config={"afd": {"role": "ffn"}},
    )
    with pytest.raises(AFDModelError) as info:
        args.create_engine_config()
    expected = "architectures" if planted == "mixtral" else "quantization_config.quant_method"
    assert info.value.field == expected
    assert "AFD role ffn" in str(info.value)
    if planted == "mixtral":  # the plugin declared the served architectures, not the drafters
        assert "Glm4MoeForCausalLM" in str(info.value)
        assert "DeepSeekMTPModel" not in str(info.value)
