"""MegaCompute: one fused dispatch + expert FFN + combine call per layer, bound to a comm group."""

from __future__ import annotations

import torch
from afd_weights import QuantizedExpertWeights

from afd_compute_npu._base import build_compute_state
from afd_compute_npu.backend import ComputeBackend
from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.errors import ComputeConfigError, MegaNotBoundError
from afd_compute_npu.inputs import validate_inputs
from afd_compute_npu.signature import ComputeGraphSignature

__all__ = ["MegaCompute"]


class MegaCompute:
    """Fused expert compute, constructed directly from the weight contract (never via Layered).

    Lifecycle: construct -> :meth:`bind` (once the connector is initialised, with the values it
    exposes) -> call. Invariants:

    * calling before :meth:`bind` raises :class:`MegaNotBoundError` before any side effect;
    * Mega keeps only the :class:`MegaCommParams` values, never a connector object;
    * binding twice raises (a captured graph depends on the group); no W8A8 zero bias exists here;
    * the workspace is allocated once at construction; the result is ``workspace.out[:T]``.
    """

    kind = "mega"

    def __init__(
        self, weights: QuantizedExpertWeights, config: ComputeConfig, backend: ComputeBackend
    ) -> None:
        ws, prepared = build_compute_state("mega", weights, config, backend)
        self.weights = weights
        self.config = config
        self.backend = backend
        self.workspace = ws
        self._prepared = prepared
        self._comm: MegaCommParams | None = None

    @property
    def is_bound(self) -> bool:
        """Whether :meth:`bind` has run."""
        return self._comm is not None

    @property
    def comm(self) -> MegaCommParams:
        """The bound communication parameters; raises :class:`MegaNotBoundError` when unbound."""
        if self._comm is None:
            raise MegaNotBoundError(
                "MegaCompute is not bound: call bind(MegaCommParams(...)) after the connector is "
                "initialised and before warmup, capture or the first forward"
            )
        return self._comm

    def bind(self, params: MegaCommParams) -> None:
        """Attach the communication parameters (exactly once)."""
        if not isinstance(params, MegaCommParams):
            raise ComputeConfigError("params", type(params).__name__, "MegaCommParams")
        if self._comm is not None:
            raise ComputeConfigError(
                "params", params.group_name, f"no second bind (bound to {self._comm.group_name!r})"
            )
        self._comm = params

    @property
    def graph_signature(self) -> ComputeGraphSignature:
        """Graph key of this compute object (requires :meth:`bind`)."""
        comm = self.comm
        return ComputeGraphSignature(
            kind=self.kind,
            backend=self.backend.name,
            weights=self.weights.signature,
            max_tokens=self.config.max_tokens,
            top_k=self.config.top_k,
            dtype=str(self.config.dtype),
            group_name=comm.group_name,
            world_size=comm.world_size,
        )

    def __call__(
        self,
        layer_id: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Routed-expert output ``[T, H]`` of ``layer_id`` (a view of the workspace).

        Bound to ``W > 1`` ranks, ``topk_ids`` are global (expert ``e`` lives on group rank
        ``e // E_local``) and every rank of the group calls once per layer, also with ``T = 0``
        (the dispatch and combine are a collective over the group)."""
        comm = self.comm
        validate_inputs(
            self.weights,
            self.config,
            layer_id,
            hidden_states,
            topk_ids,
            topk_weights,
            num_experts=self.weights.geometry.num_experts * comm.world_size,
        )
        t = int(hidden_states.shape[0])
        if t or comm.world_size > 1:
            self.backend.run_mega(
                self._prepared[layer_id],
                self.weights,
                self.workspace,
                comm,
                hidden_states,
                topk_ids,
                topk_weights,
            )
        return self.workspace.out[:t]
