"""Per-call input validation shared by Layered and Mega (raises before any side effect)."""

from __future__ import annotations

import torch
from afd_weights import QuantizedExpertWeights

from afd_compute_npu.config import ComputeConfig
from afd_compute_npu.errors import ComputeInputError

__all__ = ["validate_inputs"]


def validate_inputs(
    weights: QuantizedExpertWeights,
    config: ComputeConfig,
    layer_id: object,
    hidden_states: object,
    topk_ids: object,
    topk_weights: object,
    *,
    num_experts: int | None = None,
) -> None:
    """Check one call's inputs against the weights and configuration.

    Accepted: ``layer_id`` one of the weights' ids; ``hidden_states`` ``[T, H]`` of the compute
    dtype with ``0 <= T <= max_tokens``; ``topk_ids`` ``[T, top_k]`` int32/int64 in ``[0, E)``
    (``E``: ``num_experts``, default the weights' experts; Mega over ``W`` ranks takes global
    ids, ``E = W x`` the weights' experts);
    ``topk_weights`` ``[T, top_k]`` floating and finite; all on the weights' device. Value checks
    (ids range, finiteness) run only when ``config.check_values``.
    """
    geo = weights.geometry
    if (
        isinstance(layer_id, bool)
        or not isinstance(layer_id, int)
        or (layer_id not in weights.layer_ids)
    ):
        raise ComputeInputError("layer_id", layer_id, f"one of {weights.layer_ids}")
    device = weights.device
    if not isinstance(hidden_states, torch.Tensor):
        raise ComputeInputError("hidden_states", type(hidden_states).__name__, "a torch.Tensor")
    if hidden_states.dim() != 2 or hidden_states.shape[1] != geo.hidden_size:
        raise ComputeInputError(
            "hidden_states.shape", tuple(hidden_states.shape), f"[T, {geo.hidden_size}]"
        )
    t = int(hidden_states.shape[0])
    if t > config.max_tokens:
        raise ComputeInputError("hidden_states.shape[0]", t, f"<= max_tokens={config.max_tokens}")
    if hidden_states.dtype != config.dtype:
        raise ComputeInputError("hidden_states.dtype", hidden_states.dtype, str(config.dtype))
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(tensor, torch.Tensor):
            raise ComputeInputError(name, type(tensor).__name__, "a torch.Tensor")
        if tuple(tensor.shape) != (t, config.top_k):
            raise ComputeInputError(f"{name}.shape", tuple(tensor.shape), f"{(t, config.top_k)}")
    assert isinstance(topk_ids, torch.Tensor) and isinstance(topk_weights, torch.Tensor)
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ComputeInputError("topk_ids.dtype", topk_ids.dtype, "torch.int32 or torch.int64")
    if not topk_weights.is_floating_point():
        raise ComputeInputError("topk_weights.dtype", topk_weights.dtype, "a floating dtype")
    for name, tensor in (
        ("hidden_states", hidden_states),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ):
        if tensor.device != device:
            raise ComputeInputError(f"{name}.device", tensor.device, str(device))
    if config.check_values and t:
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        experts = geo.num_experts if num_experts is None else num_experts
        if lo < 0 or hi >= experts:
            raise ComputeInputError(
                "topk_ids", f"values in [{lo}, {hi}]", f"values in [0, {experts})"
            )
        if not bool(torch.isfinite(topk_weights).all()):
            raise ComputeInputError("topk_weights", "non-finite values", "finite values")
