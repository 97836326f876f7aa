"""AFD adapter for vLLM's GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``) and its MTP drafter
(``Glm4MoeMTPModel``).

Registered under the upstream architecture names. Without ``additional_config["afd"]`` the classes
are upstream's, unchanged.

GLM-4.5's MoE block (``glm4_moe.Glm4MoE``) routes as DeepSeek-V3 does (sigmoid scores, the
``e_score_correction_bias``, grouped top-k, ``routed_scaling_factor`` applied to the output,
shared experts), but unconditionally (no ``topk_method`` / ``scoring_func`` keys in its config)
and with the gate in fp32 (weights and logits); its attention is grouped-query (partial rotary,
optional qk-norm), not MLA.

* Attention role: upstream's constructor runs with ``glm4_moe.Glm4MoE`` replaced (only during
  construction, :func:`afd_models.models._construction.construction_override`) by
  :class:`AFDAttnGlm4MoE`: same signature, gate local only with ``compute_gate_on_attention``
  (and then the correction bias too when the Attention role selects the experts: expert
  parallelism), shared experts local, routed experts remote. Attention, dense layers (the first
  ``first_k_dense_replace``), norms, embeddings and the LM head are upstream's.
* FFN role: the constructor returns an :class:`~afd_models.models._common.AFDFFNCausalLM`
  holding, per MoE layer, upstream's FusedMoE configured exactly as ``Glm4MoE`` does (sigmoid
  grouped top-k, correction bias, routed scaling) but without shared experts, plus the gate when
  it is on the FFN role; with one FFN rank the correction bias always loads here.
* MTP: the checkpoint's ``num_nextn_predict_layers`` layers (``model.layers.<num_hidden_layers>``
  ..) are draft layers as in the DeepSeek adapter: the FFN role serves their routed experts, the
  Attention role's drafter (:class:`AFDGlm4MoeMTP`, vLLM's ``Glm4MoeMTP`` with the same
  stand-in) holds the rest of them.

The role plumbing (FFN model, end of the Attention constructor, checkpoint filtering) is
:class:`~afd_models.models._common.AFDRoleModelMixin`'s; this module supplies its hooks: the
MoE-layer rule, ``n_routed_experts``, the DeepSeek checkpoint classifier
(:func:`~afd_models.models.deepseek_v2.deepseek_classifier`: same names, same bias and MTP
policy), :func:`build_ffn_block`, the fp32 router dtype and the EPLB list upstream fills
(``moe_mlp_layers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.models import glm4_moe as upstream
from vllm.model_executor.models import glm4_moe_mtp as upstream_mtp
from vllm.model_executor.models.utils import extract_layer_index

from afd_models.models._common import (
    FFNMoEBlock,
    RemoteMoEBlock,
    afd_config_of,
)
from afd_models.models.deepseek_v2 import DeepSeekLayoutDrafterMixin, DeepSeekLayoutMixin

#: Upstream's ``Glm4MoE`` gate: fp32 weights and fp32 router logits.
ROUTER_DTYPE = torch.float32


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule (``Glm4MoeDecoderLayer``) for which decoder layers are sparse-MoE."""
    return config.n_routed_experts is not None and layer_idx >= config.first_k_dense_replace


def _routing(config: Any) -> dict[str, Any]:
    """How upstream's ``Glm4MoE`` selects experts: the arguments its FusedMoE gets that vLLM's
    router factory gets under the same names."""
    return {
        "top_k": config.num_experts_per_tok,
        "renormalize": config.norm_topk_prob,
        "use_grouped_topk": True,
        "num_expert_group": config.n_group,
        "topk_group": config.topk_group,
        "scoring_func": "sigmoid",
    }


def _gate(config: Any, prefix: str) -> GateLinear:
    """The router gate as upstream's ``Glm4MoE`` builds it (fp32, no quantization)."""
    return GateLinear(
        config.hidden_size,
        config.n_routed_experts,
        out_dtype=ROUTER_DTYPE,
        params_dtype=ROUTER_DTYPE,
        prefix=f"{prefix}.gate",
    )


def _add_correction_bias(holder: nn.Module, config: Any) -> nn.Parameter:
    """Registers the ``e_score_correction_bias`` on ``holder`` (the module at the gate's path,
    where the checkpoint names it) as upstream does, and returns it."""
    holder.e_score_correction_bias = nn.Parameter(
        torch.empty(config.n_routed_experts, dtype=torch.float32)
    )
    return holder.e_score_correction_bias


class AFDAttnGlm4MoE(RemoteMoEBlock):
    """Attention-side stand-in for ``Glm4MoE`` (same constructor signature).

    Routed scaling and the shared experts are combined by :class:`RemoteMoEBlock` with vLLM's
    ``MoERunner`` rule, the one upstream's block runs (``apply_routed_scale_to_output``): the
    routed output times ``routed_scaling_factor``, or, in fp16, the shared output divided by it
    instead. Upstream's GLM decoder layer does not compensate that fp16 division (DeepSeek's
    does), and neither does this block: the Attention role computes what upstream computes.
    """

    is_fused_shared_expert_enabled = False

    def __init__(
        self,
        config: Any,
        quant_config: Any = None,
        prefix: str = "",
        enable_eplb: bool = False,
    ) -> None:
        from vllm._aiter_ops import rocm_aiter_ops
        from vllm.config import get_current_vllm_config

        vllm_config = get_current_vllm_config()
        afd = afd_config_of(vllm_config)
        if afd is None:
            raise RuntimeError("AFDAttnGlm4MoE built without additional_config['afd']")
        if rocm_aiter_ops.is_fused_moe_enabled():
            raise NotImplementedError(
                "AFD GLM-4.5 needs the routed scaling applied to the output (not ROCm AITER)"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {config.hidden_act}; allowed: 'silu'")
        gate = _gate(config, prefix) if afd.compute_gate_on_attention else None
        shared = None
        if config.n_shared_experts is not None:
            shared = upstream.Glm4MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )
        bias = None
        if afd.num_ffn_ranks > 1:
            assert gate is not None  # expert parallelism runs the gate on Attention
            # Expert parallelism selects the experts here, so the bias loads here.
            bias = _add_correction_bias(gate, config)
        routed = AFDGlm4MoeForCausalLM.afd_attention_router(vllm_config, bias)
        super().__init__(
            layer_idx=extract_layer_index(prefix),
            gate=gate,
            shared_experts=shared,
            routed_scaling_factor=config.routed_scaling_factor,
            router=None if routed is None else routed[0],
            num_experts=None if routed is None else routed[1],
        )
        # What upstream's model reads while building its MoE metadata (no experts live here).
        self.experts = None
        n = config.n_routed_experts
        self.n_routed_experts = self.n_logical_experts = self.n_physical_experts = n
        self.n_shared_experts = config.n_shared_experts
        self.n_local_physical_experts = self.n_redundant_experts = 0


def build_ffn_block(vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
    """The FFN-side block of one GLM-4.5 MoE layer, configured as upstream's ``Glm4MoE``.

    One FFN rank selects the experts, so the correction bias always loads here: on the gate, or,
    with the gate on Attention, on an empty module at the gate's path (``mlp.gate``)."""
    config = vllm_config.model_config.hf_config
    gate = None if gate_on_attention else _gate(config, prefix)
    holder = nn.Module() if gate is None else gate
    bias = _add_correction_bias(holder, config)
    scale = config.routed_scaling_factor
    experts = FusedMoEFactory(
        shared_experts=None,
        gate=gate,
        num_experts=config.n_routed_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.experts",
        routed_scaling_factor=scale,
        apply_routed_scale_to_output=True,
        e_score_correction_bias=bias,
        router_logits_dtype=ROUTER_DTYPE,
        **_routing(config),
    )
    return FFNMoEBlock(
        gate=holder, experts=experts, routed_scaling_factor=scale, gate_on_ffn=not gate_on_attention
    )


class AFDGlm4MoeForCausalLM(DeepSeekLayoutMixin, upstream.Glm4MoeForCausalLM):
    """``Glm4MoeForCausalLM`` that builds only its role's half under AFD."""

    _afd_stand_in = (upstream, "Glm4MoE", AFDAttnGlm4MoE)
    _afd_is_moe_layer = staticmethod(is_moe_layer)
    _afd_build_ffn_block = staticmethod(build_ffn_block)
    _afd_weights_mapper = upstream.Glm4MoeModel.hf_to_vllm_mapper

    @staticmethod
    def _afd_router_dtype(config: Any) -> Any:
        return ROUTER_DTYPE

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        # What build_ffn_block's FusedMoE (configured as upstream's Glm4MoE) hands vLLM's router
        # factory; routed scaling is applied to the output (apply_routed_scale_to_output), so
        # the router's factor is 1.0 there too.
        return {
            **_routing(config),
            "global_num_experts": config.n_routed_experts,
            "routed_scaling_factor": 1.0,
        }

    @staticmethod
    def _afd_uses_routing_bias(config: Any) -> bool:
        return True  # upstream's Glm4MoE always registers e_score_correction_bias


class AFDGlm4MoeMTP(DeepSeekLayoutDrafterMixin, upstream_mtp.Glm4MoeMTP):
    """``Glm4MoeMTP`` (architecture ``Glm4MoeMTPModel``) on the Attention role, its layer's
    ``Glm4MoE`` replaced by :class:`AFDAttnGlm4MoE` (see the mixin); like the target model it
    exposes no MoE layers to EPLB."""

    # The decoder layer looks the block up in glm4_moe, the drafter's constructor checks its
    # layers against glm4_moe_mtp's import of it.
    _afd_stand_ins = (
        (upstream, "Glm4MoE", AFDAttnGlm4MoE),
        (upstream_mtp, "Glm4MoE", AFDAttnGlm4MoE),
    )
    _afd_eplb_lists = ("moe_layers", "moe_mlp_layers")
