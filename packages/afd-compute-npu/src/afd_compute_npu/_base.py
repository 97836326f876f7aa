"""Construction logic shared by Layered and Mega (validation, workspace, backend preparation)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from afd_weights import QuantizedExpertWeights, QuantScheme

from afd_compute_npu.backend import ComputeBackend, ComputeKind
from afd_compute_npu.config import ComputeConfig
from afd_compute_npu.errors import ComputeConfigError
from afd_compute_npu.workspace import ComputeWorkspace

__all__ = ["build_compute_state"]


def build_compute_state(
    kind: ComputeKind,
    weights: QuantizedExpertWeights,
    config: ComputeConfig,
    backend: ComputeBackend,
) -> tuple[ComputeWorkspace, Mapping[int, object]]:
    """Validate ``weights``/``config``/``backend`` together, then allocate and prepare once."""
    if not isinstance(weights, QuantizedExpertWeights):
        raise ComputeConfigError("weights", type(weights).__name__, "QuantizedExpertWeights")
    if not isinstance(config, ComputeConfig):
        raise ComputeConfigError("config", type(config).__name__, "ComputeConfig")
    if not isinstance(backend, ComputeBackend):
        raise ComputeConfigError("backend", type(backend).__name__, "a ComputeBackend")
    geo = weights.geometry
    if config.top_k > geo.num_experts:
        raise ComputeConfigError("top_k", config.top_k, f"<= num_experts={geo.num_experts}")
    if config.swiglu_limit != weights.swiglu_limit:
        raise ComputeConfigError(
            "swiglu_limit", config.swiglu_limit, f"{weights.swiglu_limit} (the weights' value)"
        )
    if config.routed_scaling_factor != weights.routed_scaling_factor:
        raise ComputeConfigError(
            "routed_scaling_factor",
            config.routed_scaling_factor,
            f"{weights.routed_scaling_factor} (the weights' value)",
        )
    reason = backend.unsupported_reason(kind, weights, config)
    if reason is not None:
        raise ComputeConfigError("backend", backend.name, f"a backend that can run it: {reason}")
    ws = ComputeWorkspace.allocate(
        max_tokens=config.max_tokens,
        top_k=config.top_k,
        hidden=geo.hidden_size,
        num_experts=geo.num_experts,
        dtype=config.dtype,
        weights_dtype=config.dtype if kind == "layered" else torch.float32,
        with_zero_bias=kind == "layered" and weights.scheme is QuantScheme.W8A8,
        device=weights.device,
    )
    return ws, backend.prepare(kind, weights)
