"""AFD adapter for vLLM's DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

Registered under the upstream architecture names. Without ``additional_config["afd"]`` the classes
are upstream's, unchanged.

* Attention role: upstream's constructor runs with ``deepseek_v2.DeepseekV2MoE`` replaced (only
  during construction, :func:`afd_models.models._construction.construction_override`) by
  :class:`AFDAttnDeepseekV2MoE`: same signature, gate local only with
  ``compute_gate_on_attention``, shared experts local, routed experts remote. MLA attention,
  dense layers, norms, embeddings and the LM head are upstream's.
* FFN role: the constructor returns an :class:`~afd_models.models._common.AFDFFNCausalLM`
  holding, per MoE layer, upstream's FusedMoE configured exactly as ``DeepseekV2MoE`` does
  (grouped top-k, scoring function, correction bias, routed scaling) but without shared experts,
  plus the gate when it is on the FFN role.

The role plumbing (FFN model, end of the Attention constructor, checkpoint filtering) is
:class:`~afd_models.models._common.AFDRoleModelMixin`'s; this module supplies its hooks: the
MoE-layer rule, ``n_routed_experts``, :func:`deepseek_classifier`, :func:`build_ffn_block`,
upstream's router dtype and the EPLB list upstream fills (``moe_mlp_layers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack
from typing import Any, ClassVar

import torch
from afd_core.config import AFDRole
from afd_weights import param_bytes
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.models import deepseek_mtp as upstream_mtp
from vllm.model_executor.models import deepseek_v2 as upstream

from afd_models._weight_utils import (
    Classifier,
    WeightOwner,
    classify_moe_weight,
    filter_role_weights,
    layer_index,
)
from afd_models.models._common import (
    AFDRoleModelMixin,
    FFNMoEBlock,
    RemoteMoEBlock,
    afd_config_of,
)
from afd_models.models._construction import construction_override

_BIAS_SUFFIX = ".mlp.gate.e_score_correction_bias"


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule for which decoder layers are sparse-MoE."""
    freq = getattr(config, "moe_layer_freq", 1)
    return (
        config.n_routed_experts is not None
        and layer_idx >= config.first_k_dense_replace
        and layer_idx % freq == 0
    )


def deepseek_classifier(
    gate_on_attention: bool, num_layers: int | None, attention_routes: bool = False
) -> Any:
    """Routed experts -> FFN; gate weight -> its side; the routing bias -> where experts are
    selected; the rest -> Attention.

    The ``e_score_correction_bias`` (V3 ``noaux_tc``) is used only when selecting experts: on the
    FFN role with one FFN rank (its FusedMoE, or the quantized computes' router), on the
    Attention role with expert parallelism (``attention_routes``).

    The draft-layer policy, in this one place: layers at or beyond ``num_layers`` are the
    checkpoint's MTP (speculative draft) layers. Their FFN-owned tensors (routed experts, and the
    gate and bias where the FFN routes) go to the FFN role, which serves the draft layers' experts
    beside the target's; everything else of theirs goes to neither role's target model (the
    Attention role's drafter, :class:`AFDDeepSeekMTP`, loads it through
    :func:`deepseek_draft_classifier`). ``num_layers=None`` classifies every layer alike.
    """
    bias_owner = WeightOwner.ATTENTION if attention_routes else WeightOwner.FFN

    def classify(name: str) -> WeightOwner:
        if name.endswith(_BIAS_SUFFIX):
            owner = bias_owner
        else:
            owner = classify_moe_weight(name, gate_on_attention=gate_on_attention)
        idx = layer_index(name)
        if num_layers is not None and idx is not None and idx >= num_layers:
            return owner if owner is WeightOwner.FFN else WeightOwner.NONE
        return owner

    return classify


def deepseek_draft_classifier(gate_on_attention: bool, attention_routes: bool = False) -> Any:
    """The Attention role's MTP drafter: what :func:`deepseek_classifier` gives the Attention
    role, for every layer (upstream's MTP loader then keeps its own layers' tensors)."""
    return deepseek_classifier(gate_on_attention, None, attention_routes)


def _uses_correction_bias(config: Any) -> bool:
    return getattr(config, "topk_method", None) == "noaux_tc"


class AFDAttnDeepseekV2MoE(RemoteMoEBlock):
    """Attention-side stand-in for ``DeepseekV2MoE`` (same constructor signature)."""

    is_fused_shared_expert_enabled = False

    def __init__(
        self,
        config: Any,
        parallel_config: Any,
        quant_config: Any = None,
        reduce_results: bool = True,
        prefix: str = "",
        apply_routed_scale_to_output: bool = False,
    ) -> None:
        from vllm.config import get_current_vllm_config

        afd = afd_config_of(get_current_vllm_config())
        if afd is None:
            raise RuntimeError("AFDAttnDeepseekV2MoE built without additional_config['afd']")
        if not apply_routed_scale_to_output:
            raise NotImplementedError(
                "AFD DeepSeek needs apply_routed_scale_to_output=True (the non-ROCm-AITER path)"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {config.hidden_act}; allowed: 'silu'")
        gate = (
            GateLinear(
                config.hidden_size,
                config.n_routed_experts,
                out_dtype=upstream._get_moe_router_dtype(config),
                prefix=f"{prefix}.gate",
            )
            if afd.compute_gate_on_attention
            else None
        )
        shared = None
        if config.n_shared_experts is not None:
            shared = upstream.DeepseekV2MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                is_sequence_parallel=False,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )
        bias = None
        if afd.num_ffn_ranks > 1 and _uses_correction_bias(config):
            assert gate is not None  # expert parallelism runs the gate on Attention
            # Expert parallelism selects the experts here, so the bias loads here (as upstream's
            # DeepseekV2MoE registers it, on the gate).
            gate.e_score_correction_bias = nn.Parameter(
                torch.empty(config.n_routed_experts, dtype=torch.float32)
            )
            bias = gate.e_score_correction_bias
        routed = AFDDeepseekV2ForCausalLM.afd_attention_router(get_current_vllm_config(), bias)
        super().__init__(
            layer_idx=int(prefix.split(".")[-2]),
            gate=gate,
            shared_experts=shared,
            routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
            router=None if routed is None else routed[0],
            num_experts=None if routed is None else routed[1],
        )
        # Attributes upstream's model reads while building MoE metadata (no experts here).
        self.experts = None
        self.n_routed_experts = config.n_routed_experts
        self.n_shared_experts = config.n_shared_experts
        self.n_logical_experts = config.n_routed_experts
        self.n_physical_experts = config.n_routed_experts
        self.n_local_physical_experts = 0
        self.n_redundant_experts = 0


def build_ffn_block(vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
    """The FFN-side block of one DeepSeek MoE layer, configured as upstream's DeepseekV2MoE."""
    config = vllm_config.model_config.hf_config
    router_dtype = upstream._get_moe_router_dtype(config)
    gate: nn.Module | None
    if gate_on_attention:
        gate = nn.Module() if _uses_correction_bias(config) else None
    else:
        gate = GateLinear(
            config.hidden_size,
            config.n_routed_experts,
            out_dtype=router_dtype,
            prefix=f"{prefix}.gate",
        )
    bias = None
    if gate is not None:
        if _uses_correction_bias(config):
            gate.e_score_correction_bias = nn.Parameter(
                torch.empty(config.n_routed_experts, dtype=torch.float32)
            )
            bias = gate.e_score_correction_bias
        else:
            setattr(gate, "e_score_correction_bias", None)  # noqa: B010 - nn.Module attr typing
    scale = getattr(config, "routed_scaling_factor", 1.0)
    experts = FusedMoEFactory(
        shared_experts=None,
        gate=None if gate_on_attention else gate,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=config.norm_topk_prob,
        quant_config=vllm_config.quant_config,
        use_grouped_topk=True,
        num_expert_group=getattr(config, "n_group", 1),
        topk_group=getattr(config, "topk_group", 1),
        prefix=f"{prefix}.experts",
        scoring_func=getattr(config, "scoring_func", "softmax"),
        routed_scaling_factor=scale,
        apply_routed_scale_to_output=True,
        e_score_correction_bias=bias,
        router_logits_dtype=router_dtype,
    )
    return FFNMoEBlock(
        gate=gate, experts=experts, routed_scaling_factor=scale, gate_on_ffn=not gate_on_attention
    )


class DeepSeekLayoutMixin(AFDRoleModelMixin):
    """The adapter top of models with DeepSeek's checkpoint layout (DeepSeek-V2/V3, GLM-4.5):
    ``n_routed_experts``, the first layers dense, :func:`deepseek_classifier`, MTP draft layers
    after the decoder layers (``num_nextn_predict_layers``), upstream's MoE block replaced by the
    Attention-side stand-in :attr:`_afd_stand_in` while upstream's constructor runs."""

    #: ``(module, name, class)``: the upstream MoE block the Attention role replaces.
    _afd_stand_in: ClassVar[tuple[Any, str, type[nn.Module]]]

    @staticmethod
    def _afd_hf_config(vllm_config: Any) -> Any:
        return vllm_config.model_config.hf_config

    @staticmethod
    def _afd_num_experts(config: Any) -> int:
        return int(config.n_routed_experts)

    @staticmethod
    def _afd_classifier(
        config: Any, gate_on_attention: bool, attention_routes: bool = False
    ) -> Classifier:
        return deepseek_classifier(gate_on_attention, config.num_hidden_layers, attention_routes)

    @staticmethod
    def _afd_num_draft_layers(config: Any) -> int:
        # The MTP layers, served when the Attention role decodes speculatively through them
        # (DeepSeek: method deepseek_mtp / mtp; GLM-4.5: mtp); 0 for DeepSeek-V2.
        return int(getattr(config, "num_nextn_predict_layers", 0) or 0)

    @staticmethod
    def _afd_eplb_attributes(config: Any) -> dict[str, Any]:
        # Upstream's constructor counted the MoE blocks (the stand-in reports no local
        # experts); only its list of MoE layers is emptied.
        return {"moe_mlp_layers": []}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        if afd is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
            self._afd_classify = None
            return
        with construction_override(*self._afd_stand_in):
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self._afd_init_attention_role(vllm_config, afd)


class AFDDeepseekV2ForCausalLM(DeepSeekLayoutMixin, upstream.DeepseekV2ForCausalLM):
    """``DeepseekV2ForCausalLM`` that builds only its role's half under AFD."""

    _afd_stand_in = (upstream, "DeepseekV2MoE", AFDAttnDeepseekV2MoE)
    _afd_is_moe_layer = staticmethod(is_moe_layer)
    _afd_build_ffn_block = staticmethod(build_ffn_block)
    _afd_router_dtype = staticmethod(upstream._get_moe_router_dtype)

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        # What build_ffn_block's FusedMoE (configured as upstream's DeepseekV2MoE) hands vLLM's
        # router factory; routed scaling is applied to the output (apply_routed_scale_to_output),
        # so the router's factor is 1.0 there too.
        return {
            "top_k": config.num_experts_per_tok,
            "global_num_experts": config.n_routed_experts,
            "renormalize": config.norm_topk_prob,
            "use_grouped_topk": True,
            "num_expert_group": getattr(config, "n_group", 1),
            "topk_group": getattr(config, "topk_group", 1),
            "scoring_func": getattr(config, "scoring_func", "softmax"),
            "routed_scaling_factor": 1.0,
        }

    @staticmethod
    def _afd_uses_routing_bias(config: Any) -> bool:
        return _uses_correction_bias(config)


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    """DeepSeek-V3 uses the V2 implementation upstream too."""


class DeepSeekLayoutDrafterMixin:
    """The Attention role's MTP drafter of a model with DeepSeek's checkpoint layout (put it
    first in the bases of upstream's drafter class): its layer's MoE block is the target
    adapter's Attention-side stand-in (:attr:`_afd_stand_ins`, swapped while upstream's
    constructor runs), so the draft layer's routed experts run on the FFN role, which holds them
    (see :func:`deepseek_classifier`); attention, norms, ``eh_proj``, shared experts and the
    shared head stay here.

    The drafter's forwards are AFD steps of their own (afd-runtime announces them
    ``is_draft``, sending ``afd_draft_layer_indices``). Without ``additional_config["afd"]``
    this is upstream's class.
    """

    #: ``(module, name, class)`` swaps made while upstream's constructor runs.
    _afd_stand_ins: ClassVar[tuple[tuple[Any, str, type[nn.Module]], ...]]
    #: Upstream's EPLB lists of MoE blocks to empty (no routed experts live here).
    _afd_eplb_lists: ClassVar[tuple[str, ...]] = ()
    _afd_classify: Classifier | None = None
    model: Any

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        if afd is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
            return
        with ExitStack() as swaps:
            for module, name, stand_in in self._afd_stand_ins:
                swaps.enter_context(construction_override(module, name, stand_in))
            super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        for name in self._afd_eplb_lists:
            getattr(self, name).clear()
        # The MoE layers this drafter sends to the FFN role (afd-runtime hooks its forward).
        self.afd_draft_layer_indices = tuple(sorted(int(i) for i in self.model.layers))
        self._afd_classify = deepseek_draft_classifier(
            afd.compute_gate_on_attention, attention_routes=afd.num_ffn_ranks > 1
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._afd_classify is not None:
            weights = filter_role_weights(weights, AFDRole.ATTENTION, self._afd_classify)
        loaded: set[str] = set(super().load_weights(weights))  # type: ignore[misc]
        # vLLM's MTP proposer then replaces this model's token embedding with the target
        # model's (one tensor), so it is not counted here a second time.
        self.afd_param_bytes = param_bytes(self) - param_bytes(self.model.embed_tokens)  # type: ignore[arg-type]
        return loaded


class AFDDeepSeekMTP(DeepSeekLayoutDrafterMixin, upstream_mtp.DeepSeekMTP):
    """``DeepSeekMTP`` (architecture ``DeepSeekMTPModel``) on the Attention role, its layer's
    ``DeepseekV2MoE`` replaced by :class:`AFDAttnDeepseekV2MoE` (see the mixin)."""

    _afd_stand_ins = ((upstream, "DeepseekV2MoE", AFDAttnDeepseekV2MoE),)
