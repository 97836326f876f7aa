"""AFD adapter for vLLM's DeepSeek-V4 (``DeepseekV4ForCausalLM``, ``vllm.models.deepseek_v4``).

Registered under the upstream architecture name. Without ``additional_config["afd"]`` the class is
upstream's (the platform's implementation vLLM picks), unchanged.

* Attention role: upstream's constructor runs with its module's ``DeepseekV4MoE`` replaced (only
  during construction, :func:`afd_models.models._construction.construction_override`) by
  :class:`AFDAttnDeepseekV4MoE`: same signature, the shared expert local, the gate and routed
  experts remote. Sparse attention, the hyper-connection mixing, norms, embeddings and the LM head
  are upstream's (GPU kernels: upstream's attention needs CUDA events, so this role does not
  construct on a CPU-only torch).
* FFN role: the constructor returns an :class:`~afd_models.models._common.AFDFFNCausalLM` holding
  per layer (``model.layers.<i>.ffn``, every layer is sparse) upstream's FusedMoE configured as
  ``DeepseekV4MoE`` does (``sqrtsoftplus`` scoring, routed scaling, clamped SwiGLU, the
  ``noaux_tc`` correction bias, the hash table ``tid2eid`` on the first ``num_hash_layers``)
  with its gate, without the shared expert.

Hash routing: the first ``num_hash_layers`` layers choose experts by token id (``tid2eid``), so
the payload carries ``input_ids`` for every layer (``afd::remote_ffn_ids``) and the FFN block
hands them to the FusedMoE exactly as upstream does.

Refused before anything is built (:class:`afd_core.errors.AFDConfigError` naming the field):
``compute_gate_on_attention=true`` (hash layers score with the gate on the side that holds the
hash table), ``num_ffn_ranks > 1`` (expert-parallel dispatch carries no token ids) and quantized
experts (``expert_quant``: the hash router is not modelled by the quantized computes).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import torch
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, GateLinear
from vllm.model_executor.models.utils import WeightsMapper, extract_layer_index
from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM

from afd_models._weight_utils import Classifier, WeightOwner, classify_moe_weight, layer_index
from afd_models.models._common import (
    AFDFFNCausalLM,
    AFDRoleModelMixin,
    FFNMoEBlock,
    RemoteMoEBlock,
    afd_config_of,
)
from afd_models.models._construction import construction_override

#: The platform implementation vLLM picked (``cpu.model``, ``nvidia.model``, ...): the module
#: whose ``DeepseekV4MoE`` name upstream's decoder layer instantiates.
upstream = importlib.import_module(DeepseekV4ForCausalLM.__module__)

_EXPERT = ".ffn.experts."
_GATE = ".ffn.gate."


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule: every DeepSeek-V4 decoder layer has a sparse ``ffn``."""
    return True


def is_hash_layer(config: Any, layer_idx: int) -> bool:
    """Upstream's rule: the first ``num_hash_layers`` layers route by token id."""
    return layer_idx < int(getattr(config, "num_hash_layers", 0) or 0)


def deepseek_v4_classifier(num_layers: int) -> Classifier:
    """Checkpoint names (upstream's native layout, ``layers.<i>.ffn....``): routed experts and the
    gate (weight, ``bias`` = correction bias, ``tid2eid`` = hash table) -> FFN; the shared expert,
    attention, hyper-connection parameters, norms, embeddings, head -> Attention; MTP layers
    (``mtp.``, not served on CPU upstream either) and layers beyond ``num_layers`` -> neither."""

    def classify(name: str) -> WeightOwner:
        if name.startswith(("mtp.", "model.mtp.")):
            return WeightOwner.NONE
        idx = layer_index(name)
        if idx is not None and idx >= num_layers:
            return WeightOwner.NONE
        return classify_moe_weight(
            name, gate_on_attention=False, expert_marker=_EXPERT, gate_marker=_GATE
        )

    return classify


def check_afd_config(afd: AFDConfig) -> None:
    """Refuse what this adapter does not serve (see the module docstring), before any build."""
    if afd.num_ffn_ranks != 1:
        raise AFDConfigError(
            "num_ffn_ranks",
            afd.num_ffn_ranks,
            "1 for DeepSeek-V4 (expert-parallel dispatch carries no input_ids for hash routing)",
        )
    if afd.compute_gate_on_attention:
        raise AFDConfigError(
            "compute_gate_on_attention",
            True,
            "false for DeepSeek-V4 (hash layers score with the gate next to the hash table)",
        )
    if afd.expert_quant != "none":
        raise AFDConfigError(
            "expert_quant", afd.expert_quant, "'none' for DeepSeek-V4 (hash routing)"
        )


class AFDAttnDeepseekV4MoE(RemoteMoEBlock):
    """Attention-side stand-in for ``DeepseekV4MoE`` (same constructor signature)."""

    # Read by upstream's model (fused shared-expert resolution): never fused here.
    is_fused_shared_expert_enabled = False

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        afd = afd_config_of(vllm_config)
        if afd is None:
            raise RuntimeError("AFDAttnDeepseekV4MoE built without additional_config['afd']")
        check_afd_config(afd)
        shared = None
        if config.n_shared_experts is not None:
            shared = upstream.DeepseekV4MLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                swiglu_limit=config.swiglu_limit,
                quant_config=vllm_config.quant_config,
                reduce_results=False,
                prefix=f"{prefix}.shared_experts",
            )
        # Routed scaling is applied to the routing weights inside the FFN's FusedMoE (upstream's
        # router), so the routed output arrives scaled: nothing to rescale here.
        super().__init__(layer_idx=extract_layer_index(prefix), gate=None, shared_experts=shared)
        self.n_routed_experts = config.n_routed_experts
        self.n_shared_experts = config.n_shared_experts

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("DeepSeek-V4 AFD MoE needs input_ids (hash routing on the FFN role)")
        return super().forward(hidden_states, input_ids)


def build_ffn_block(vllm_config: VllmConfig, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
    """The FFN-side block of one DeepSeek-V4 layer, configured as upstream's ``DeepseekV4MoE``
    (gate, correction bias or hash table, router), without the shared expert."""
    config = vllm_config.model_config.hf_config
    gate = GateLinear(
        input_size=config.hidden_size,
        output_size=config.n_routed_experts,
        bias=False,
        out_dtype=torch.float32,
        prefix=f"{prefix}.gate",
    )
    gate.e_score_correction_bias = None
    gate.tid2eid = None
    hash_layer = is_hash_layer(config, extract_layer_index(prefix))
    if hash_layer:
        # Filled from the checkpoint; random ids (as upstream) keep dummy loads in range.
        gate.tid2eid = nn.Parameter(
            torch.randint(
                0,
                config.n_routed_experts,
                (config.vocab_size, config.num_experts_per_tok),
                dtype=torch.int32,
            ),
            requires_grad=False,
        )
    elif getattr(config, "topk_method", None) == "noaux_tc":
        gate.e_score_correction_bias = nn.Parameter(
            torch.empty(config.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
    experts = FusedMoEFactory(
        shared_experts=None,
        gate=gate,
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        renormalize=config.norm_topk_prob,
        quant_config=vllm_config.quant_config,
        prefix=f"{prefix}.experts",
        scoring_func=getattr(config, "scoring_func", "sqrtsoftplus"),
        routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0),
        e_score_correction_bias=gate.e_score_correction_bias,
        hash_indices_table=gate.tid2eid,
        swiglu_limit=config.swiglu_limit,
        router_logits_dtype=torch.float32,
    )
    if hash_layer:
        # As upstream: the monolithic apply path reads the table from the routed experts.
        object.__setattr__(experts.routed_experts, "hash_indices_table", gate.tid2eid)
    # Upstream's routed scaling lives in the router (it scales the routing weights; the runner's
    # output factor is 1.0 without apply_routed_scale_to_output), so the routed output leaves
    # this block scaled, as upstream's does.
    return FFNMoEBlock(gate=gate, experts=experts, routed_scaling_factor=1.0, gate_on_ffn=True)


#: Upstream's native checkpoint layout -> the FFN model's names: upstream's own prefix and
#: suffix rules, plus the routed experts' ``w1``/``w3``/``w2`` as the FusedMoE loader's
#: ``gate_proj``/``up_proj``/``down_proj`` (upstream's model-level loader does that mapping).
FFN_WEIGHTS_MAPPER = WeightsMapper(
    orig_to_new_prefix={"layers.": "model.layers."},
    orig_to_new_suffix={".ffn.gate.bias": ".ffn.gate.e_score_correction_bias"},
    orig_to_new_regex={
        re.compile(r"(\.ffn\.experts\.\d+)\.w1\."): r"\1.gate_proj.",
        re.compile(r"(\.ffn\.experts\.\d+)\.w3\."): r"\1.up_proj.",
        re.compile(r"(\.ffn\.experts\.\d+)\.w2\."): r"\1.down_proj.",
    },
)


class AFDDeepseekV4ForCausalLM(AFDRoleModelMixin, DeepseekV4ForCausalLM):
    """``DeepseekV4ForCausalLM`` that builds only its role's half under AFD."""

    _afd_is_moe_layer = staticmethod(is_moe_layer)
    _afd_build_ffn_block = staticmethod(build_ffn_block)
    _afd_weights_mapper = FFN_WEIGHTS_MAPPER
    _afd_moe_attr = "ffn"
    _afd_router_dtype = staticmethod(lambda config: torch.float32)

    @staticmethod
    def _afd_hf_config(vllm_config: Any) -> Any:
        return vllm_config.model_config.hf_config

    @staticmethod
    def _afd_num_experts(config: Any) -> int:
        return int(config.n_routed_experts)

    @staticmethod
    def _afd_routes_by_token_id(config: Any) -> bool:
        return bool(getattr(config, "num_hash_layers", 0))

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        # Only reached with expert parallelism or quantized experts, both refused first.
        raise AFDConfigError("ffn_compute", "routing outside the FusedMoE", "native, one FFN rank")

    @staticmethod
    def _afd_classifier(
        config: Any, gate_on_attention: bool, attention_routes: bool = False
    ) -> Classifier:
        return deepseek_v4_classifier(config.num_hidden_layers)

    @classmethod
    def _afd_build_ffn_model(cls, vllm_config: Any, prefix: str) -> AFDFFNCausalLM:
        afd = afd_config_of(vllm_config)
        assert afd is not None
        check_afd_config(afd)
        return super()._afd_build_ffn_model(vllm_config, prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = afd_config_of(vllm_config)
        if afd is None:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            self._afd_classify = None
            return
        check_afd_config(afd)
        with construction_override(upstream, "DeepseekV4MoE", AFDAttnDeepseekV4MoE):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._afd_init_attention_role(vllm_config, afd)
