"""AFD adapter for vLLM's Qwen3-MoE (``Qwen3MoeForCausalLM``).

Registered under the upstream architecture name. Without ``additional_config["afd"]`` the class is
upstream's, unchanged. With the Attention role, sparse-MoE blocks become
:class:`~afd_models.models._common.RemoteMoEBlock` (gate local when
``compute_gate_on_attention``, shared expert local); with the FFN role the constructor returns an
:class:`~afd_models.models._common.AFDFFNCausalLM` holding only the MoE blocks.

The role plumbing (FFN model, end of the Attention constructor, checkpoint filtering) is
:class:`~afd_models.models._common.AFDRoleModelMixin`'s; this module supplies its hooks: the
MoE-layer rule, ``num_experts``, :func:`qwen3_moe_classifier`, :func:`build_ffn_block`, upstream's
``hf_to_vllm_mapper`` and the EPLB counts upstream's constructor (not run here) would set.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models import qwen3_moe as upstream
from vllm.model_executor.models.utils import extract_layer_index, maybe_prefix

from afd_models._weight_utils import Classifier, WeightOwner, classify_moe_weight
from afd_models.models._common import (
    AFDRoleModelMixin,
    FFNMoEBlock,
    RemoteMoEBlock,
    afd_config_of,
    no_routed_experts_eplb,
)


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule for which decoder layers are sparse-MoE."""
    mlp_only = list(getattr(config, "mlp_only_layers", []) or [])
    return (
        layer_idx not in mlp_only
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


def qwen3_moe_classifier(gate_on_attention: bool) -> Any:
    """Checkpoint-name classifier: routed experts (and the gate when on FFN) -> FFN."""

    def classify(name: str) -> WeightOwner:
        return classify_moe_weight(name, gate_on_attention=gate_on_attention)

    return classify


def _shared_expert(config: Any, vllm_config: VllmConfig, prefix: str) -> nn.Module | None:
    size = getattr(config, "shared_expert_intermediate_size", 0)
    if not size:
        return None
    expert_gate = ReplicatedLinear(
        config.hidden_size, 1, bias=False, quant_config=None, prefix=f"{prefix}.shared_expert_gate"
    )
    return upstream.Qwen3MoeMLP(
        hidden_size=config.hidden_size,
        intermediate_size=size,
        hidden_act=config.hidden_act,
        quant_config=vllm_config.quant_config,
        reduce_results=False,
        expert_gate=expert_gate,
        prefix=f"{prefix}.shared_expert",
    )


class _AttnMoEBlock(RemoteMoEBlock):
    """Keeps upstream's attribute names (``gate``, ``shared_expert``) for weight loading."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> None:
        config = vllm_config.model_config.hf_text_config
        gate = (
            GateLinear(
                config.hidden_size,
                config.num_experts,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.gate",
            )
            if gate_on_attention
            else None
        )
        shared = _shared_expert(config, vllm_config, prefix)
        routed = AFDQwen3MoeForCausalLM.afd_attention_router(vllm_config)
        super().__init__(
            layer_idx=extract_layer_index(prefix),
            gate=gate,
            shared_experts=None,
            shared_attr="shared_expert",
            router=None if routed is None else routed[0],
            num_experts=None if routed is None else routed[1],
        )
        if shared is not None:
            # Register the expert gate first: upstream's canonical name is ``shared_expert_gate``.
            self.shared_expert_gate = shared.expert_gate
            self.shared_expert = shared


def build_ffn_block(vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
    """The FFN-side block of one Qwen3-MoE layer (upstream FusedMoE, no shared expert)."""
    config = vllm_config.model_config.hf_text_config
    gate = (
        None
        if gate_on_attention
        else GateLinear(
            config.hidden_size,
            config.num_experts,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.gate",
        )
    )
    experts = FusedMoEFactory(
        shared_experts=None,
        gate=gate,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=config.norm_topk_prob,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.experts",
    )
    return FFNMoEBlock(
        gate=gate, experts=experts, routed_scaling_factor=1.0, gate_on_ffn=not gate_on_attention
    )


class AFDQwen3MoeAttnDecoderLayer(upstream.Qwen3MoeDecoderLayer):
    """Upstream decoder layer with the sparse-MoE block replaced by a remote one."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        prefix: str = "",
        is_fused_checkpoint_transposed: bool = False,
        mrope_positions_factor: int = 4,
    ) -> None:
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        afd = afd_config_of(vllm_config)
        assert afd is not None
        self.hidden_size = config.hidden_size
        self.self_attn = upstream.Qwen3MoeAttention(
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            head_dim=getattr(config, "head_dim", None),
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
            dual_chunk_attention_config=getattr(config, "dual_chunk_attention_config", None),
            mrope_positions_factor=mrope_positions_factor,
        )
        layer_idx = extract_layer_index(prefix)
        self.mlp: nn.Module
        if is_moe_layer(config, layer_idx):
            self.mlp = _AttnMoEBlock(vllm_config, f"{prefix}.mlp", afd.compute_gate_on_attention)
        else:
            self.mlp = upstream.Qwen3MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class AFDQwen3MoeForCausalLM(AFDRoleModelMixin, upstream.Qwen3MoeForCausalLM):
    """``Qwen3MoeForCausalLM`` that builds only its role's half under AFD."""

    _afd_is_moe_layer = staticmethod(is_moe_layer)
    _afd_build_ffn_block = staticmethod(build_ffn_block)
    _afd_weights_mapper = upstream.Qwen3MoeModel.hf_to_vllm_mapper

    @staticmethod
    def _afd_num_experts(config: Any) -> int:
        return config.num_experts

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        # What build_ffn_block's FusedMoE (upstream's) hands vLLM's router factory.
        return {
            "top_k": config.num_experts_per_tok,
            "global_num_experts": config.num_experts,
            "renormalize": config.norm_topk_prob,
        }

    @staticmethod
    def _afd_classifier(
        config: Any, gate_on_attention: bool, attention_routes: bool = False
    ) -> Classifier:
        return qwen3_moe_classifier(gate_on_attention)

    @staticmethod
    def _afd_eplb_attributes(config: Any) -> dict[str, Any]:
        # Upstream's constructor (which would count the MoE layers) does not run here.
        return no_routed_experts_eplb(config.num_experts)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        if afd is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._afd_classify = None
            return
        nn.Module.__init__(self)
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = upstream.Qwen3MoeModel(
            vllm_config=vllm_config,
            prefix=maybe_prefix(prefix, "model"),
            decoder_layer_type=AFDQwen3MoeAttnDecoderLayer,
        )
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self._afd_init_attention_role(vllm_config, afd)
