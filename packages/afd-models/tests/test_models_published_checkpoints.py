"""The published-config fixtures: configs as published but for their sizes, tensors under the
published names.

* Scaling changes only :data:`~afd_models.demo.published.SIZE_KEYS`; every other key, including
  keys vLLM ignores, stays as published, and what routing needs still holds (experts divisible by
  ``n_group``, room for the top-k in the groups kept, MLA's 576-wide latent).
* The builder's tensor names equal the names of the model's published checkpoint (recorded from
  its ``model.safetensors.index.json`` in ``published/<key>.weights.txt``): the non-layer
  tensors, a dense layer, the first MoE layer (experts 0 and 1) and the MTP layer, matched by
  their place in the model (published layer 3 of DeepSeek-V3 is the scaled model's layer 1).
  Quantization scales are left out of the comparison (no quantized tensor is written: those
  configs are refused before any engine starts), and so are buffers vLLM recomputes
  (``rotary_emb.inv_freq``).
* Every SOURCES.md row names a file that exists, and every config has a row.
"""

from __future__ import annotations

import json
import re

import pytest
from afd_models.demo.published import (
    PUBLISHED_DIR,
    SIZE_KEYS,
    PublishedSpec,
    ensure_published_checkpoint,
    published_config,
    published_keys,
    published_weight_names,
)
from afd_models.demo.tiny import tensor_shapes

#: ``<key>.weights.txt`` -> the config whose builder names it is compared with (the names come
#: from a sibling checkpoint of the same architecture where the config's own index was not found,
#: see SOURCES.md).
NAMES_OF = {
    "deepseek-v3": "deepseek-v3",
    "deepseek-v2-lite": "deepseek-v2-lite-chat",
    "kimi-k2-instruct": "kimi-k2-instruct",
    "qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen3-30b-a3b-fp8": "qwen3-30b-a3b-fp8",
    "glm-4.5-fp8": "glm-4.7",
}
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _first_moe_layer(config: dict) -> int:
    if config["model_type"] == "qwen3_moe":
        return 0
    return int(config["first_k_dense_replace"])


def _place(config: dict, layer: int) -> str:
    """What a layer index is in ``config``'s model: dense, first MoE, MTP, or another layer."""
    if layer == int(config["num_hidden_layers"]):
        return "mtp"
    if layer == _first_moe_layer(config):
        return "moe"
    return "dense" if layer == 0 else f"other{layer}"


def _normalised(config: dict, names: list[str]) -> set[str]:
    """Names with the layer index replaced by its place, quantization scales and recomputed
    buffers dropped, experts beyond 1 dropped, other layers dropped."""
    out = set()
    for name in names:
        if name.endswith(SCALE_SUFFIXES) or name.endswith("rotary_emb.inv_freq"):
            continue
        expert = _EXPERT.search(name)
        if expert and int(expert.group(1)) > 1:
            continue
        m = _LAYER.match(name)
        if m:
            place = _place(config, int(m.group(1)))
            if place.startswith("other"):
                continue
            name = f"model.layers.<{place}>." + name[m.end() :]
        out.add(name)
    return out


@pytest.mark.parametrize("key", published_keys())
def test_scaling_changes_only_sizes_and_keeps_routing_and_mla_valid(key: str) -> None:
    published = published_config(key)
    scaled = PublishedSpec(key).config(1024)
    changed = {k for k in published if scaled.get(k) != published[k]}
    assert changed <= SIZE_KEYS, changed - SIZE_KEYS
    assert set(scaled) == set(published)
    experts = (
        scaled.get("n_routed_experts")
        or scaled.get("num_experts")
        or scaled.get("num_local_experts")
    )
    groups = int(scaled.get("n_group") or 1)
    assert experts % groups == 0
    kept = int(scaled.get("topk_group") or groups)
    assert int(scaled["num_experts_per_tok"]) <= kept * experts // groups
    if scaled.get("kv_lora_rank") is not None:
        assert scaled["kv_lora_rank"] + scaled["qk_rope_head_dim"] == 576
    if "num_key_value_heads" in published:
        mha = published["num_key_value_heads"] == published["num_attention_heads"]
        assert (scaled["num_key_value_heads"] == scaled["num_attention_heads"]) == mha


@pytest.mark.parametrize(("names_key", "config_key"), sorted(NAMES_OF.items()))
def test_builder_names_equal_the_published_checkpoint_names(
    names_key: str, config_key: str
) -> None:
    published_names = published_weight_names(names_key)
    assert published_names, f"{names_key}.weights.txt is missing"
    published = published_config(config_key)
    scaled = PublishedSpec(config_key).config(1024)
    built = list(tensor_shapes(scaled))
    assert _normalised(scaled, built) == _normalised(published, list(published_names))


def test_a_declared_mtp_layer_without_weights_is_written_without_it() -> None:
    config = PublishedSpec("deepseek-v3").config(1024)
    assert config["num_nextn_predict_layers"] == 1
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert any(n.startswith(mtp) for n in tensor_shapes(config))
    assert not any(n.startswith(mtp) for n in tensor_shapes(config, draft_weights=False))


def test_a_dequantized_config_drops_only_the_quantization_config() -> None:
    quantized = PublishedSpec("deepseek-v3").config(1024)
    dequantized = PublishedSpec("deepseek-v3", dequantized=True).config(1024)
    assert quantized.pop("quantization_config")["quant_method"] == "fp8"
    assert quantized == dequantized


def test_the_checkpoint_is_deterministic_and_keeps_the_published_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = PublishedSpec("qwen3-235b-a22b")
    a = ensure_published_checkpoint(spec, tmp_path / "a")
    b = ensure_published_checkpoint(spec, tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    written = json.loads((a / "config.json").read_text())
    assert set(written) == set(published_config("qwen3-235b-a22b"))


def test_every_published_file_has_its_source_recorded() -> None:
    sources = (PUBLISHED_DIR / "SOURCES.md").read_text()
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", sources, re.M)}
    for path in PUBLISHED_DIR.iterdir():
        if path.name == "SOURCES.md":
            continue
        key = path.name.removesuffix(".config.json").removesuffix(".weights.txt")
        assert key in rows, f"{path.name} has no row in SOURCES.md"


def test_qwen3_235b_scales_to_qwen3_30b_so_one_checkpoint_serves_both() -> None:
    """The E2E cases serve Qwen3-30B-A3B only: the two published configs differ only in sizes.
    If scaling ever keeps a difference, this fails and Qwen3-235B-A22B needs cases of its own."""
    assert PublishedSpec("qwen3-235b-a22b").config(1024) == PublishedSpec("qwen3-30b-a3b").config(
        1024
    )


def test_deepseek_r1_differs_from_deepseek_v3_only_in_keys_vllm_does_not_read() -> None:
    """DeepSeek-R1's config is DeepSeek-V3's plus training-only keys: the DeepSeek-V3 cases serve
    what an R1 checkpoint serves. If another key ever differs, R1 needs cases of its own."""
    training_only = {"aux_loss_alpha", "seq_aux", "pretraining_tp", "transformers_version"}
    v3, r1 = published_config("deepseek-v3"), published_config("deepseek-r1")
    differing = {k for k in set(v3) | set(r1) if v3.get(k) != r1.get(k)}
    assert differing == training_only
