"""The model identity (afd_runtime.identity): equal for the same files anywhere, different (and
named by afd-core's comparison) for a changed config value or weight file; its documented
limit (a change outside the sampled windows is missed) is a strict xfail asserting the change is
detected, so a fix shows as XPASS."""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDModelError
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.handshake import _first_difference
from afd_runtime.identity import (
    SAMPLE_BYTES,
    SAMPLE_WINDOWS,
    config_identity,
    model_identity,
    sample_windows,
    weight_file_identity,
    weights_identity,
)

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_experts": 8,
    "rope_scaling": None,
    "_name_or_path": "/somewhere/a",
    "transformers_version": "4.57.0",
    "torch_dtype": "float32",
}
ROWS, COLS = 64, 1024  # 256 KiB per float32 tensor: three are > SAMPLE_WINDOWS * SAMPLE_BYTES
NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "lm_head.weight")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` (float32) as a safetensors file; return the data section's start."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return 8 + len(raw)


def checkpoint(root: Path, name: str = "a") -> tuple[Path, int]:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(ROWS, COLS, generator=gen) for n in NAMES}
    start = write_safetensors(folder / "model.safetensors", tensors)
    return folder, start


def vllm_config(model: Path | str, hf_config: Any = None, load_format: str = "auto") -> Any:
    if hf_config is None:
        hf_config = json.loads((Path(model) / "config.json").read_text())
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), hf_config=hf_config, revision=None),
        load_config=SimpleNamespace(load_format=load_format, download_dir=None),
    )


def flip_float(path: Path, at: int) -> None:
    """Replace the float32 at byte offset ``at`` with another value."""
    data = bytearray(path.read_bytes())
    (value,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<f", data, at, value + 1.0)
    path.write_bytes(bytes(data))


def difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
    return _first_difference("model_identity", a, b)


def test_a_copy_elsewhere_has_the_same_identity(tmp_path: Path) -> None:
    a, _ = checkpoint(tmp_path)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "b")
    config_b = json.loads((copy / "config.json").read_text())
    config_b["_name_or_path"] = str(copy)  # where it lies is not identity
    mine = model_identity(vllm_config(a))
    theirs = model_identity(vllm_config(copy, config_b))
    assert mine == theirs
    record = mine["weights"]["model.safetensors"]
    assert record["size"] == (a / "model.safetensors").stat().st_size
    assert len(record["header"]) == 64 and len(record["samples"]) == 64
    assert set(mine["config"]) == {
        "architectures",
        "model_type",
        "hidden_size",
        "num_experts",
        "rope_scaling",
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_experts", 16), ("rope_scaling", {"type": "yarn", "factor": 4.0}), ("norm_topk", True)],
)
def test_a_changed_config_value_is_named_by_its_key(tmp_path: Path, key: str, value: Any) -> None:
    a, _ = checkpoint(tmp_path)
    changed = dict(CONFIG, **{key: value})
    found = difference(model_identity(vllm_config(a)), model_identity(vllm_config(a, changed)))
    assert found == (f"model_identity.config.{key}", CONFIG.get(key), value)


def test_cosmetic_and_runtime_config_keys_are_ignored() -> None:
    changed = dict(
        CONFIG,
        _name_or_path="/elsewhere",
        transformers_version="5.0.0",
        torch_dtype="bfloat16",
        dtype="bfloat16",
        _attn_implementation="sdpa",
    )
    assert config_identity(changed) == config_identity(CONFIG)


def test_config_values_become_json_that_afd_core_accepts() -> None:
    nested = SimpleNamespace(to_dict=lambda: {"hidden_size": 8, "torch_dtype": torch.float16})
    identity = config_identity(
        {"rope_theta": float("inf"), "text_config": nested, "dims": (1, 2), "dt": torch.float32}
    )
    assert identity == {
        "dims": [1, 2],
        "dt": "torch.float32",
        "rope_theta": "inf",
        "text_config": {"hidden_size": 8},
    }
    conn = P2PConnector(
        AFDConfig(role=AFDRole.FFN),
        payload_spec=AFDPayloadSpec(hidden_size=8, dtype=torch.float32),
        num_layers=1,
        model_identity={"config": identity},
    )
    assert conn.handshake_fields()["model_identity"] == {"config": identity}


def test_a_real_hf_config_is_identified_by_its_fields() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.PretrainedConfig(num_experts=8, hidden_size=64)
    other = transformers.PretrainedConfig(num_experts=8, hidden_size=64)
    other._name_or_path = "/elsewhere"
    assert config_identity(cfg) == config_identity(other)
    assert config_identity(cfg)["num_experts"] == 8
    other.num_experts = 4
    assert difference({"config": config_identity(cfg)}, {"config": config_identity(other)}) == (
        "model_identity.config.num_experts",
        8,
        4,
    )


def test_a_weight_changed_inside_a_sampled_window_is_detected(tmp_path: Path) -> None:
    a, start = checkpoint(tmp_path)
    b = shutil.copytree(a, tmp_path / "b")
    data_len = (a / "model.safetensors").stat().st_size - start
    windows = sample_windows(data_len)
    assert len(windows) == SAMPLE_WINDOWS
    # The first value of the first tensor, and one in the middle window.
    for at in (start, start + windows[SAMPLE_WINDOWS // 2][0] + 8):
        flip_float(b / "model.safetensors", at)
        found = difference(model_identity(vllm_config(a)), model_identity(vllm_config(b)))
        assert found is not None
        assert found[0] == "model_identity.weights['model.safetensors'].samples"
        shutil.copy(a / "model.safetensors", b / "model.safetensors")


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="documented limit of the model identity: only SAMPLE_WINDOWS windows of SAMPLE_BYTES "
    "of each weight file's data are hashed, so a weight changed between two windows is missed",
)
def test_a_weight_changed_outside_every_window_is_detected(tmp_path: Path) -> None:
    a, start = checkpoint(tmp_path)
    b = shutil.copytree(a, tmp_path / "b")
    data_len = (a / "model.safetensors").stat().st_size - start
    first, second = sample_windows(data_len)[:2]
    gap = first[0] + first[1]
    # Preconditions fail the test outright (pytest.fail is not the AssertionError xfail expects).
    if gap + 4 > second[0]:
        pytest.fail(f"no gap of a float between the first two windows: {first}, {second}")
    flip_float(b / "model.safetensors", start + gap)
    if (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes():
        pytest.fail("the weight file did not change")
    found = difference(model_identity(vllm_config(a)), model_identity(vllm_config(b)))
    assert found is not None
    assert found[0] == "model_identity.weights['model.safetensors'].samples"


def test_a_changed_header_and_an_extra_shard_are_named(tmp_path: Path) -> None:
    a, _ = checkpoint(tmp_path)
    b = tmp_path / "b"
    b.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(ROWS, COLS, generator=gen) for n in NAMES}
    tensors["renamed.weight"] = tensors.pop("lm_head.weight")
    write_safetensors(b / "model.safetensors", tensors)
    found = difference(weights_identity(a), weights_identity(b))
    assert found is not None and found[0] == "model_identity['model.safetensors'].header"
    shutil.copy(a / "model.safetensors", b / "model.safetensors")
    write_safetensors(b / "model-extra.safetensors", {"x": torch.zeros(2)})
    found = difference(weights_identity(a), weights_identity(b))
    assert found is not None and found[0] == "model_identity['model-extra.safetensors']"
    assert found[1] is None


def test_small_files_are_read_whole_and_other_formats_have_no_header(tmp_path: Path) -> None:
    assert sample_windows(SAMPLE_WINDOWS * SAMPLE_BYTES) == [(0, SAMPLE_WINDOWS * SAMPLE_BYTES)]
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x01" * 100)
    identity = weights_identity(tmp_path)
    assert list(identity) == ["pytorch_model.bin"]
    assert identity["pytorch_model.bin"]["header"] is None
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x01" * 99 + b"\x02")
    assert weights_identity(tmp_path) != identity


def test_a_truncated_safetensors_header_is_refused_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(
        AFDModelError, match=r"header length': got 1048576; allowed: at most 2"
    ) as e:
        weight_file_identity(bad)
    assert str(e.value).endswith(f"({bad})")  # the file is named


def test_dummy_weights_and_an_uncached_repository(tmp_path: Path) -> None:
    dummy = model_identity(vllm_config(tmp_path / "absent", CONFIG, load_format="dummy"))
    assert dummy["weights"] == {"load_format": "dummy"}
    remote = model_identity(vllm_config("afd-test/not-a-cached-repo", CONFIG))
    assert remote["weights"] == {"unresolved": "afd-test/not-a-cached-repo@None"}


def test_the_config_taken_before_the_build_survives_what_the_build_rewrites(
    tmp_path: Path,
) -> None:
    """vLLM's DeepSeek attention rewrites the yarn ``rope_type`` it reads to ``deepseek_yarn``;
    only the Attention role builds attention. The roles take the config section before their
    build, so both publish the checkpoint's config; the weights are looked up after the load."""
    a, _ = checkpoint(tmp_path)
    hf_config = {**CONFIG, "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 40}}
    attention, ffn = vllm_config(a, copy.deepcopy(hf_config)), vllm_config(a, hf_config)
    taken = config_identity(attention.model_config.hf_config)
    attention.model_config.hf_config["rope_scaling"]["rope_type"] = "deepseek_yarn"  # the build
    assert model_identity(attention, taken) == model_identity(ffn)
    found = difference(model_identity(attention), model_identity(ffn))
    assert found is not None and found[0] == "model_identity.config.rope_scaling.rope_type"
