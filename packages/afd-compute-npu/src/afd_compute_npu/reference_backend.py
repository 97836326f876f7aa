"""The reference torch backend (CPU and CUDA): the math of :mod:`afd_compute_npu.reference`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from afd_weights import LayerCodes, QuantizedExpertWeights, layer_codes

from afd_compute_npu.backend import ComputeBackend, ComputeKind
from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.reference import (
    combine,
    dynamic_quant_int8,
    reference_moe,
    route,
    run_experts,
)
from afd_compute_npu.workspace import ComputeWorkspace

__all__ = ["ReferenceBackend"]


class ReferenceBackend(ComputeBackend):
    """Runs every scheme for both Layered and Mega.

    ``prepare`` decodes each layer once into :class:`~afd_weights.LayerCodes` (int4 unpacked, scales
    decoded to fp32); that cache belongs to the compute object, the contract is untouched. Mega's
    communication parameters are validated and kept by :class:`MegaCompute`, but the reference runs
    the local expert math only (it models one rank holding all of the contract's experts).
    """

    name = "reference"

    def unsupported_reason(
        self, kind: ComputeKind, weights: QuantizedExpertWeights, config: ComputeConfig
    ) -> str | None:
        return None

    def prepare(self, kind: ComputeKind, weights: QuantizedExpertWeights) -> Mapping[int, object]:
        return {lid: layer_codes(weights, lid) for lid in weights.layer_ids}

    def run_layered(
        self,
        layer_args: object,
        weights: QuantizedExpertWeights,
        ws: ComputeWorkspace,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        assert isinstance(layer_args, LayerCodes)
        t, k = topk_ids.shape
        probs = ws.topk_weights[:t]
        probs.copy_(topk_weights)
        q_x, s_x = dynamic_quant_int8(hidden_states)
        order, expanded_row_idx, counts = route(topk_ids, weights.geometry.num_experts)
        src = torch.div(order, k, rounding_mode="floor")
        y = run_experts(
            q_x.index_select(0, src),
            s_x.index_select(0, src),
            counts,
            layer_args,
            weights.scheme.is_int4,
            weights.swiglu_limit,
            ws.out.dtype,
        )
        out = ws.out[:t]
        out.copy_(combine(y, expanded_row_idx, probs, ws.out.dtype))
        if weights.routed_scaling_factor != 1.0:
            out.mul_(weights.routed_scaling_factor)

    def run_mega(
        self,
        layer_args: object,
        weights: QuantizedExpertWeights,
        ws: ComputeWorkspace,
        comm: MegaCommParams,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        assert isinstance(layer_args, LayerCodes)
        t = topk_ids.shape[0]
        probs = ws.topk_weights[:t]
        probs.copy_(topk_weights)
        ws.out[:t].copy_(
            reference_moe(
                hidden_states,
                topk_ids,
                probs,
                layer_args,
                weights.scheme.is_int4,
                weights.swiglu_limit,
                weights.routed_scaling_factor,
                ws.out.dtype,
            )
        )
