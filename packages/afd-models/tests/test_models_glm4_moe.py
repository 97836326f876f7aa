"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``): roles against the real vLLM 0.32 class.

A tiny random GLM-4.5-style checkpoint (published tensor names; grouped-query attention with
q/k/v bias, qk-norm and partial rotary; layer 0 dense (``first_k_dense_replace=1``), layers 1-2
sparse: sigmoid grouped top-k with ``e_score_correction_bias``, routed scaling 2.5, one shared
expert; one MTP layer after them) is loaded through vLLM's own loader: plain (no AFD config),
Attention role and FFN role for both gate placements, two expert-parallel FFN ranks, and the
MTP drafter (speculative method ``mtp``) plain and on the Attention role. Checked:

* which tensors each role holds (the correction bias where the experts are selected: the FFN
  role with one FFN rank, the Attention role with two), and that the roles partition the plain
  model's parameters exactly (``torch.equal``); the MTP layer's routed experts on the FFN role,
  the rest of it on the Attention role's drafter;
* one MoE layer computed the AFD way (Attention block, FFN model through the runtime's native
  compute in-process) equals the plain model's ``Glm4MoE`` block (``torch.equal``; expert
  parallel: up to the two ranks' summation order), the correction bias and the routed scaling
  (applied once) included.
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

H, I_DENSE, I_MOE, E, K, LAYERS, VOCAB = 32, 64, 16, 8, 2, 3, 128
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
MOE_LAYERS = (1, 2)
DRAFT = LAYERS  # the MTP layer's index
SCALE = 2.5
BIAS = ".mlp.gate.e_score_correction_bias"
SPEC = {"method": "mtp", "num_speculative_tokens": 1}


def _hf_config() -> dict[str, Any]:
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=I_DENSE,
        moe_intermediate_size=I_MOE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=E,
        n_shared_experts=1,
        num_experts_per_tok=K,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=SCALE,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        max_position_embeddings=256,
        rope_theta=10000.0,
        architectures=["Glm4MoeForCausalLM"],
    )
    return cfg.to_dict()  # type: ignore[no-any-return]


def _tensors() -> dict[str, torch.Tensor]:
    """Published GLM-4.5 checkpoint names (per-expert routed tensors), random."""
    gen = torch.Generator().manual_seed(5)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, H),
        "model.norm.weight": (H,),
        "lm_head.weight": (VOCAB, H),
    }
    for i in range(LAYERS + 1):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update(
            {
                a + "q_proj.weight": (q, H),
                a + "q_proj.bias": (q,),
                a + "k_proj.weight": (kv, H),
                a + "k_proj.bias": (kv,),
                a + "v_proj.weight": (kv, H),
                a + "v_proj.bias": (kv,),
                a + "o_proj.weight": (H, q),
                a + "q_norm.weight": (HEAD_DIM,),
                a + "k_norm.weight": (HEAD_DIM,),
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
            }
        )
        m = p + "mlp."
        if i == 0:  # dense
            shapes.update(
                {
                    m + "gate_proj.weight": (I_DENSE, H),
                    m + "up_proj.weight": (I_DENSE, H),
                    m + "down_proj.weight": (H, I_DENSE),
                }
            )
            continue
        shapes[m + "gate.weight"] = (E, H)
        shapes[m + "gate.e_score_correction_bias"] = (E,)
        for proj, shape in (("gate_proj", (I_MOE, H)), ("up_proj", (I_MOE, H))):
            shapes[f"{m}shared_experts.{proj}.weight"] = shape
        shapes[m + "shared_experts.down_proj.weight"] = (H, I_MOE)
        for j in range(E):
            shapes[f"{m}experts.{j}.gate_proj.weight"] = (I_MOE, H)
            shapes[f"{m}experts.{j}.up_proj.weight"] = (I_MOE, H)
            shapes[f"{m}experts.{j}.down_proj.weight"] = (H, I_MOE)
        if i == DRAFT:  # the MTP layer's own modules
            shapes.update(
                {
                    p + "enorm.weight": (H,),
                    p + "hnorm.weight": (H,),
                    p + "eh_proj.weight": (H, 2 * H),
                    p + "shared_head.norm.weight": (H,),
                    p + "shared_head.head.weight": (VOCAB, H),
                }
            )
    return {n: torch.randn(s, generator=gen) * 0.2 for n, s in shapes.items()}


Models = dict[tuple[str, bool], tuple[Any, Any]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import afd_models.plugin as plugin

    plugin.register()
    path = kit.write_checkpoint(tmp_path_factory.mktemp("glm4_moe"), _hf_config(), _tensors())
    kit.init_vllm_distributed(kit.engine_config(path, None))
    return path


@pytest.fixture(scope="module")
def models(checkpoint: Path) -> Models:
    out: Models = {("plain", False): kit.load(checkpoint, None)}
    for gate_on_attention in (False, True):
        for role in ("attention", "ffn"):
            afd = {"role": role, "port": 1, "compute_gate_on_attention": gate_on_attention}
            out[(role, gate_on_attention)] = kit.load(checkpoint, afd)
    return out


def _params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _is_draft(name: str) -> bool:
    return name.startswith(f"model.layers.{DRAFT}.")


def test_classifier_routes_checkpoint_names() -> None:
    from afd_models.models.glm4_moe import AFDGlm4MoeForCausalLM

    cfg = type("Cfg", (), {"num_hidden_layers": LAYERS})()
    f, a = WeightOwner.FFN, WeightOwner.ATTENTION
    names = {  # name: owner with (gate on FFN, gate on Attention, expert parallel)
        "model.layers.1.mlp.experts.3.down_proj.weight": (f, f, f),
        "model.layers.1.mlp.gate.weight": (f, a, a),
        "model.layers.1" + BIAS: (f, f, a),
        "model.layers.1.mlp.shared_experts.up_proj.weight": (a, a, a),
        "model.layers.1.self_attn.q_proj.bias": (a, a, a),
        "model.layers.0.self_attn.k_norm.weight": (a, a, a),
        "model.layers.0.mlp.gate_proj.weight": (a, a, a),
        f"model.layers.{DRAFT}.mlp.experts.0.up_proj.weight": (f, f, f),
        f"model.layers.{DRAFT}{BIAS}": (f, f, WeightOwner.NONE),
        f"model.layers.{DRAFT}.eh_proj.weight": (WeightOwner.NONE,) * 3,
        "lm_head.weight": (a, a, a),
    }
    classifiers = [
        AFDGlm4MoeForCausalLM._afd_classifier(cfg, False),
        AFDGlm4MoeForCausalLM._afd_classifier(cfg, True),
        AFDGlm4MoeForCausalLM._afd_classifier(cfg, True, attention_routes=True),
    ]
    for name, owners in names.items():
        assert [c(name) for c in classifiers] == list(owners), name


def test_plain_config_builds_the_upstream_model(models: Models) -> None:
    from vllm.model_executor.models.glm4_moe import Glm4MoE, Glm4MoeMLP

    _, plain = models[("plain", False)]
    assert type(plain.model.layers[0].mlp) is Glm4MoeMLP
    assert all(type(plain.model.layers[i].mlp) is Glm4MoE for i in MOE_LAYERS)
    assert plain._afd_classify is None
    assert plain.num_moe_layers == len(MOE_LAYERS) and len(plain.moe_mlp_layers) == 2


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_hold_only_their_modules(models: Models, gate_on_attention: bool) -> None:
    _, attn_model = models[("attention", gate_on_attention)]
    _, ffn_model = models[("ffn", gate_on_attention)]
    attn, ffn = _params(attn_model), _params(ffn_model)
    assert not [n for n in attn if ".experts." in n]
    assert all(".mlp.experts." in n or ".mlp.gate." in n for n in ffn), sorted(ffn)
    # The MTP layer's routed experts are served by the FFN role beside the target's.
    layers = (*MOE_LAYERS, DRAFT)
    assert {n for n in ffn if ".experts." in n} == {
        f"model.layers.{i}.mlp.experts.routed_experts.{w}"
        for i in layers
        for w in ("w13_weight", "w2_weight")
    }
    gate = {f"model.layers.{i}.mlp.gate.weight" for i in layers}
    target_gate = {f"model.layers.{i}.mlp.gate.weight" for i in MOE_LAYERS}
    assert gate & set(attn) == (target_gate if gate_on_attention else set())
    assert (gate <= set(ffn)) is not gate_on_attention
    # One FFN rank selects the experts: the correction bias loads there, whatever the gate.
    assert {n for n in ffn if n.endswith(BIAS)} == {f"model.layers.{i}{BIAS}" for i in layers}
    assert not [n for n in attn if n.endswith(BIAS)]
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.qkv_proj.bias"} <= (
        set(attn)
    )
    assert "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in attn
    assert "model.layers.0.mlp.gate_up_proj.weight" in attn
    assert not [n for n in attn if _is_draft(n)]  # the drafter's, not the target's
    assert attn_model.afd_moe_layer_indices == MOE_LAYERS
    assert ffn_model.afd_moe_layer_indices == (*MOE_LAYERS, DRAFT)
    assert attn_model.afd_draft_layer_indices == ffn_model.afd_draft_layer_indices == (DRAFT,)
    spec = attn_model.afd_payload_spec
    assert spec == ffn_model.afd_payload_spec
    assert (spec.router_logits_width == E) is gate_on_attention
    if gate_on_attention:
        assert spec.router_logits_dtype == torch.float32  # upstream's fp32 gate
    assert attn_model.num_local_physical_experts == 0 and attn_model.moe_layers == []
    assert attn_model.moe_mlp_layers == []


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_partition_the_plain_parameters_exactly(
    models: Models, gate_on_attention: bool
) -> None:
    plain = _params(models[("plain", False)][1])
    attn = _params(models[("attention", gate_on_attention)][1])
    ffn_model = models[("ffn", gate_on_attention)][1]
    ffn = {n: p for n, p in _params(ffn_model).items() if not _is_draft(n)}
    assert set(attn).isdisjoint(ffn)
    assert set(attn) | set(ffn) == set(plain)
    for name, tensor in {**attn, **ffn}.items():
        assert torch.equal(tensor, plain[name]), name
    # Per MoE layer (target and MTP): 3 tensors per expert, the bias, the gate when on the FFN.
    per_layer = 3 * E + 1 + (0 if gate_on_attention else 1)
    assert ffn_model.afd_filter_stats.kept == (len(MOE_LAYERS) + 1) * per_layer


def _bias_matters(cfg: Any, block: Any, hidden: torch.Tensor, want: torch.Tensor) -> bool:
    """True when ``block``'s output changes with its correction bias zeroed."""
    from afd_runtime.workers.base import _vllm_forward_context

    bias = block.gate.e_score_correction_bias
    saved = bias.detach().clone()
    try:
        bias.data.zero_()
        with _vllm_forward_context(cfg, hidden.shape[0]):
            unbiased = block(hidden.clone())
    finally:
        bias.data.copy_(saved)
    return not torch.equal(unbiased, want)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_afd_moe_layer_equals_plain_layer(models: Models, gate_on_attention: bool) -> None:
    """Shared experts, gate (when there) and routed scaling on Attention + routed experts on
    the FFN model (the runtime's native compute) == upstream's Glm4MoE, on random inputs."""
    from afd_runtime.workers.base import _vllm_forward_context

    plain_cfg, plain = models[("plain", False)]
    _, attn = models[("attention", gate_on_attention)]
    ffn_cfg, ffn = models[("ffn", gate_on_attention)]
    n = 16
    hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(11))
    for layer in MOE_LAYERS:
        with torch.inference_mode():
            with _vllm_forward_context(plain_cfg, n):
                want = plain.model.layers[layer].mlp(hidden.clone())
            # The FFN role's model served by the runtime's FFN service (in-process connector).
            served = kit.ServedFFN(attn.afd_payload_spec, [(ffn_cfg, ffn)], (layer,))
            with served, served.step(n) as connector:
                meta = AFDForwardMetadata(connector=connector, num_tokens=(n,))
                with set_afd_forward_metadata(meta):
                    got = attn.model.layers[layer].mlp(hidden.clone())
            assert _bias_matters(plain_cfg, plain.model.layers[layer].mlp, hidden, want)
        assert served.computes[0].calls == [(layer, n)]
        assert want.abs().max() > 0
        assert torch.equal(got, want)
    # Routed scaling is applied exactly once: by the Attention block (the MoERunner rule),
    # while the FFN's runner and router keep 1.0 and route with the correction bias.
    block = ffn.model.layers[MOE_LAYERS[-1]].mlp
    assert attn.model.layers[MOE_LAYERS[-1]].mlp.routed_scaling_factor == SCALE
    assert block.upstream_routed_scaling_factor == SCALE
    assert block.experts.routed_scaling_factor == 1.0
    assert block.experts.router.routed_scaling_factor == 1.0
    assert block.experts.router.e_score_correction_bias is block.gate.e_score_correction_bias


def test_expert_parallel_routes_on_attention_with_the_correction_bias(
    models: Models, checkpoint: Path
) -> None:
    """Two FFN ranks: each holds exactly its half of the plain model's experts (renamed local),
    the Attention role routes with vLLM's router and the correction bias loaded there, and one
    MoE layer equals the plain block up to the two ranks' summation order."""
    from afd_runtime.workers.base import _vllm_forward_context

    plain_cfg, plain = models[("plain", False)]
    afd = {"port": 1, "num_ffn_ranks": 2, "compute_gate_on_attention": True}
    attn_cfg, attn = kit.load(checkpoint, {"role": "attention", **afd})
    ranks = [kit.load(checkpoint, {"role": "ffn", "ffn_rank": f, **afd}) for f in range(2)]
    plain_params = _params(plain)
    for f, (_, ffn) in enumerate(ranks):
        emap = ffn.model.layers[MOE_LAYERS[0]].mlp.expert_map
        local = list(emap.local_experts(f))
        assert len(local) == E // 2
        for name, p in _params(ffn).items():
            assert ".experts." in name, name  # nothing but routed experts on an EP FFN rank
            if _is_draft(name):
                continue
            assert torch.equal(p, plain_params[name][local]), name
    attn_params = _params(attn)
    biases = {n for n in attn_params if n.endswith(BIAS)}
    assert biases == {f"model.layers.{i}{BIAS}" for i in MOE_LAYERS}
    for name in biases:
        assert torch.equal(attn_params[name], plain_params[name]), name
    assert set(attn_params) | {n for n in plain_params if ".experts." in n} == set(plain_params)
    n = 16
    hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(3))
    for layer in MOE_LAYERS:
        mlp = attn.model.layers[layer].mlp
        assert mlp.afd_router.e_score_correction_bias is mlp.gate.e_score_correction_bias
        with torch.inference_mode():
            with _vllm_forward_context(plain_cfg, n):
                want = plain.model.layers[layer].mlp(hidden.clone())
            served = kit.ServedFFN(attn.afd_payload_spec, ranks, (layer,))
            with served, served.step(n) as connector:
                meta = AFDForwardMetadata(connector=connector, num_tokens=(n,))
                with set_afd_forward_metadata(meta), _vllm_forward_context(attn_cfg, n):
                    got = mlp(hidden.clone())
        calls = [c.calls for c in served.computes]
        assert all(len(rank) <= 1 and {ly for ly, _ in rank} <= {layer} for rank in calls), calls
        assert sum(rows for rank in calls for _, rows in rank) >= n
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _load_drafter(path: Path, afd: dict[str, Any] | None) -> tuple[Any, Any]:
    """``(vllm_config, drafter)``: the MTP drafter as vLLM's proposer loads it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cfg = kit.engine_config(path, afd, speculative_config=SPEC)
    with set_current_vllm_config(cfg):
        draft = cfg.speculative_config.draft_model_config
        return cfg, get_model(vllm_config=cfg, model_config=draft)


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_mtp_drafter_and_ffn_partition_the_plain_drafter(
    models: Models, checkpoint: Path, gate_on_attention: bool
) -> None:
    """The Attention role's drafter (AFDGlm4MoeMTP) holds the MTP layer but its routed experts
    (and the bias, where the FFN selects), which the FFN role holds; together exactly the plain
    drafter's parameters, and its MoE block through the FFN role equals the plain one."""
    from afd_models.models.glm4_moe import AFDAttnGlm4MoE, AFDGlm4MoeMTP
    from afd_runtime.workers.base import _vllm_forward_context
    from vllm.model_executor.models.glm4_moe import Glm4MoE

    plain_cfg, plain = _load_drafter(checkpoint, None)
    afd = {"role": "attention", "port": 1, "compute_gate_on_attention": gate_on_attention}
    _, drafter = _load_drafter(checkpoint, afd)
    ffn_cfg, ffn = models[("ffn", gate_on_attention)]
    assert type(plain) is AFDGlm4MoeMTP and type(drafter) is AFDGlm4MoeMTP
    assert type(plain.model.layers[str(DRAFT)].mtp_block.mlp) is Glm4MoE
    block = drafter.model.layers[str(DRAFT)].mtp_block.mlp
    assert type(block) is AFDAttnGlm4MoE
    assert drafter.afd_draft_layer_indices == (DRAFT,) and drafter.moe_layers == []
    # The drafter's parameter names carry mtp_block.; the FFN role's are the checkpoint's.
    mine = {n.replace(".mtp_block.", "."): p for n, p in _params(drafter).items()}
    want = {n.replace(".mtp_block.", "."): p for n, p in _params(plain).items()}
    served = {n: p for n, p in _params(ffn).items() if _is_draft(n)}
    assert not [n for n in mine if ".experts." in n]
    assert set(mine).isdisjoint(served)
    assert set(mine) | set(served) == set(want)
    for name, tensor in {**mine, **served}.items():
        assert torch.equal(tensor, want[name]), name
    assert drafter.afd_param_bytes > 0
    n = 16
    hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(13))
    with torch.inference_mode():
        with _vllm_forward_context(plain_cfg, n):
            expected = plain.model.layers[str(DRAFT)].mtp_block.mlp(hidden.clone())
        # The drafter sends what the target model sends (the connector reads its spec).
        spec = models[("attention", gate_on_attention)][1].afd_payload_spec
        served = kit.ServedFFN(spec, [(ffn_cfg, ffn)], (DRAFT,))
        with served, served.step(n) as connector:
            meta = AFDForwardMetadata(connector=connector, num_tokens=(n,))
            with set_afd_forward_metadata(meta):
                got = block(hidden.clone())
    assert served.computes[0].calls == [(DRAFT, n)]
    assert torch.equal(got, expected)
