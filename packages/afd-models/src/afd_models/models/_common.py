"""Role-aware building blocks shared by the AFD model adapters.

* :class:`RemoteMoEBlock` (Attention role) replaces an upstream sparse-MoE block: the router gate
  (when on Attention) and the shared experts stay local, the routed experts run on the FFN role
  through the ``afd::remote_ffn`` op (afd-remote's ``AFDAttentionFusedMoE``), and the outputs are combined exactly where and how upstream's
  ``MoERunner`` combines them (``shared + routed``, routed scaling applied to the routed part).
* :class:`FFNMoEBlock` (FFN role) holds the upstream ``FusedMoE`` (a vLLM ``MoERunner`` with no
  shared experts) and the gate when the gate is on the FFN role.
* :class:`AFDFFNCausalLM` is the whole FFN-role model: only the MoE blocks, at the same module
  paths as upstream so checkpoint names load unchanged.
* :class:`AFDRoleModelMixin` is the shared top of every ``*ForCausalLM`` adapter: it returns the
  FFN model on the FFN role (built from the adapter's FFN block builder), ends the Attention-role
  constructor (classifier, ``afd_moe_layer_indices``, ``afd_payload_spec``, the "no routed experts
  live here" EPLB attributes) and filters the Attention role's checkpoint. An adapter supplies
  only small model-specific hooks (MoE-layer rule, expert count, classifier, FFN block builder,
  router dtype, weights mapper, EPLB extras).

Weight bytes are measured with :func:`afd_weights.param_bytes`; an adapter that swaps an upstream
block class during construction uses :func:`afd_models.models._construction.construction_override`.
No afd-runtime internals are imported here.

Invariants: no attention, KV or embedding weights exist on the FFN role; no routed-expert weights
exist on the Attention role.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from afd_core.config import AFDConfig, AFDRole, parse_afd_config
from afd_core.expert_map import ExpertMap
from afd_core.metadata import AFDPayloadSpec
from afd_core.topology import AFDTopology
from afd_weights import QuantScheme, param_bytes
from torch import nn

from afd_models._weight_utils import Classifier, FilterStats, filter_role_weights, layer_index
from afd_models.models import _remote_op as _remote_op  # registers afd::remote_ffn
from afd_models.models._quantized import (
    float_moe,
    quant_scheme,
    quantize_experts,
    report_error_requested,
    route,
)

logger = logging.getLogger(__name__)


def afd_config_of(vllm_config: Any) -> AFDConfig | None:
    """The AFD config in ``vllm_config.additional_config`` (``None`` without AFD)."""
    return parse_afd_config(getattr(vllm_config, "additional_config", None))


def attention_payload_spec(
    vllm_config: Any,
    *,
    num_experts: int,
    gate_on_attention: bool,
    router_dtype: Any = None,
    top_k: int | None = None,
    input_ids: bool = False,
) -> AFDPayloadSpec:
    """The payload an Attention adapter sends per MoE layer: hidden states, + router logits when
    the gate is on Attention, + the tokens' ids with ``input_ids`` (token-id routing); with
    expert parallelism (``num_ffn_ranks > 1``) hidden states + the global top-k ids and weights
    (``top_k`` required)."""
    dtype = vllm_config.model_config.dtype
    afd = afd_config_of(vllm_config)
    if afd is not None and afd.num_ffn_ranks > 1:
        if input_ids:
            raise ValueError(
                f"num_ffn_ranks={afd.num_ffn_ranks} with a token-id routed model; allowed: "
                "num_ffn_ranks=1 (expert-parallel dispatch carries no input_ids)"
            )
        if top_k is None:
            raise ValueError("top_k is required for the expert-parallel payload")
        return AFDPayloadSpec(
            hidden_size=int(vllm_config.model_config.get_hidden_size()), dtype=dtype, top_k=top_k
        )
    return AFDPayloadSpec(
        hidden_size=int(vllm_config.model_config.get_hidden_size()),
        dtype=dtype,
        router_logits_width=num_experts if gate_on_attention else None,
        router_logits_dtype=(router_dtype or dtype) if gate_on_attention else None,
        input_ids=input_ids,
    )


def afd_role_of(vllm_config: Any) -> AFDRole | None:
    """The AFD role of ``vllm_config`` (``None`` without AFD)."""
    cfg = afd_config_of(vllm_config)
    return None if cfg is None else cfg.role


class RemoteMoEBlock(nn.Module):
    """Attention-side sparse-MoE block whose routed experts live on the FFN role.

    The gate and shared-expert modules are registered under the attribute names given
    (``gate_attr`` / ``shared_attr``) so checkpoint names match upstream's; either may be ``None``.
    """

    def __init__(
        self,
        *,
        layer_idx: int,
        gate: nn.Module | None,
        shared_experts: nn.Module | None,
        routed_scaling_factor: float = 1.0,
        gate_attr: str = "gate",
        shared_attr: str = "shared_experts",
        router: Any = None,
        num_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.routed_scaling_factor = routed_scaling_factor
        # Expert parallel: the model's own vLLM router (the one plain vLLM's FusedMoE builds
        # from the same arguments), so the top-k sent to the FFN ranks is plain vLLM's.
        self.afd_router = router
        self.afd_num_experts = num_experts
        self._gate_attr = gate_attr
        self._shared_attr = shared_attr
        # Under TP the shared experts are sharded with reduce_results=False (upstream all-reduces
        # shared + routed once); the routed output arrives whole (all-gathered), so only the
        # shared part is all-reduced here.
        self._tp_size = _remote_op.tp_world_size()
        setattr(self, gate_attr, gate)
        setattr(self, shared_attr, shared_experts)

    def forward(
        self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``input_ids`` (token-id routed models): the tokens' ids, sent with the rows."""
        squeeze = hidden_states.dim() == 1
        hidden_dim = hidden_states.shape[-1]
        x = hidden_states.view(-1, hidden_dim)
        gate = getattr(self, self._gate_attr)
        shared_experts = getattr(self, self._shared_attr)
        router_logits = gate(x)[0] if gate is not None else None
        shared = shared_experts(x) if shared_experts is not None else None
        if shared is not None and self._tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            shared = tensor_model_parallel_all_reduce(shared)
        if input_ids is not None:
            routed = torch.ops.afd.remote_ffn_ids(x, router_logits, input_ids, self.layer_idx)
        elif self.afd_router is not None:
            assert router_logits is not None and self.afd_num_experts is not None
            weights, ids = self.afd_router.select_experts(x, router_logits)
            routed = torch.ops.afd.remote_ffn_routed(
                x, weights, ids, self.layer_idx, self.afd_num_experts
            )
        else:
            routed = torch.ops.afd.remote_ffn(x, router_logits, self.layer_idx)
        scale = self.routed_scaling_factor
        if scale != 1.0:
            # vLLM's MoERunner._maybe_apply_routed_scale_to_output, verbatim in effect.
            if routed.dtype != torch.float16 or shared is None:
                routed = routed * scale
            else:
                shared = shared * (1.0 / scale)
        out = shared + routed if shared is not None else routed
        return out.squeeze(0) if squeeze else out


class FFNMoEBlock(nn.Module):
    """FFN-side sparse-MoE block: the upstream FusedMoE (MoERunner) and, optionally, the gate."""

    def __init__(
        self,
        *,
        gate: nn.Module | None,
        experts: nn.Module,
        routed_scaling_factor: float,
        gate_on_ffn: bool,
        expert_map: ExpertMap | None = None,
        ffn_rank: int = 0,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.gate_on_ffn = gate_on_ffn
        self.experts = experts
        # Expert parallel: this rank's experts of ``expert_map``; forward() is given the global
        # top-k and the FusedMoE (built by build_expert_parallel_experts) computes local slots.
        self.expert_map = expert_map
        self.ffn_rank = ffn_rank
        # Quantized experts with one FFN rank: this layer's vLLM router (set by the model).
        self.afd_router: Any = None
        self._local_table = None if expert_map is None else expert_map.local_table(ffn_rank)
        # The Attention side applies upstream's routed scaling rule (see RemoteMoEBlock), so the
        # runner returns the unscaled routed output.
        self.upstream_routed_scaling_factor = routed_scaling_factor
        if hasattr(experts, "routed_scaling_factor"):
            setattr(experts, "routed_scaling_factor", 1.0)  # noqa: B010 - nn.Module attr typing

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids is not None:
            # Token-id routing (hash layers): the runner routes by the ids, upstream's call.
            if topk is not None or not self.gate_on_ffn:
                raise ValueError(
                    "input_ids given with top-k or with the gate on Attention; allowed: "
                    "token-id routing with the gate on the FFN role and one FFN rank"
                )
            return self.experts(
                hidden_states=hidden_states, router_logits=hidden_states, input_ids=input_ids
            )
        if topk is not None:
            if self.expert_map is None:
                raise ValueError("top-k given to an FFN block without an expert map")
            weights, ids = self.expert_map.localise(
                self.ffn_rank, topk[0], topk[1], self._local_table
            )
            return self.experts(
                hidden_states=hidden_states, router_logits=pack_local_topk(weights, ids)
            )
        if not self.gate_on_ffn:
            if router_logits is None:
                raise ValueError(
                    "router_logits is None but the gate is on the Attention role "
                    "(afd.compute_gate_on_attention=true requires logits from Attention)"
                )
            return self.experts(hidden_states=hidden_states, router_logits=router_logits)
        # The MoERunner holds the gate and computes the logits itself, exactly as upstream.
        return self.experts(hidden_states=hidden_states, router_logits=hidden_states)


def pack_local_topk(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rank-local top-k ``[n, k]`` weights and ids as one float32 ``[n, 2k]`` tensor: what the
    expert-parallel FusedMoE gets as its "router logits" (ids < 2**24 are exact in float32)."""
    return torch.cat([weights.to(torch.float32), ids.to(torch.float32)], dim=1)


def given_topk_routing(
    hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``custom_routing_function`` of an expert-parallel FFN rank: the routing was done on
    the Attention role (the model's router) and localised by :class:`FFNMoEBlock`; this only
    unpacks :func:`pack_local_topk` (no renormalisation: the weights are final)."""
    k = gating_output.shape[1] // 2
    if k != topk:
        raise ValueError(f"packed top-k has {k} slots; this FusedMoE was built for {topk}")
    return gating_output[:, :k].contiguous(), gating_output[:, k:].to(torch.int32).contiguous()


def build_expert_parallel_experts(
    vllm_config: Any,
    prefix: str,
    *,
    num_local: int,
    top_k: int,
    hidden_size: int,
    intermediate_size: int,
) -> nn.Module:
    """The FusedMoE of an expert-parallel FFN rank: ``num_local`` experts, ``min(top_k,
    num_local)`` slots per token, the routing given (:func:`given_topk_routing`), no gate, no
    shared experts, no routed scaling (the Attention role applies upstream's scaling rule)."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    return FusedMoEFactory(
        shared_experts=None,
        gate=None,
        num_experts=num_local,
        top_k=min(top_k, num_local),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        renormalize=False,
        quant_config=vllm_config.quant_config,
        custom_routing_function=given_topk_routing,
        prefix=f"{prefix}.experts",
    )


def build_router(**router_kwargs: Any) -> Any:
    """vLLM's MoE router for ``router_kwargs`` (``create_fused_moe_router``'s arguments, the
    ones upstream's FusedMoE passes): the Attention role routes exactly like plain vLLM."""
    from vllm.model_executor.layers.fused_moe.router.router_factory import (
        create_fused_moe_router,
    )

    return create_fused_moe_router(**router_kwargs)


class _FFNLayer(nn.Module):
    def __init__(self, mlp: nn.Module | None, attr: str = "mlp") -> None:
        super().__init__()
        if mlp is not None:
            setattr(self, attr, mlp)


class _FFNDecoder(nn.Module):
    def __init__(self, layers: list[_FFNLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class AFDFFNCausalLM(nn.Module):
    """The FFN role's model: MoE blocks only, at upstream module paths (``model.layers.<i>.mlp``).

    Implements :class:`afd_runtime.compute.AFDFFNModel`.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        moe_layer_indices: Iterable[int],
        build_block: Callable[[int, str], FFNMoEBlock],
        classify: Classifier,
        payload_spec: AFDPayloadSpec,
        prefix: str = "",
        weights_mapper: Any = None,
        local_experts: tuple[int, ...] | None = None,
        quant: tuple[QuantScheme, int] | None = None,
        compute_top_k: int | None = None,
        moe_attr: str = "mlp",
        draft_layer_indices: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        # The draft model's MoE layers (e.g. DeepSeek's MTP layer), also in
        # afd_moe_layer_indices: steps marked is_draft run only these.
        self.afd_draft_layer_indices: tuple[int, ...] = tuple(draft_layer_indices)
        # The decoder layer's attribute holding the MoE block (``mlp``; DeepSeek-V4: ``ffn``).
        self._moe_attr = moe_attr
        #: Expert parallel: the routed experts this FFN rank holds (loads), else ``None``.
        self.afd_local_experts = local_experts
        # Quantized experts (expert_quant != none): (scheme, group size) and the compute's top-k
        # width; each block routes with its own ``afd_router`` (one FFN rank; expert parallel
        # routes on Attention).
        self._quant = quant
        self.afd_compute_top_k = compute_top_k
        self.afd_moe_layer_indices: tuple[int, ...] = tuple(moe_layer_indices)
        self.afd_payload_spec = payload_spec
        wanted = set(self.afd_moe_layer_indices)
        model_prefix = f"{prefix}.model" if prefix else "model"
        layers = [
            _FFNLayer(
                build_block(i, f"{model_prefix}.layers.{i}.{moe_attr}") if i in wanted else None,
                moe_attr,
            )
            for i in range(num_layers)
        ]
        self.model = _FFNDecoder(layers)
        # vLLM registers each FusedMoE here by prefix; a dropped draft layer leaves no entry.
        from vllm.config import get_current_vllm_config_or_none

        current = get_current_vllm_config_or_none()
        self._static_forward_context: dict[str, Any] = (
            {} if current is None else current.compilation_config.static_forward_context
        )
        self._classify = classify
        self._mapper = weights_mapper
        self.afd_filter_stats = FilterStats()

    def afd_ffn_forward(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block: Any = getattr(self.model.layers[layer_idx], self._moe_attr)
        if input_ids is not None:
            return block(hidden_states, router_logits, topk, input_ids)
        if topk is None:
            return block(hidden_states, router_logits)
        return block(hidden_states, router_logits, topk)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("the AFD FFN model is driven by the FFN service, not by forward()")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        kept = filter_role_weights(
            weights,
            AFDRole.FFN,
            self._classify,
            self.afd_filter_stats,
            local_experts=self.afd_local_experts,
        )
        loader = AutoWeightsLoader(self)
        loaded = set(loader.load_weights(kept, mapper=self._mapper))
        self._drop_unshipped_draft_layers(loaded)
        if self._quant is not None:
            # Before vLLM's post-load processing (which would repack the float experts).
            blocks = {
                i: getattr(self.model.layers[i], self._moe_attr) for i in self.afd_moe_layer_indices
            }
            first = self.afd_moe_layer_indices[0] if report_error_requested() else None
            self.afd_quantized_weights, self.afd_float_reference = quantize_experts(
                blocks, *self._quant, keep_float_layer=first
            )
            self.afd_param_bytes = param_bytes(self) + self.afd_quantized_weights.nbytes()
            return loaded
        self.afd_param_bytes = param_bytes(self)  # before vLLM's post-load repacking
        return loaded

    def _drop_unshipped_draft_layers(self, loaded: set[str]) -> None:
        """Serve a draft (MTP) layer only when the checkpoint shipped its weights.

        Published checkpoints often declare a draft layer in their config
        (``num_nextn_predict_layers``) and ship none of its tensors (transformers saves none;
        quantized and fine-tuned derivatives drop them). Plain vLLM then serves the target model
        alone; here such a layer is removed (its modules, and its layer index from the served
        ones), so the connector handshake tells an Attention role that drafts through it that
        this FFN does not serve it. A layer with any loaded tensor is kept whole."""
        absent = [
            i
            for i in self.afd_draft_layer_indices
            if not any(layer_index(name) == i for name in loaded)
        ]
        if not absent:
            return
        for i in absent:
            self.model.layers[i] = _FFNLayer(None)
            prefix = f"model.layers.{i}."
            for key in [k for k in self._static_forward_context if prefix in k]:
                del self._static_forward_context[key]
        self.afd_draft_layer_indices = tuple(
            i for i in self.afd_draft_layer_indices if i not in absent
        )
        self.afd_moe_layer_indices = tuple(i for i in self.afd_moe_layer_indices if i not in absent)
        logger.warning(
            "AFD FFN: the checkpoint ships no weights for its draft (MTP) layer(s) %s; serving "
            "the target model's layers only (an Attention role drafting through them is refused)",
            absent,
        )

    def afd_reference_output(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
    ) -> torch.Tensor | None:
        """fp32 output of ``layer_idx`` with its float experts, when they were kept for the
        accuracy measurement (``AFD_REPORT_QUANT_ERROR=1``), else ``None``."""
        kept = getattr(self, "afd_float_reference", None)
        if kept is None or kept[0] != layer_idx:
            return None
        return float_moe(hidden_states, kept[1], kept[2], weights, ids)

    def afd_route(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank-local top-k of one layer's tokens for the quantized compute (see
        :func:`afd_models.models._quantized.route`)."""
        return route(
            getattr(self.model.layers[layer_idx], self._moe_attr),
            hidden_states,
            router_logits,
            topk,
        )


def no_routed_experts_eplb(num_experts: int) -> dict[str, Any]:
    """The EPLB attributes of an Attention model that holds none of its ``num_experts`` routed
    experts (what upstream's MoE-layer counting would set with no local experts), for adapters
    whose Attention role does not run that counting (:meth:`AFDRoleModelMixin._afd_eplb_attributes`)."""
    return {
        "num_moe_layers": 0,
        "num_expert_groups": 1,
        "num_shared_experts": 0,
        "num_logical_experts": num_experts,
        "num_physical_experts": num_experts,
        "num_routed_experts": num_experts,
        "num_redundant_experts": 0,
    }


class AFDRoleModelMixin:
    """Shared top of every AFD ``*ForCausalLM`` adapter (put it first in the bases).

    * Construction on the FFN role returns the FFN-only model that
      :meth:`_afd_build_ffn_model` builds instead of the upstream class.
    * The adapter's Attention-role ``__init__`` builds its model and ends with
      :meth:`_afd_init_attention_role`, which sets what the Attention worker and EPLB read.
    * ``load_weights`` on the Attention role drops every checkpoint tensor the adapter's
      classifier (``self._afd_classify``, ``None`` without AFD) assigns elsewhere, in one pass,
      then records ``afd_param_bytes`` before vLLM's post-load processing repacks weights.

    An adapter supplies only what is model-specific, through the hooks below: where its config
    lives (:meth:`_afd_hf_config`), upstream's MoE-layer rule (:meth:`_afd_is_moe_layer`), the
    number of routed experts, its checkpoint classifier, its FFN block builder, the router-logits
    dtype, the checkpoint-name mapper and the EPLB attributes upstream's constructor would not
    leave right (:meth:`_afd_eplb_attributes`).
    """

    _afd_classify: Classifier | None = None
    #: ``AutoWeightsLoader`` mapper of the FFN model (upstream's ``hf_to_vllm_mapper``, if any).
    _afd_weights_mapper: ClassVar[Any] = None
    #: The decoder layer's attribute holding the MoE block (upstream's module path).
    _afd_moe_attr: ClassVar[str] = "mlp"

    # -- hooks (model-specific) -------------------------------------------------------------

    @staticmethod
    def _afd_hf_config(vllm_config: Any) -> Any:
        """The Hugging Face config upstream's constructor reads (default: the text config)."""
        return vllm_config.model_config.hf_text_config

    @staticmethod
    def _afd_is_moe_layer(config: Any, layer_idx: int) -> bool:
        """Upstream's rule for which decoder layers are sparse-MoE."""
        raise NotImplementedError

    @staticmethod
    def _afd_num_experts(config: Any) -> int:
        """The number of routed experts (the router-logits width)."""
        raise NotImplementedError

    @staticmethod
    def _afd_classifier(
        config: Any, gate_on_attention: bool, attention_routes: bool = False
    ) -> Classifier:
        """The checkpoint-name classifier (see :mod:`afd_models._weight_utils`);
        ``attention_routes``: the Attention role selects the experts (expert parallelism), so
        whatever only expert selection reads (a routing bias) loads there."""
        raise NotImplementedError

    @staticmethod
    def _afd_build_ffn_block(vllm_config: Any, prefix: str, gate_on_attention: bool) -> FFNMoEBlock:
        """The FFN-side block of the MoE layer at ``prefix`` (``...layers.<i>.mlp``)."""
        raise NotImplementedError

    @staticmethod
    def _afd_top_k(config: Any) -> int:
        """Routed experts per token."""
        return int(config.num_experts_per_tok)

    @staticmethod
    def _afd_router_kwargs(config: Any) -> dict[str, Any]:
        """``create_fused_moe_router`` arguments of upstream's FusedMoE (expert parallelism
        routes on the Attention role with them), but the routing bias (see
        :meth:`_afd_uses_routing_bias`)."""
        raise NotImplementedError

    @staticmethod
    def _afd_uses_routing_bias(config: Any) -> bool:
        """True when expert selection adds a per-layer learned bias (DeepSeek-V3's
        ``e_score_correction_bias``): every router outside the FusedMoE then needs its layer's
        bias parameter (:meth:`afd_router`)."""
        return False

    @staticmethod
    def _afd_routes_by_token_id(config: Any) -> bool:
        """True when some MoE layer routes by token id (the payload then carries
        ``input_ids`` for every layer; the FFN block is given them)."""
        return False

    @staticmethod
    def _afd_router_dtype(config: Any) -> Any:
        """The router-logits dtype (``None``: the model dtype)."""
        return None

    @staticmethod
    def _afd_eplb_attributes(config: Any) -> dict[str, Any]:
        """EPLB attributes to set on the Attention model besides ``moe_layers = []`` and
        ``num_local_physical_experts = 0`` (those upstream's constructor did not set right)."""
        return {}

    @staticmethod
    def _afd_num_draft_layers(config: Any) -> int:
        """MoE layers of the checkpoint's own draft model after its ``num_hidden_layers``
        (DeepSeek's MTP layers, ``num_nextn_predict_layers``); 0 without one."""
        return 0

    # -- shared behaviour -------------------------------------------------------------------

    @classmethod
    def _afd_moe_layer_indices(cls, config: Any) -> tuple[int, ...]:
        return tuple(i for i in range(config.num_hidden_layers) if cls._afd_is_moe_layer(config, i))

    @classmethod
    def _afd_draft_layer_indices(cls, config: Any) -> tuple[int, ...]:
        """The draft model's MoE layer indices, ``num_hidden_layers ..`` (the checkpoint names
        them so). The FFN role serves their routed experts beside the target's (each FFN rank
        its share); the Attention role's drafter holds the rest of them."""
        n = int(config.num_hidden_layers)
        return tuple(range(n, n + cls._afd_num_draft_layers(config)))

    @classmethod
    def _afd_payload_spec(cls, vllm_config: Any, afd: AFDConfig) -> AFDPayloadSpec:
        """What the Attention role sends per MoE layer; both roles build it (the connector
        handshake compares them)."""
        config = cls._afd_hf_config(vllm_config)
        return attention_payload_spec(
            vllm_config,
            num_experts=cls._afd_num_experts(config),
            gate_on_attention=afd.compute_gate_on_attention,
            router_dtype=cls._afd_router_dtype(config),
            top_k=cls._afd_top_k(config),
            input_ids=cls._afd_routes_by_token_id(config),
        )

    @classmethod
    def _afd_expert_map(cls, vllm_config: Any, afd: AFDConfig) -> ExpertMap | None:
        """The placement of the routed experts when expert parallel (``None`` with one FFN)."""
        if afd.num_ffn_ranks == 1:
            return None
        config = cls._afd_hf_config(vllm_config)
        return AFDTopology.from_config(afd).expert_map(cls._afd_num_experts(config))

    @classmethod
    def afd_router(cls, config: Any, bias: torch.Tensor | None) -> Any:
        """vLLM's router of one MoE layer as upstream's FusedMoE builds it, with that layer's
        routing ``bias`` parameter (the router reads it at every call, so it may be loaded
        later), which the model needs exactly when :meth:`_afd_uses_routing_bias`."""
        kwargs = cls._afd_router_kwargs(config)
        if cls._afd_uses_routing_bias(config) != (bias is not None):
            raise ValueError(
                f"routing bias {'missing' if bias is None else 'given'} for a model that "
                f"{'uses' if bias is None else 'has'} {'one' if bias is None else 'none'}"
            )
        if bias is not None:
            kwargs["e_score_correction_bias"] = bias
        return build_router(**kwargs)

    @classmethod
    def afd_attention_router(
        cls, vllm_config: Any, bias: torch.Tensor | None = None
    ) -> tuple[Any, int] | None:
        """Expert parallel, Attention role: ``(vLLM router, num_experts)`` for the adapter's
        :class:`RemoteMoEBlock` (``None`` with one FFN rank); ``bias``: see :meth:`afd_router`."""
        afd = afd_config_of(vllm_config)
        if afd is None or afd.num_ffn_ranks == 1:
            return None
        config = cls._afd_hf_config(vllm_config)
        return cls.afd_router(config, bias), cls._afd_num_experts(config)

    @classmethod
    def _afd_build_ep_block(
        cls, vllm_config: Any, prefix: str, emap: ExpertMap, ffn_rank: int
    ) -> FFNMoEBlock:
        config = cls._afd_hf_config(vllm_config)
        experts = build_expert_parallel_experts(
            vllm_config,
            prefix,
            num_local=emap.num_local(ffn_rank),
            top_k=cls._afd_top_k(config),
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
        )
        return FFNMoEBlock(
            gate=None,
            experts=experts,
            routed_scaling_factor=1.0,
            gate_on_ffn=False,
            expert_map=emap,
            ffn_rank=ffn_rank,
        )

    @classmethod
    def _afd_build_ffn_model(cls, vllm_config: Any, prefix: str) -> AFDFFNCausalLM:
        """The FFN role's model: the adapter's FFN block at every MoE layer, upstream paths."""
        config = cls._afd_hf_config(vllm_config)
        afd = afd_config_of(vllm_config)
        assert afd is not None
        gate_on_attention = afd.compute_gate_on_attention
        emap = cls._afd_expert_map(vllm_config, afd)
        build_block: Callable[[int, str], FFNMoEBlock]
        if emap is None:
            local = None

            def build_block(_i: int, p: str) -> FFNMoEBlock:
                return cls._afd_build_ffn_block(vllm_config, p, gate_on_attention)
        else:
            local = emap.local_experts(afd.ffn_rank)

            def build_block(_i: int, p: str) -> FFNMoEBlock:
                return cls._afd_build_ep_block(vllm_config, p, emap, afd.ffn_rank)

        scheme = quant_scheme(afd)
        quant = None if scheme is None else (scheme, afd.expert_quant_group_size)
        top_k = cls._afd_top_k(config)
        if quant is not None and emap is None:
            # The quantized computes route here (one FFN rank): each block gets its layer's
            # router, with its routing bias when the model has one.
            build_float_block = build_block

            def build_block(i: int, p: str) -> FFNMoEBlock:
                block = build_float_block(i, p)
                bias = getattr(block.gate, "e_score_correction_bias", None)
                block.afd_router = cls.afd_router(config, bias)
                return block

        if emap is not None:
            top_k = min(top_k, emap.num_local(afd.ffn_rank))
        draft = cls._afd_draft_layer_indices(config)
        return AFDFFNCausalLM(
            num_layers=config.num_hidden_layers + len(draft),
            moe_layer_indices=cls._afd_moe_layer_indices(config) + draft,
            draft_layer_indices=draft,
            build_block=build_block,
            classify=cls._afd_classifier(
                config, gate_on_attention, attention_routes=emap is not None
            ),
            payload_spec=cls._afd_payload_spec(vllm_config, afd),
            prefix=prefix,
            weights_mapper=cls._afd_weights_mapper,
            local_experts=local,
            quant=quant,
            compute_top_k=top_k if quant is not None else None,
            moe_attr=cls._afd_moe_attr,
        )

    def _afd_init_attention_role(self, vllm_config: Any, afd: AFDConfig) -> None:
        """The end of every adapter's Attention-role ``__init__``.

        Sets the EPLB attributes for "no routed experts live here", the checkpoint classifier
        (``_afd_classify``), ``afd_moe_layer_indices`` and ``afd_payload_spec``.
        """
        config = self._afd_hf_config(vllm_config)
        # No routed experts live here: expose no MoE layers to EPLB.
        self.moe_layers: list[Any] = []
        self.num_local_physical_experts = 0
        for name, value in self._afd_eplb_attributes(config).items():
            setattr(self, name, value)
        self._afd_classify = self._afd_classifier(
            config, afd.compute_gate_on_attention, attention_routes=afd.num_ffn_ranks > 1
        )
        self.afd_moe_layer_indices = self._afd_moe_layer_indices(config)
        self.afd_draft_layer_indices = self._afd_draft_layer_indices(config)
        self.afd_payload_spec = self._afd_payload_spec(vllm_config, afd)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        vllm_config = kwargs.get("vllm_config")
        if afd_role_of(vllm_config) is AFDRole.FFN:
            return cls._afd_build_ffn_model(vllm_config, kwargs.get("prefix", ""))
        return super().__new__(cls)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self._afd_classify is not None:
            weights = filter_role_weights(weights, AFDRole.ATTENTION, self._afd_classify)
        loaded: set[str] = super().load_weights(weights)  # type: ignore[misc]
        # Measured here, before vLLM's post-load processing (CPU repacks linear weights into
        # kernel-private buffers and leaves empty Parameters behind).
        self.afd_param_bytes = param_bytes(self)  # type: ignore[arg-type]
        return loaded
