"""Role construction and weight filtering against the real vLLM model classes on CPU.

For each family (Qwen3-MoE, DeepSeek-V2 with MLA, DeepSeek-V3 routing: ``noaux_tc`` with a
correction bias, sigmoid, routed scaling 2.5) and each gate placement, the tiny checkpoint is
loaded three times through vLLM's own loader: plain (no AFD config), Attention role, FFN role.
Checked, all exactly (``torch.equal``):

* each role holds only its modules (no routed experts on Attention; only routed experts and, on
  the FFN side, the gate on FFN);
* every role parameter equals the plain model's parameter of the same name, and the two roles
  together hold exactly the plain model's parameters;
* one MoE layer computed the AFD way (Attention block; the FFN model served by the runtime's FFN
  service over afd-core's in-process connector) equals the plain model's block.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from afd_core.config import AFDConfig, AFDRole
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_core.testing import free_port
from afd_models.demo.published import PublishedSpec, ensure_published_checkpoint
from afd_models.demo.tiny import TinySpec, ensure_tiny_checkpoint
from afd_runtime.roles import model_param_bytes

sys.path.insert(0, str(Path(__file__).parent))

import afd_models_adapter_kit as kit

pytestmark = [pytest.mark.vllm_runtime, pytest.mark.timeout(600)]

FAMILIES = ("qwen3_moe", "deepseek_v2", "deepseek_v3")
#: Expert parallelism routes on the Attention role (DeepSeek-V3: with its correction bias).
EP_FAMILIES = FAMILIES


@pytest.fixture(scope="module")
def vllm_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(_config(_checkpoint("qwen3_moe"))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)


_CACHE: dict[str, Path] = {}


def _checkpoint(family: str) -> Path:
    if family not in _CACHE:
        root = Path(os.environ.get("AFD_TINY_CACHE", "/tmp/afd-tiny-cache-tests"))
        _CACHE[family] = ensure_tiny_checkpoint(TinySpec(family), root)  # type: ignore[arg-type]
    return _CACHE[family]


def _config(path: Path, afd: dict[str, Any] | None = None, dtype: str = "auto") -> Any:
    from vllm.engine.arg_utils import EngineArgs

    extra = {} if afd is None else {"afd": afd}
    kw: dict[str, Any] = {}
    if dtype == "float32" and "deepseek" in path.name:
        kw["attention_backend"] = "CPU_MLA"  # AMX MLA (preferred where AMX exists) needs bf16
    return EngineArgs(
        model=str(path), enforce_eager=True, additional_config=extra, dtype=dtype, **kw
    ).create_engine_config()


def _load(path: Path, afd: dict[str, Any] | None, dtype: str = "auto") -> tuple[Any, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cfg = _config(path, afd, dtype)
    with set_current_vllm_config(cfg):
        return cfg, get_model(vllm_config=cfg)


@pytest.fixture(scope="module")
def models(vllm_env: None) -> dict[tuple[str, str, bool], tuple[Any, Any]]:
    out: dict[tuple[str, str, bool], tuple[Any, Any]] = {}
    for family in FAMILIES:
        path = _checkpoint(family)
        out[(family, "plain", False)] = _load(path, None)
        for gate_on_attention in (False, True):
            for role in ("attention", "ffn"):
                afd = {"role": role, "port": 1, "compute_gate_on_attention": gate_on_attention}
                out[(family, role, gate_on_attention)] = _load(path, afd)
    return out


def _params(model: Any) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_hold_only_their_modules(
    models: dict[tuple[str, str, bool], tuple[Any, Any]], family: str, gate_on_attention: bool
) -> None:
    attn = _params(models[(family, "attention", gate_on_attention)][1])
    ffn = _params(models[(family, "ffn", gate_on_attention)][1])
    assert attn and ffn
    assert not [n for n in attn if ".experts." in n]
    assert all(".mlp.experts." in n or ".mlp.gate." in n for n in ffn), sorted(ffn)
    assert any(".mlp.experts." in n for n in ffn)
    gates_on_ffn = [n for n in ffn if n.endswith(".mlp.gate.weight")]
    gates_on_attn = [n for n in attn if n.endswith(".mlp.gate.weight")]
    if gate_on_attention:
        assert not gates_on_ffn and gates_on_attn
    else:
        assert gates_on_ffn and not gates_on_attn
    assert not [n for n in ffn if "attn" in n or "embed" in n or "lm_head" in n or "norm" in n]
    # DeepSeek-V3's correction bias is used only in expert selection, which runs in the FFN
    # role's FusedMoE router for either gate placement (one FFN rank).
    bias = ".mlp.gate.e_score_correction_bias"
    assert not [n for n in attn if n.endswith(bias)]
    n_bias = len([n for n in ffn if n.endswith(bias)])
    assert n_bias == (
        len(models[(family, "ffn", gate_on_attention)][1].afd_moe_layer_indices)
        if family == "deepseek_v3"
        else 0
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_roles_partition_the_plain_parameters_exactly(
    models: dict[tuple[str, str, bool], tuple[Any, Any]], family: str, gate_on_attention: bool
) -> None:
    plain = _params(models[(family, "plain", False)][1])
    attn_model = models[(family, "attention", gate_on_attention)][1]
    ffn_model = models[(family, "ffn", gate_on_attention)][1]
    attn, ffn = _params(attn_model), _params(ffn_model)
    assert set(attn).isdisjoint(ffn)
    assert set(attn) | set(ffn) == set(plain)
    for name, tensor in {**attn, **ffn}.items():
        assert torch.equal(tensor, plain[name]), name
    plain_bytes = models[(family, "plain", False)][1].afd_param_bytes
    assert attn_model.afd_param_bytes + ffn_model.afd_param_bytes == plain_bytes
    assert model_param_bytes(attn_model) == attn_model.afd_param_bytes > 0
    assert model_param_bytes(ffn_model) == ffn_model.afd_param_bytes > 0
    # The router gate's bytes move with it.
    config = models[(family, "plain", False)][0].model_config
    hf = config.hf_config
    experts = getattr(hf, "num_experts", None) or hf.n_routed_experts
    itemsize = torch.empty(0, dtype=config.dtype).element_size()
    gate_bytes = len(ffn_model.afd_moe_layer_indices) * experts * hf.hidden_size * itemsize
    other = models[(family, "ffn", not gate_on_attention)][1]
    delta = ffn_model.afd_param_bytes - other.afd_param_bytes
    assert delta == (-gate_bytes if gate_on_attention else gate_bytes)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_afd_moe_layer_equals_plain_layer(
    models: dict[tuple[str, str, bool], tuple[Any, Any]], family: str, gate_on_attention: bool
) -> None:
    from afd_runtime.workers.base import _vllm_forward_context

    plain_cfg, plain = models[(family, "plain", False)]
    _, attn = models[(family, "attention", gate_on_attention)]
    ffn_cfg, ffn = models[(family, "ffn", gate_on_attention)]
    layer = ffn.afd_moe_layer_indices[-1]
    assert attn.afd_moe_layer_indices == ffn.afd_moe_layer_indices
    n = 32
    hidden = torch.randn(
        n, plain_cfg.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(7)
    ).to(plain_cfg.model_config.dtype)
    with torch.inference_mode():
        with _vllm_forward_context(plain_cfg, n):
            want = plain.model.layers[layer].mlp(hidden.clone())
        # The FFN role's model served by the runtime's FFN service, over the in-process connector.
        served = kit.ServedFFN(attn.afd_payload_spec, [(ffn_cfg, ffn)], (layer,))
        with served, served.step(n) as connector:
            meta = AFDForwardMetadata(connector=connector, num_tokens=(n,))
            with set_afd_forward_metadata(meta):
                got = attn.model.layers[layer].mlp(hidden.clone())
    assert served.computes[0].calls == [(layer, n)]
    assert torch.equal(got, want)
    if family == "deepseek_v3":
        # The comparison sees the correction bias: without it the plain layer picks other
        # experts for some of these tokens.
        bias = plain.model.layers[layer].mlp.gate.e_score_correction_bias
        with torch.inference_mode():
            saved = bias.detach().clone()
            try:
                bias.data.zero_()
                with _vllm_forward_context(plain_cfg, n):
                    unbiased = plain.model.layers[layer].mlp(hidden.clone())
            finally:
                bias.data.copy_(saved)
        assert not torch.equal(unbiased, want)
        # Routed scaling 2.5 is applied exactly once: by the Attention block (upstream's
        # MoERunner rule), while the FFN's runner and router keep 1.0.
        block = ffn.model.layers[layer].mlp
        assert attn.model.layers[layer].mlp.routed_scaling_factor == 2.5
        assert block.upstream_routed_scaling_factor == 2.5
        assert block.experts.routed_scaling_factor == 1.0
        assert block.experts.router.routed_scaling_factor == 1.0
        assert block.experts.router.e_score_correction_bias is not None


def test_ffn_role_model_refuses_forward(
    models: dict[tuple[str, str, bool], tuple[Any, Any]],
) -> None:
    _, ffn = models[("qwen3_moe", "ffn", False)]
    with pytest.raises(RuntimeError, match="FFN service"):
        ffn(input_ids=None, positions=None)


def test_plain_config_builds_the_upstream_model(
    models: dict[tuple[str, str, bool], tuple[Any, Any]],
) -> None:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    _, qwen = models[("qwen3_moe", "plain", False)]
    _, deepseek = models[("deepseek_v2", "plain", False)]
    assert isinstance(qwen.model.layers[0].mlp, Qwen3MoeSparseMoeBlock)
    assert isinstance(deepseek.model.layers[1].mlp, DeepseekV2MoE)
    assert qwen._afd_classify is None and deepseek._afd_classify is None


def test_role_worker_selected_by_config(
    models: dict[tuple[str, str, bool], tuple[Any, Any]],
) -> None:
    assert models[("qwen3_moe", "plain", False)][0].parallel_config.worker_cls == (
        "vllm.v1.worker.cpu_worker.CPUWorker"
    )
    attn_cfg = models[("qwen3_moe", "attention", False)][0]
    ffn_cfg = models[("qwen3_moe", "ffn", False)][0]
    assert attn_cfg.parallel_config.worker_cls == "afd_runtime.workers.cpu.AFDCPUAttentionWorker"
    assert ffn_cfg.parallel_config.worker_cls == "afd_runtime.workers.cpu.AFDCPUFFNWorker"
    assert ffn_cfg.cache_config.enable_prefix_caching is False
    assert AFDRole.FFN.value == "ffn"


def test_router_refuses_a_missing_or_unexpected_routing_bias(vllm_env: None) -> None:
    """A router outside the FusedMoE must get its layer's bias exactly when the model routes
    with one: without it DeepSeek-V3 would route silently without the correction bias."""
    from types import SimpleNamespace

    from afd_models.models.deepseek_v2 import AFDDeepseekV2ForCausalLM
    from afd_models.models.qwen3_moe import AFDQwen3MoeForCausalLM

    v3 = SimpleNamespace(
        topk_method="noaux_tc", num_experts_per_tok=2, n_routed_experts=8, norm_topk_prob=True
    )
    with pytest.raises(ValueError, match="routing bias missing"):
        AFDDeepseekV2ForCausalLM.afd_router(v3, None)
    qwen = SimpleNamespace(num_experts_per_tok=2, num_experts=8, norm_topk_prob=True)
    with pytest.raises(ValueError, match="routing bias given"):
        AFDQwen3MoeForCausalLM.afd_router(qwen, torch.zeros(8))


@pytest.mark.parametrize("family", EP_FAMILIES)
def test_expert_parallel_ranks_hold_their_experts_and_match_the_plain_layer(
    vllm_env: None, family: str
) -> None:
    """Two FFN ranks: each holds exactly the plain model's experts of its range (renamed local),
    and one MoE layer through the Attention block's router + dispatch equals the plain block up
    to the combine's summation order (partial sums of two ranks)."""
    from afd_runtime.workers.base import _vllm_forward_context

    path = _checkpoint(family)
    # float32 (as the E2E serves): the two ranks' partial sums then differ from the one-pass
    # kernel sum by float32 rounding only.
    plain_cfg, plain = _load(path, None, "float32")
    afd = {"port": 1, "num_ffn_ranks": 2, "compute_gate_on_attention": True}
    attn_cfg, attn = _load(path, {"role": "attention", **afd}, "float32")
    ffns = [_load(path, {"role": "ffn", "ffn_rank": f, **afd}, "float32") for f in range(2)]
    plain_params = _params(plain)
    for f, (_, ffn) in enumerate(ffns):
        emap = ffn.model.layers[ffn.afd_moe_layer_indices[0]].mlp.expert_map
        local = list(emap.local_experts(f))
        assert len(local) == emap.num_experts // 2
        for name, p in _params(ffn).items():
            assert ".experts." in name, name  # nothing but routed experts on an EP FFN rank
            want = plain_params[name]
            if want.shape[0] == emap.num_experts:  # per-expert stacked weights
                want = want[local]
            assert torch.equal(p, want), name
    layer = attn.afd_moe_layer_indices[-1]
    bias = ".mlp.gate.e_score_correction_bias"
    attn_biases = {n: p for n, p in _params(attn).items() if n.endswith(bias)}
    if family == "deepseek_v3":
        # The experts are selected on the Attention role: the correction bias loads there, once
        # per MoE layer, and reaches the router the block routes with.
        assert len(attn_biases) == len(attn.afd_moe_layer_indices)
        for name, p in attn_biases.items():
            assert torch.equal(p, plain_params[name]), name
        mlp = attn.model.layers[layer].mlp
        assert mlp.afd_router.e_score_correction_bias is mlp.gate.e_score_correction_bias
    else:
        assert not attn_biases
    hidden = torch.randn(
        9, plain_cfg.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(3)
    ).to(plain_cfg.model_config.dtype)
    with torch.inference_mode():
        with _vllm_forward_context(plain_cfg, 9):
            want = plain.model.layers[layer].mlp(hidden.clone())
        # Two FFN services (one per rank) over the in-process connector.
        served = kit.ServedFFN(attn.afd_payload_spec, ffns, (layer,))
        with served, served.step(9) as connector:
            meta = AFDForwardMetadata(connector=connector, num_tokens=(9,))
            with set_afd_forward_metadata(meta), _vllm_forward_context(attn_cfg, 9):
                got = attn.model.layers[layer].mlp(hidden.clone())
    # One step: each rank computed its share of the layer at most once (an empty share runs
    # nothing), and every token reached a rank.
    calls = [c.calls for c in served.computes]
    assert all(len(rank) <= 1 and {ly for ly, _ in rank} <= {layer} for rank in calls), calls
    assert sum(rows for rank in calls for _, rows in rank) >= 9
    # Same experts, same weights; only the order of the two ranks' partial sums differs.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "quant"),
    [
        ("qwen3_moe", {"expert_quant": "w8a8"}),
        ("deepseek_v2", {"expert_quant": "w4a8", "expert_quant_group_size": 32}),
        ("deepseek_v3", {"expert_quant": "w8a8"}),
    ],
)
def test_quantized_ffn_layer_is_within_tolerance_of_the_plain_layer(
    vllm_env: None, family: str, quant: dict[str, Any]
) -> None:
    """The FFN role quantizes its experts at load (no float expert left in the module tree) and
    its Layered compute stays within the documented tolerance of the plain fp32 layer; with two
    FFN ranks each rank quantizes only its own experts (half the bytes)."""
    from afd_runtime.compute import select_ffn_compute
    from afd_runtime.workers.base import _vllm_forward_context

    path = _checkpoint(family)
    plain_cfg, plain = _load(path, None, "float32")
    gate = family.startswith("deepseek")  # DeepSeek: gate on Attention; Qwen3-MoE: on FFN
    afd = {"role": "ffn", "port": 1, "compute_gate_on_attention": gate, "ffn_compute": "layered"}
    _, ffn = _load(path, {**afd, **quant}, "float32")
    assert not [n for n, _ in ffn.named_parameters() if ".experts." in n]
    compute = select_ffn_compute(AFDConfig.from_mapping({**afd, **quant}), ffn, None, max_tokens=64)  # type: ignore[arg-type]
    layer = ffn.afd_moe_layer_indices[-1]
    hidden = torch.randn(
        9, plain_cfg.model_config.get_hidden_size(), generator=torch.Generator().manual_seed(5)
    )
    with torch.inference_mode():
        with _vllm_forward_context(plain_cfg, 9):
            mlp = plain.model.layers[layer].mlp
            want = mlp(hidden.clone())
            logits = None
            if gate:
                logits = mlp.gate(hidden)[0]
                shared = mlp.shared_experts(hidden) if mlp.shared_experts is not None else 0
                # The FFN role computes the routed experts only, unscaled (the Attention block
                # applies upstream's routed scaling: 2.5 on the tiny DeepSeek-V3).
                want = (want - shared) / getattr(mlp, "routed_scaling_factor", 1.0)
        got = compute(layer, hidden, logits)
    if not gate:  # Qwen3-MoE's tiny model has no shared expert: the layer is the experts
        assert getattr(plain.model.layers[layer].mlp, "shared_expert", None) is None
    from afd_models.demo.run import QUANT_ERROR_TOLERANCE

    err = float((got - want).abs().max() / want.abs().max())
    assert err <= QUANT_ERROR_TOLERANCE[quant["expert_quant"]], err
    if family == "deepseek_v3":
        # The quantized compute routes with this layer's correction bias, loaded on the FFN.
        block = ffn.model.layers[layer].mlp
        bias = block.gate.e_score_correction_bias
        assert block.afd_router.e_score_correction_bias is bias
        assert torch.equal(bias, plain.model.layers[layer].mlp.gate.e_score_correction_bias)
    # Expert parallel: each FFN rank quantizes its own experts only.
    ep = {**afd, **quant, "compute_gate_on_attention": True, "num_ffn_ranks": 2}
    halves = [_load(path, {**ep, "ffn_rank": f}, "float32")[1] for f in range(2)]
    total = ffn.afd_quantized_weights.nbytes()
    assert [h.afd_quantized_weights.geometry.num_experts for h in halves] == [
        ffn.afd_quantized_weights.geometry.num_experts // 2
    ] * 2
    assert sum(h.afd_quantized_weights.nbytes() for h in halves) == total


@pytest.mark.parametrize("draft_weights", [False, True])
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_ffn_role_serves_a_declared_mtp_layer_only_when_its_weights_ship(
    vllm_env: None, draft_weights: bool, gate_on_attention: bool
) -> None:
    """DeepSeek-V3's published config declares one MTP layer; transformers and many derivatives
    ship none of its tensors. The FFN role then loads (the gate-on-Attention placement used to
    die on the absent layer's routing bias) and serves the target's MoE layers only; with the
    weights it serves the MTP layer's experts too."""
    root = Path(os.environ.get("AFD_TINY_CACHE", "/tmp/afd-tiny-cache-tests"))
    spec = PublishedSpec("deepseek-v3", dequantized=True, draft_weights=draft_weights)
    path = ensure_published_checkpoint(spec, root)
    afd = {"role": "ffn", "port": 1, "compute_gate_on_attention": gate_on_attention}
    _, ffn = _load(path, afd, dtype="float32")
    mtp = 4  # the scaled config's num_hidden_layers
    assert ffn.afd_draft_layer_indices == ((mtp,) if draft_weights else ())
    assert ffn.afd_moe_layer_indices == (1, 2, 3, *((mtp,) if draft_weights else ()))
    held = {name for name, _ in ffn.named_parameters() if name.startswith(f"model.layers.{mtp}.")}
    assert bool(held) == draft_weights, held
