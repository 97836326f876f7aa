"""LayeredCompute: separate quantize/route, expert GEMMs and combine for one layer per call."""

from __future__ import annotations

import torch
from afd_weights import QuantizedExpertWeights

from afd_compute_npu._base import build_compute_state
from afd_compute_npu.backend import ComputeBackend
from afd_compute_npu.config import ComputeConfig
from afd_compute_npu.inputs import validate_inputs
from afd_compute_npu.signature import ComputeGraphSignature

__all__ = ["LayeredCompute"]


class LayeredCompute:
    """Expert compute as a pipeline of separate native steps; the FFN runner owns receive/send.

    Constructed directly (no factory) from the weight contract, an explicit :class:`ComputeConfig`
    and a backend. Invariants:

    * the workspace is allocated once here; calls only write views of it (stable data pointers);
    * the W8A8 path owns an int32 zero bias ``[E, H]`` that it passes to the native GEMM2;
    * the returned tensor is ``workspace.out[:T]``, valid until the next call.
    """

    kind = "layered"

    def __init__(
        self, weights: QuantizedExpertWeights, config: ComputeConfig, backend: ComputeBackend
    ) -> None:
        ws, prepared = build_compute_state("layered", weights, config, backend)
        self.weights = weights
        self.config = config
        self.backend = backend
        self.workspace = ws
        self._prepared = prepared

    @property
    def graph_signature(self) -> ComputeGraphSignature:
        """Graph key of this compute object."""
        return ComputeGraphSignature(
            kind=self.kind,
            backend=self.backend.name,
            weights=self.weights.signature,
            max_tokens=self.config.max_tokens,
            top_k=self.config.top_k,
            dtype=str(self.config.dtype),
        )

    def __call__(
        self,
        layer_id: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert output ``[T, H]`` of ``layer_id`` (a view of the workspace)."""
        validate_inputs(self.weights, self.config, layer_id, hidden_states, topk_ids, topk_weights)
        t = int(hidden_states.shape[0])
        if t:
            self.backend.run_layered(
                self._prepared[layer_id],
                self.weights,
                self.workspace,
                hidden_states,
                topk_ids,
                topk_weights,
            )
        return self.workspace.out[:t]
