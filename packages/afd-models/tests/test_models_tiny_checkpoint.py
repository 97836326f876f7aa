"""Tiny checkpoints: determinism, cache, layout (checked by transformers) and usable tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from afd_models.demo.tiny import (
    CORPUS,
    CORRECTION_BIAS_SUFFIX,
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


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(TinySpec("deepseek_v3"), tmp_path_factory.mktemp("cache"))


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
    [
        ({"family": "llama"}, "family"),
        ({"seed": -1}, "seed"),
        ({"dtype": "int8"}, "dtype"),
        ({"family": "qwen3_moe", "mtp_layers": 1}, "mtp_layers"),
        ({"family": "deepseek_v3", "mtp_layers": 3}, "mtp_layers"),
    ],
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


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3"])
def test_transformers_loads_every_tensor_and_greedy_text_varies(
    family: str, qwen_dir: Path, deepseek_dir: Path, deepseek_v3_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = {"qwen3_moe": qwen_dir, "deepseek_v2": deepseek_dir}.get(family, deepseek_v3_dir)
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


def _v3_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_deepseek_v3_config_has_v3_routing_q_lora_and_cpu_mla_sizes(deepseek_v3_dir: Path) -> None:
    cfg = json.loads((deepseek_v3_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert cfg["routed_scaling_factor"] == 2.5
    assert cfg["norm_topk_prob"] is True
    assert (cfg["n_routed_experts"], cfg["n_group"], cfg["topk_group"]) == (8, 4, 2)
    assert cfg["num_experts_per_tok"] == 2
    assert cfg["q_lora_rank"] == 64
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (128, 4)
    assert (cfg["first_k_dense_replace"], cfg["n_shared_experts"]) == (1, 1)


def test_deepseek_v3_tensors_names_shapes_and_nonzero_bias(deepseek_v3_dir: Path) -> None:
    t = _v3_tensors(deepseek_v3_dir)
    for layer in range(4):
        p = f"model.layers.{layer}."
        assert t[p + "self_attn.q_a_proj.weight"].shape == (64, 128)
        assert t[p + "self_attn.q_a_layernorm.weight"].shape == (64,)
        assert t[p + "self_attn.q_b_proj.weight"].shape == (4 * (32 + 64), 64)
        assert p + "self_attn.q_proj.weight" not in t
        assert t[p + "self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 128)
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (256, 128)
    assert not any(n.startswith("model.layers.0.mlp.gate.") for n in t)
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in t)
    biases = []
    for layer in (1, 2, 3):
        p = f"model.layers.{layer}.mlp."
        assert t[p + "gate.weight"].shape == (8, 128)
        assert t[p + "experts.7.down_proj.weight"].shape == (128, 64)
        assert t[p + "shared_experts.gate_proj.weight"].shape == (64, 128)
        bias = t[p + "gate.e_score_correction_bias"]
        assert bias.shape == (8,) and bias.dtype == torch.float32
        assert float(bias.abs().min()) > 0.0 and len(set(bias.tolist())) == 8
        biases.append(bias)
    assert not torch.equal(biases[0], biases[1])
    assert sum(n.endswith(CORRECTION_BIAS_SUFFIX) for n in t) == 3


def test_deepseek_v3_is_deterministic_and_other_families_keep_their_bytes(
    tmp_path: Path, deepseek_v3_dir: Path, deepseek_dir: Path
) -> None:
    again = write_tiny_checkpoint(TinySpec("deepseek_v3"), tmp_path / "v3")
    assert checkpoint_digest(again) == checkpoint_digest(deepseek_v3_dir)
    # The V3 family adds tensors of its own; V2's checkpoint has neither q_lora nor the bias.
    v2 = _v3_tensors(deepseek_dir)
    assert not any(n.endswith(CORRECTION_BIAS_SUFFIX) or "q_a_proj" in n for n in v2)
    assert spec_hash(TinySpec("deepseek_v3")) != spec_hash(TinySpec("deepseek_v2"))


def _noaux_tc_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, n_group: int, topk_group: int, k: int
) -> torch.Tensor:
    """DeepSeek-V3's selection (the model card's definition): sigmoid scores plus bias; a group
    scores the sum of its best two; experts of the best ``topk_group`` groups compete."""
    scores = logits.sigmoid() + (bias if bias is not None else 0.0)
    n, e = scores.shape
    grouped = scores.view(n, n_group, e // n_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group).indices, 1.0)
    mask = keep.unsqueeze(-1).expand_as(grouped).reshape(n, e).bool()
    return scores.masked_fill(~mask, float("-inf")).topk(k).indices.sort(dim=-1).values


def test_deepseek_v3_router_makes_grouping_and_bias_change_expert_choices(
    deepseek_v3_dir: Path,
) -> None:
    """On the checkpoint's own router and embeddings, both the group restriction and the
    correction bias change which experts some tokens get: neither feature is a no-op here."""
    t = _v3_tensors(deepseek_v3_dir)
    x = t["model.embed_tokens.weight"]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for layer in (1, 2, 3):
        p = f"model.layers.{layer}.mlp.gate."
        logits = x @ t[p + "weight"].T
        bias = t[p + "e_score_correction_bias"]
        full = _noaux_tc_topk(logits, bias, 4, 2, 2)
        ungrouped = _noaux_tc_topk(logits, bias, 1, 1, 2)
        unbiased = _noaux_tc_topk(logits, None, 4, 2, 2)
        assert (full != ungrouped).any(dim=-1).float().mean() > 0.01, layer
        assert (full != unbiased).any(dim=-1).float().mean() > 0.05, layer


def test_wide_qwen3_moe_config_and_refusals() -> None:
    from afd_models.demo.tiny import WIDE_QWEN3_MOE, TinySpec, model_config, spec_hash

    wide = model_config(TinySpec(width="wide"), 100)
    assert {k: wide[k] for k in WIDE_QWEN3_MOE} == WIDE_QWEN3_MOE
    assert wide["num_experts"] == 8 and wide["num_hidden_layers"] == 4
    assert spec_hash(TinySpec(width="wide")) != spec_hash(TinySpec())
    with pytest.raises(ValueError, match="width='wide' with family='deepseek_v2'"):
        TinySpec(family="deepseek_v2", width="wide")
    with pytest.raises(ValueError, match=r"TinySpec\.width='huge'"):
        TinySpec(width="huge")  # type: ignore[arg-type]


def test_mtp_layer_tensors_follow_the_decoder_layers() -> None:
    """DeepSeek-V3 with one MTP layer: layer ``num_hidden_layers`` is a full MoE decoder layer
    plus the MTP modules, named as DeepSeek's checkpoints name them; no MTP, no such layer."""
    from afd_models.demo.tiny import model_config, tensor_shapes

    cfg = model_config(TinySpec("deepseek_v3", mtp_layers=1), 100)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert cfg["num_nextn_predict_layers"] == 1
    shapes = tensor_shapes(cfg)
    p = f"model.layers.{n}."
    assert shapes[p + "eh_proj.weight"] == (h, 2 * h)
    assert shapes[p + "shared_head.head.weight"] == (100, h)
    assert {p + "enorm.weight", p + "hnorm.weight", p + "shared_head.norm.weight"} <= set(shapes)
    assert p + "mlp.experts.7.down_proj.weight" in shapes
    assert p + "self_attn.kv_b_proj.weight" in shapes
    plain = tensor_shapes(model_config(TinySpec("deepseek_v3"), 100))
    assert not any(k.startswith(p) for k in plain)
    assert set(plain) < set(shapes)


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """DeepSeek-V3 with one MTP layer: random draft weights and ``draft="accepting"``."""
    cache = tmp_path_factory.mktemp("cache")
    random = ensure_tiny_checkpoint(TinySpec("deepseek_v3", mtp_layers=1), cache)
    accepting = ensure_tiny_checkpoint(
        TinySpec("deepseek_v3", mtp_layers=1, draft="accepting"), cache
    )
    return random, accepting


def test_accepting_draft_spec_hash_name_and_refusals() -> None:
    default = TinySpec("deepseek_v3", mtp_layers=1)
    accepting = TinySpec("deepseek_v3", mtp_layers=1, draft="accepting")
    assert default.draft == "random"
    assert spec_hash(accepting) != spec_hash(default)
    # The default spec's cache key is the one checkpoints were cached under before the option.
    assert spec_hash(default) == "81e92d36a8b4ae08"
    with pytest.raises(ValueError, match=r"TinySpec\.draft='accepting' with mtp_layers=0"):
        TinySpec("deepseek_v3", draft="accepting")
    with pytest.raises(ValueError, match=r"TinySpec\.draft='copy'"):
        TinySpec("deepseek_v3", mtp_layers=1, draft="copy")  # type: ignore[arg-type]


def test_accepting_draft_changes_only_the_intended_tensors(mtp_dirs: tuple[Path, Path]) -> None:
    from afd_models.demo.tiny import (
        ACCEPTING_DRAFT_BLOCK_SCALE,
        ACCEPTING_HIDDEN_SCALE,
        ACCEPTING_TARGET_SCALE,
    )

    random_dir, accepting_dir = mtp_dirs
    assert "-accepting-" in accepting_dir.name and "-accepting-" not in random_dir.name
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (random_dir / name).read_bytes() == (accepting_dir / name).read_bytes(), name
    r, a = _v3_tensors(random_dir), _v3_tensors(accepting_dir)
    assert set(r) == set(a)
    cfg = json.loads((random_dir / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    p = f"model.layers.{n}."
    changed = set()
    for name in sorted(r):
        if torch.equal(r[name], a[name]):
            continue
        changed.add(name)
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            scale = ACCEPTING_TARGET_SCALE if layer < n else ACCEPTING_DRAFT_BLOCK_SCALE
            torch.testing.assert_close(a[name], r[name] * scale)
            assert float(a[name].abs().max()) > 0.0, name  # small, never zero
    # Every decoder layer's output projections, the MTP block's included, and nothing else
    # of the decoder layers.
    scaled = {x for x in changed if x.endswith(("o_proj.weight", "down_proj.weight"))}
    assert {int(x.split(".")[2]) for x in scaled} == set(range(n + 1))
    assert any(".experts.0.down_proj" in x for x in scaled)
    assert any("shared_experts.down_proj" in x for x in scaled)
    assert "model.layers.0.mlp.down_proj.weight" in scaled
    assert changed - scaled == {p + "eh_proj.weight", p + "shared_head.head.weight"}
    # eh_proj: the identity on the embedding half, the random matrix scaled on the hidden half.
    eh = a[p + "eh_proj.weight"]
    assert torch.equal(eh[:, :h], torch.eye(h))
    torch.testing.assert_close(eh[:, h:], r[p + "eh_proj.weight"][:, h:] * ACCEPTING_HIDDEN_SCALE)
    # The shared head is the target's: the same norm (ones) and a copy of lm_head.
    assert torch.equal(a[p + "shared_head.head.weight"], a["lm_head.weight"])
    for norm in ("shared_head.norm", "enorm", "hnorm"):
        assert torch.equal(a[p + norm + ".weight"], a["model.norm.weight"]), norm
    assert torch.equal(a[p + "embed_tokens.weight"], a["model.embed_tokens.weight"])


def test_accepting_draft_target_is_near_the_bigram_the_draft_predicts(
    mtp_dirs: tuple[Path, Path],
) -> None:
    """The target's next token (transformers, at every position of the demo prompts and the
    corpus as one text) is mostly the bigram
    ``argmax lm_head(norm(embed(t)))`` of the current token ``t``, which the draft layer predicts
    when its block is ignored; with random weights it (nearly) never is. The layers still change
    some tokens, so the target is not a pure bigram."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    rates = []
    for path in mtp_dirs:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tok = AutoTokenizer.from_pretrained(path)
        t = _v3_tensors(path)
        p = f"model.layers.{model.config.num_hidden_layers}."
        eh, head = t[p + "eh_proj.weight"], t[p + "shared_head.head.weight"]
        h = model.config.hidden_size
        seq = tok(" ".join((*DEMO_PROMPTS, *CORPUS)), return_tensors="pt").input_ids[0]
        with torch.no_grad():
            target = model(seq[None]).logits[0].argmax(-1)
        draft = rms(rms(t["model.embed_tokens.weight"][seq]) @ eh[:, :h].T) @ head.T
        rates.append(float((draft.argmax(-1) == target).float().mean()))
    random_rate, accepting_rate = rates
    assert random_rate < 0.1, rates
    assert 0.4 < accepting_rate < 0.95, rates
