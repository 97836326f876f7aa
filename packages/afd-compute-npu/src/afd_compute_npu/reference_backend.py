"""The reference torch backend (CPU and CUDA): the math of :mod:`afd_compute_npu.reference`."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from afd_weights import LayerCodes, QuantizedExpertWeights, layer_codes

from afd_compute_npu.backend import ComputeBackend, ComputeKind
from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.errors import ComputeConfigError
from afd_compute_npu.group_exchange import combine_over_group
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
    decoded to fp32); that cache belongs to the compute object, the contract is untouched. Mega
    bound to one rank runs the local expert math. Bound to ``W > 1`` ranks it does what the fused
    kernel's dispatch and combine do, through the bound torch.distributed group
    (:attr:`MegaCommParams.group`, :func:`~afd_compute_npu.group_exchange.combine_over_group`):
    each rank computes its own experts' share of every rank's rows (the one-rank math with the
    other experts' slots at weight 0), the shares are summed over the group (fp32) and scaled
    after the sum, so a token whose experts all live on one rank gets exactly the one-rank
    result.
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

        def moe(x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor, scale: float) -> torch.Tensor:
            return reference_moe(
                x,
                ids,
                p,
                layer_args,
                weights.scheme.is_int4,
                weights.swiglu_limit,
                scale,
                ws.out.dtype,
            )

        if comm.world_size == 1:
            ws.out[:t].copy_(moe(hidden_states, topk_ids, probs, weights.routed_scaling_factor))
            return
        group = comm.group
        if group is None:
            raise ComputeConfigError(
                "group",
                None,
                f"the torch.distributed group behind {comm.group_name!r} (the reference runs "
                f"Mega's dispatch and combine over its {comm.world_size} ranks through it)",
            )
        combined = combine_over_group(
            group,
            comm.world_size,
            comm.rank,
            layer_args.w13_codes.shape[0],
            hidden_states,
            topk_ids,
            probs,
            lambda x, ids, p: moe(x, ids, p, 1.0),
        )
        if combined is None:  # every rank's call is empty: nothing to exchange
            return
        out = ws.out[:t]
        out.copy_(combined)
        if weights.routed_scaling_factor != 1.0:  # after the sum, as the one-rank math scales
            out.mul_(weights.routed_scaling_factor)
