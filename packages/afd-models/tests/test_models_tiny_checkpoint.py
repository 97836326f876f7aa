"""Tiny checkpoints: determinism, cache, layout (checked by transformers) and usable tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from afd_models.demo.tiny import (
    DEMO_PROMPTS,
    TinySpec,
    checkpoint_digest,
    ensure_tiny_checkpoint,
    make_tensor,
    spec_hash,
    write_tiny_checkpoint,
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(TinySpec("qwen3_moe"), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(TinySpec("deepseek_v2"), tmp_path_factory.mktemp("cache"))


def test_same_spec_gives_byte_identical_files(tmp_path: Path, qwen_dir: Path) -> None:
    again = write_tiny_checkpoint(TinySpec("qwen3_moe"), tmp_path / "again")
    names = sorted(p.name for p in qwen_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (qwen_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert checkpoint_digest(qwen_dir) == checkpoint_digest(again)


def test_other_seed_changes_weights_only(tmp_path: Path, qwen_dir: Path) -> None:
    other = write_tiny_checkpoint(TinySpec("qwen3_moe", seed=1), tmp_path / "s1")
    assert (other / "model.safetensors").read_bytes() != (
        qwen_dir / "model.safetensors"
    ).read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (qwen_dir / "tokenizer.json").read_bytes()
    assert spec_hash(TinySpec("qwen3_moe", seed=1)) != spec_hash(TinySpec("qwen3_moe"))


def test_cache_reuses_the_directory(qwen_dir: Path) -> None:
    before = (qwen_dir / "model.safetensors").stat().st_mtime_ns
    again = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), qwen_dir.parent)
    assert again == qwen_dir
    assert (again / "model.safetensors").stat().st_mtime_ns == before
    assert spec_hash(TinySpec("qwen3_moe")) in qwen_dir.name
    assert [p.name for p in qwen_dir.parent.iterdir() if p.name.startswith(".")] == []


def test_write_refuses_existing_checkpoint(qwen_dir: Path) -> None:
    with pytest.raises(FileExistsError, match="out_dir"):
        write_tiny_checkpoint(TinySpec("qwen3_moe"), qwen_dir)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"family": "llama"}, "family"), ({"seed": -1}, "seed"), ({"dtype": "int8"}, "dtype")],
)
def test_spec_validation_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"TinySpec.{field}="):
        TinySpec(**kwargs)  # type: ignore[arg-type]


def test_tensor_init_is_scaled_and_deterministic() -> None:
    a = make_tensor(0, "model.layers.0.self_attn.q_proj.weight", (128, 128), "float32")
    b = make_tensor(0, "model.layers.0.self_attn.q_proj.weight", (128, 128), "float32")
    c = make_tensor(0, "model.layers.1.self_attn.q_proj.weight", (128, 128), "float32")
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert 0.05 < float(a.std()) < 0.15  # ~ 1/sqrt(128)
    assert torch.equal(make_tensor(0, "model.norm.weight", (8,), "float32"), torch.ones(8))


def test_deepseek_config_fits_cpu_mla_and_has_dense_and_moe_layers(deepseek_dir: Path) -> None:
    cfg = json.loads((deepseek_dir / "config.json").read_text())
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert cfg["first_k_dense_replace"] >= 1
    assert cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] >= 2
    assert cfg["n_shared_experts"] >= 1
    assert cfg["n_routed_experts"] == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_transformers_loads_every_tensor_and_greedy_text_varies(
    family: str, qwen_dir: Path, deepseek_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = qwen_dir if family == "qwen3_moe" else deepseek_dir
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size
    assert tok.eos_token_id == model.config.eos_token_id
    outs = []
    for prompt in DEMO_PROMPTS[:3]:
        ids = tok(prompt, return_tensors="pt").input_ids
        assert tok.decode(ids[0]) == prompt
        gen = model.generate(ids, max_new_tokens=6, do_sample=False)
        new = tuple(gen[0, ids.shape[1] :].tolist())
        assert len(set(new)) > 1, f"degenerate greedy output {new} for {prompt!r}"
        outs.append(new)
    assert len(set(outs)) == len(outs)
