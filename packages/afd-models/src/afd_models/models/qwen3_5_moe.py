"""AFD adapter for vLLM's Qwen3.5-MoE text model (``Qwen3_5MoeForCausalLM``).

Registered under the upstream architecture name. Without ``additional_config["afd"]`` the class is
upstream's, unchanged.

* Attention role: upstream's constructor runs with ``qwen3_5.Qwen3NextSparseMoeBlock`` replaced
  (only during construction, :func:`afd_models.models._construction.construction_override`) by
  :class:`AFDAttnQwen3_5MoeBlock`: same signature, gate local only with
  ``compute_gate_on_attention``, the gated shared expert local, routed experts remote. The hybrid
  attention (Gated DeltaNet linear attention and full attention layers), norms, embeddings and
  the LM head are upstream's. Upstream's ``set_moe_parameters`` (which counts the local MoE
  blocks) is not run: no routed experts live here.
* FFN role: the constructor returns an :class:`~afd_models.models._common.AFDFFNCausalLM` holding,
  per layer (every Qwen3.5-MoE decoder layer is sparse), upstream's FusedMoE configured as
  ``Qwen3NextSparseMoeBlock`` does, without the shared expert, plus the gate when it is on FFN.

vLLM's ``qwen3_5`` module imports the Qwen3-VL vision stack, which imports torchvision at module
level (through transformers' Qwen2-VL image processor); importing this adapter therefore needs a
torchvision that works beside the installed torch. The adapter itself uses only the text classes.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models import qwen3_5 as upstream
from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
from vllm.model_executor.models.utils import extract_layer_index

from afd_models._weight_utils import Classifier, WeightOwner, classify_moe_weight
from afd_models.models._common import (
    AFDRoleModelMixin,
    FFNMoEBlock,
    RemoteMoEBlock,
    afd_config_of,
    no_routed_experts_eplb,
)
from afd_models.models._construction import construction_override


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule (``Qwen3_5DecoderLayer``): every layer of the MoE text model is sparse."""
    return bool(config.model_type == "qwen3_5_moe_text")


def qwen3_5_moe_classifier(gate_on_attention: bool) -> Classifier:
    """Routed experts (and the gate when on FFN) -> FFN; the gated shared expert, attention (full
    and linear), norms, embeddings, LM head -> Attention. MTP weights (``mtp.``, which upstream's
    mapper drops too) -> neither."""

    def classify(name: str) -> WeightOwner:
        if name.startswith("mtp."):
            return WeightOwner.NONE
        return classify_moe_weight(name, gate_on_attention=gate_on_attention)

    return classify


class AFDAttnQwen3_5MoeBlock(RemoteMoEBlock):
    """Attention-side stand-in for ``Qwen3NextSparseMoeBlock`` (same constructor signature)."""

    # Read by upstream's Qwen3_5Model (fused shared-expert resolution): never fused here.
    is_fused_shared_expert_enabled = False

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", reduce_results: bool = True):
        config = vllm_config.model_config.hf_text_config
        afd = afd_config_of(vllm_config)
        if afd is None:
            raise RuntimeError("AFDAttnQwen3_5MoeBlock built without additional_config['afd']")
        gate = (
            GateLinear(config.hidden_size, config.num_experts, prefix=f"{prefix}.gate")
            if afd.compute_gate_on_attention
            else None
        )
        routed = AFDQwen3_5MoeForCausalLM.afd_attention_router(vllm_config)
        super().__init__(
            layer_idx=extract_layer_index(prefix),
            gate=gate,
            shared_experts=None,
            shared_attr="shared_expert",
            router=None if routed is None else routed[0],
            num_experts=None if routed is None else routed[1],
        )
        self.n_routed_experts = config.num_experts
        if config.shared_expert_intermediate_size > 0:
            # Upstream's names: ``shared_expert_gate`` and ``shared_expert`` (gated by it).
            self.shared_expert_gate = ReplicatedLinear(
                config.hidden_size, 1, bias=False, quant_config=None,
                prefix=f"{prefix}.shared_expert_gate",
            )  # fmt: skip
            self.shared_expert = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.shared_expert_intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                reduce_results=False,
                expert_gate=self.shared_expert_gate,
                prefix=f"{prefix}.shared_expert",
            )


def build_ffn_block(vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
    """The FFN-side block of one Qwen3.5-MoE layer (upstream's FusedMoE, no shared expert)."""
    config = vllm_config.model_config.hf_text_config
    gate = (
        None
        if gate_on_attention
        else GateLinear(config.hidden_size, config.num_experts, prefix=f"{prefix}.gate")
    )
    experts = FusedMoEFactory(
        shared_experts=None,
        gate=gate,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=getattr(config, "norm_topk_prob", True),
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.experts",
    )
    return FFNMoEBlock(
        gate=gate, experts=experts, routed_scaling_factor=1.0, gate_on_ffn=not gate_on_attention
    )


class AFDQwen3_5MoeForCausalLM(AFDRoleModelMixin, upstream.Qwen3_5MoeForCausalLM):
    """``Qwen3_5MoeForCausalLM`` that builds only its role's half under AFD."""

    _afd_is_moe_layer = staticmethod(is_moe_layer)
    _afd_build_ffn_block = staticmethod(build_ffn_block)
    # Upstream loads in two steps (the CausalLM's prefix mapper, then the model's stacked one);
    # the FFN model loads in one.
    _afd_weights_mapper = (
        upstream.Qwen3_5ForCausalLMBase.hf_to_vllm_mapper | upstream.Qwen3_5Model.hf_to_vllm_mapper
    )

    @staticmethod
    def _afd_num_experts(config: Any) -> int:
        return int(config.num_experts)

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        return {
            "top_k": config.num_experts_per_tok,
            "global_num_experts": config.num_experts,
            "renormalize": getattr(config, "norm_topk_prob", True),
        }

    @staticmethod
    def _afd_classifier(
        config: Any, gate_on_attention: bool, attention_routes: bool = False
    ) -> Classifier:
        return qwen3_5_moe_classifier(gate_on_attention)

    @staticmethod
    def _afd_eplb_attributes(config: Any) -> dict[str, Any]:
        # What upstream's set_moe_parameters (not run here) would set, for no local experts.
        return no_routed_experts_eplb(config.num_experts)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        if afd is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._afd_classify = None
            return
        with construction_override(upstream, "Qwen3NextSparseMoeBlock", AFDAttnQwen3_5MoeBlock):
            upstream.Qwen3_5ForCausalLMBase.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self._afd_init_attention_role(vllm_config, afd)
