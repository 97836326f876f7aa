"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, text model): roles against the real vLLM 0.32 class.

A tiny random Qwen3.5-MoE checkpoint (hybrid layers: Gated DeltaNet linear attention and full
attention; every layer sparse, with a gated shared expert) is loaded through vLLM's own loader
three ways: plain (no AFD config), Attention role and FFN role, for both gate placements.
Checked exactly (``torch.equal``): which tensors each role holds, that the two roles partition
the plain model's parameters, and that one MoE layer computed the AFD way (Attention block,
FFN model through the runtime's native compute in-process) equals the plain model's block.

vLLM's ``qwen3_5`` module imports torchvision through the vision stack; see
``afd_models_adapter_kit.import_qwen3_5`` for the test-only stub of that one import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).parent))

import afd_models_adapter_kit as kit
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_models._weight_utils import WeightOwner

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(600)]

H, I_MOE, I_SHARED, E, K, LAYERS, VOCAB = 32, 16, 16, 4, 2, 2, 128


def _hf_config() -> dict[str, Any]:
    from transformers import Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=I_MOE,
        shared_expert_intermediate_size=I_SHARED,
        full_attention_interval=2,
        max_position_embeddings=256,
        architectures=["Qwen3_5MoeForCausalLM"],
    )
    return cfg.to_dict()  # type: ignore[no-any-return]


def _tensors() -> dict[str, torch.Tensor]:
    """Checkpoint names and shapes of the tiny model (per-expert routed tensors), random."""
    gen = torch.Generator().manual_seed(3)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (VOCAB, H),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        if i % 2 == 0:  # linear attention (Gated DeltaNet)
            a = p + "linear_attn."
            shapes.update(
                {
                    a + "dt_bias": (2,),
                    a + "A_log": (2,),
                    a + "conv1d.weight": (48, 1, 4),
                    a + "norm.weight": (8,),
                    a + "out_proj.weight": (H, 16),
                    a + "in_proj_qkv.weight": (48, H),
                    a + "in_proj_z.weight": (16, H),
                    a + "in_proj_b.weight": (2, H),
                    a + "in_proj_a.weight": (2, H),
                }
            )
        else:  # full attention (gated query: q_proj holds query and gate)
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (2 * 2 * 16, H),
                    a + "k_proj.weight": (16, H),
                    a + "v_proj.weight": (16, H),
                    a + "o_proj.weight": (H, 2 * 16),
                    a + "q_norm.weight": (16,),
                    a + "k_norm.weight": (16,),
                }
            )
        m = p + "mlp."
        shapes[m + "gate.weight"] = (E, H)
        shapes[m + "shared_expert_gate.weight"] = (1, H)
        shapes[m + "shared_expert.gate_proj.weight"] = (I_SHARED, H)
        shapes[m + "shared_expert.up_proj.weight"] = (I_SHARED, H)
        shapes[m + "shared_expert.down_proj.weight"] = (H, I_SHARED)
        for j in range(E):
            shapes[f"{m}experts.{j}.gate_proj.weight"] = (I_MOE, H)
            shapes[f"{m}experts.{j}.up_proj.weight"] = (I_MOE, H)
            shapes[f"{m}experts.{j}.down_proj.weight"] = (H, I_MOE)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
    return {n: torch.randn(s, generator=gen) * 0.2 for n, s in shapes.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], tuple[Any, Any]]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kit.import_qwen3_5()
    import afd_models.plugin as plugin
    from afd_models.models.qwen3_5_moe import AFDQwen3_5MoeForCausalLM
    from vllm import ModelRegistry

    plugin.register()
    # The class object, not the plugin's lazy "module:Class" string: vLLM inspects a string
    # registration in a fresh subprocess, where the vision import would fail.
    ModelRegistry.register_model("Qwen3_5MoeForCausalLM", AFDQwen3_5MoeForCausalLM)
    path = kit.write_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), _hf_config(), _tensors())
    kit.init_vllm_distributed(kit.engine_config(path, None))
    out: dict[tuple[str, bool], tuple[Any, Any]] = {("plain", False): kit.load(path, None)}
    for gate_on_attention in (False, True):
        for role in ("attention", "ffn"):
            afd = {"role": role, "port": 1, "compute_gate_on_attention": gate_on_attention}
            out[(role, gate_on_attention)] = kit.load(path, afd)
    return out


def _params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_classifier_routes_checkpoint_names() -> None:
    kit.import_qwen3_5()
    from afd_models.models.qwen3_5_moe import qwen3_5_moe_classifier

    names = {
        "model.layers.0.mlp.experts.3.down_proj.weight": (WeightOwner.FFN, WeightOwner.FFN),
        "model.layers.0.mlp.gate.weight": (WeightOwner.FFN, WeightOwner.ATTENTION),
        "model.layers.0.mlp.shared_expert.up_proj.weight": (WeightOwner.ATTENTION,) * 2,
        "model.layers.0.mlp.shared_expert_gate.weight": (WeightOwner.ATTENTION,) * 2,
        "model.layers.0.linear_attn.in_proj_qkv.weight": (WeightOwner.ATTENTION,) * 2,
        "model.language_model.layers.1.mlp.experts.0.up_proj.weight": (WeightOwner.FFN,) * 2,
        "mtp.layers.0.mlp.experts.0.up_proj.weight": (WeightOwner.NONE,) * 2,
        "lm_head.weight": (WeightOwner.ATTENTION,) * 2,
    }
    on_ffn, on_attn = qwen3_5_moe_classifier(False), qwen3_5_moe_classifier(True)
    for name, (want_ffn_gate, want_attn_gate) in names.items():
        assert on_ffn(name) is want_ffn_gate, name
        assert on_attn(name) is want_attn_gate, name


def test_plain_config_builds_the_upstream_model(
    models: dict[tuple[str, bool], tuple[Any, Any]],
) -> None:
    from vllm.model_executor.models.qwen3_next import Qwen3NextSparseMoeBlock

    _, plain = models[("plain", False)]
    assert all(isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in plain.model.layers)
    assert plain._afd_classify is None
    assert plain.num_moe_layers == LAYERS  # upstream's set_moe_parameters ran


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_hold_only_their_modules(
    models: dict[tuple[str, bool], tuple[Any, Any]], gate_on_attention: bool
) -> None:
    _, attn_model = models[("attention", gate_on_attention)]
    _, ffn_model = models[("ffn", gate_on_attention)]
    attn, ffn = _params(attn_model), _params(ffn_model)
    assert not [n for n in attn if ".experts." in n]
    assert all(".mlp.experts." in n or ".mlp.gate." in n for n in ffn), sorted(ffn)
    assert {n for n in ffn if ".experts." in n} == {
        f"model.layers.{i}.mlp.experts.routed_experts.{w}"
        for i in range(LAYERS)
        for w in ("w13_weight", "w2_weight")
    }
    gate = {f"model.layers.{i}.mlp.gate.weight" for i in range(LAYERS)}
    assert (gate <= set(attn)) is gate_on_attention
    assert (gate <= set(ffn)) is not gate_on_attention
    assert any(".linear_attn." in n for n in attn) and any(".self_attn." in n for n in attn)
    assert any(".shared_expert." in n for n in attn)
    assert attn_model.afd_moe_layer_indices == ffn_model.afd_moe_layer_indices == (0, 1)
    spec = attn_model.afd_payload_spec
    assert spec == ffn_model.afd_payload_spec and not spec.input_ids
    assert (spec.router_logits_width == E) is gate_on_attention
    assert attn_model.num_local_physical_experts == 0 and attn_model.moe_layers == []


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_partition_the_plain_parameters_exactly(
    models: dict[tuple[str, bool], tuple[Any, Any]], gate_on_attention: bool
) -> None:
    plain = _params(models[("plain", False)][1])
    attn = _params(models[("attention", gate_on_attention)][1])
    ffn = _params(models[("ffn", gate_on_attention)][1])
    assert set(attn).isdisjoint(ffn)
    assert set(attn) | set(ffn) == set(plain)
    for name, tensor in {**attn, **ffn}.items():
        assert torch.equal(tensor, plain[name]), name
    ffn_model = models[("ffn", gate_on_attention)][1]
    assert ffn_model.afd_filter_stats.kept == (LAYERS * 3 * E + (0 if gate_on_attention else 2))


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_afd_moe_layer_equals_plain_layer(
    models: dict[tuple[str, bool], tuple[Any, Any]], gate_on_attention: bool
) -> None:
    """FFN numeric test: shared expert on Attention + routed experts on the FFN model (the
    runtime's native compute) == upstream's Qwen3NextSparseMoeBlock, on random inputs."""
    from afd_runtime.workers.base import _vllm_forward_context

    plain_cfg, plain = models[("plain", False)]
    _, attn = models[("attention", gate_on_attention)]
    ffn_cfg, ffn = models[("ffn", gate_on_attention)]
    hidden = torch.randn(7, H, generator=torch.Generator().manual_seed(11))
    for layer in (0, 1):
        with torch.inference_mode():
            with _vllm_forward_context(plain_cfg, 7):
                want = plain.model.layers[layer].mlp(hidden.clone())
            # The FFN role's model served by the runtime's FFN service (in-process connector).
            served = kit.ServedFFN(attn.afd_payload_spec, [(ffn_cfg, ffn)], (layer,))
            with served, served.step(7) as connector:
                meta = AFDForwardMetadata(connector=connector, num_tokens=(7,))
                with set_afd_forward_metadata(meta):
                    got = attn.model.layers[layer].mlp(hidden.clone())
        assert served.computes[0].calls == [(layer, 7)]
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
