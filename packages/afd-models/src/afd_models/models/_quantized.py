"""Quantized experts on the FFN role (``expert_quant: w8a8 | w4a8``): quantize at load, drop the
float copy, route for afd-compute-npu's Layered / Mega.

The route is quantize-at-load (not a pre-quantized checkpoint): it serves every checkpoint the
adapters load, keeps the one-pass filter and expert ranges unchanged, and takes a second per MoE
layer on these sizes; each FFN rank quantizes only the experts it holds.

Invariants:

* after :func:`quantize_experts` no float expert tensor stays reachable from the model (the
  upstream FusedMoE leaves the module tree and its parameters are emptied: vLLM's own registry
  of layers may keep the module object, but not its storage);
* the quantized tensors are exactly afd-weights' export of the loaded float tensors (vLLM
  layout ``w13 [E, 2I, H]``, ``w2 [E, H, I]``), layer ids in the model's MoE-layer order;
* routing reproduces what the float path computes: the model's own vLLM router (one FFN rank)
  or the Attention role's top-k made rank-local (expert parallel).
"""

from __future__ import annotations

import os
from typing import Any, Final

import torch
from afd_core.config import AFDConfig
from afd_weights import QuantizedExpertWeights, QuantScheme, export_quantized_expert_weights

#: Set to ``1`` in an FFN process to measure, on the requests it serves, the max relative error of
#: its first MoE layer's quantized output against the same layer in fp32 (that one layer's float
#: experts then stay resident; ``afd demo`` sets it for quantized runs).
REPORT_ERROR_ENV: Final[str] = "AFD_REPORT_QUANT_ERROR"


def report_error_requested() -> bool:
    """Whether :data:`REPORT_ERROR_ENV` asks for the accuracy measurement."""
    return os.environ.get(REPORT_ERROR_ENV, "") == "1"


def float_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The fp32 routed-expert output with float experts (vLLM layout ``w13 [E, 2I, H]``, ``w2
    [E, H, I]``) and rank-local top-k: ``sum_k w_k * (silu(x W1^T) * (x W3^T)) W2^T``."""
    x = hidden_states.float()
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for k in range(ids.shape[1]):
        for e in torch.unique(ids[:, k]).tolist():
            rows = ids[:, k] == e
            h = x[rows] @ w13[e].float().T
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[rows] += weights[rows, k : k + 1].float() * (act @ w2[e].float().T)
    return out


def quant_scheme(afd: AFDConfig) -> QuantScheme | None:
    """The afd-weights scheme of ``afd.expert_quant`` (``None`` for ``none``)."""
    if afd.expert_quant == "none":
        return None
    if afd.expert_quant == "w8a8":
        return QuantScheme.W8A8
    return (
        QuantScheme.W4A8_PER_GROUP if afd.expert_quant_group_size else QuantScheme.W4A8_PER_CHANNEL
    )


def quantize_experts(
    blocks: dict[int, Any],
    scheme: QuantScheme,
    group_size: int,
    keep_float_layer: int | None = None,
) -> tuple[QuantizedExpertWeights, tuple[int, torch.Tensor, torch.Tensor] | None]:
    """Quantize every block's loaded float experts (the FusedMoE's routed experts' ``w13_weight``
    / ``w2_weight``) and drop them (see the module invariants).

    ``keep_float_layer``: keep that one layer's float tensors (``(layer, w13, w2)``, returned) for
    the accuracy measurement :data:`REPORT_ERROR_ENV` asks for; every other layer's are dropped.
    """
    sources = {}
    for layer, block in blocks.items():
        # vLLM 0.32's FusedMoE is a MoERunner whose routed_experts own the weights.
        holder = getattr(block.experts, "routed_experts", block.experts)
        sources[layer] = (holder.w13_weight.data, holder.w2_weight.data)
    weights = export_quantized_expert_weights(sources, scheme=scheme, group_size=group_size)
    kept = None
    if keep_float_layer is not None:
        w13, w2 = sources[keep_float_layer]
        kept = (keep_float_layer, w13.clone(), w2.clone())
    sources.clear()
    for block in blocks.values():
        # The gate (on this role) is applied with torch's linear on a copy taken now: vLLM's CPU
        # post-load step repacks linear weights into kernel buffers, and a GateLinear whose
        # FusedMoE left the module tree does not get its kernel.
        gate = getattr(block, "gate", None)
        weight = getattr(gate, "weight", None)
        block.afd_gate_weight = None if weight is None else weight.data.clone()
        holder = getattr(block.experts, "routed_experts", block.experts)
        block.experts = None
        # Only the routed experts' storage: the runner also holds the gate and its routing bias
        # (DeepSeek-V3's correction bias, shared with the block's router: still used).
        kept_params = set() if gate is None else {id(p) for p in gate.parameters()}
        for p in holder.parameters():
            if id(p) not in kept_params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    return weights, kept


def route(
    block: Any,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    topk: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-local top-k ``(weights float32, ids int32)`` of one layer's tokens: the global
    top-k localised (expert parallel), else the block's own router (``block.afd_router``)."""
    if topk is not None:
        if block.expert_map is None:
            raise ValueError("top-k given to an FFN block without an expert map")
        weights, ids = block.expert_map.localise(block.ffn_rank, topk[0], topk[1])
        return weights.float(), ids.to(torch.int32)
    router = block.afd_router
    if router is None:
        raise ValueError("no router: this FFN model was not built for quantized experts")
    if router_logits is None:
        gate_weight = getattr(block, "afd_gate_weight", None)
        if gate_weight is None:
            raise ValueError("router_logits is None but the gate is on the Attention role")
        router_logits = torch.nn.functional.linear(hidden_states, gate_weight)
    weights, ids = router.select_experts(hidden_states, router_logits)
    return weights.float(), ids.to(torch.int32)
