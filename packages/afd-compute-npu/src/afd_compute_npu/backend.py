"""The backend interface Layered and Mega compute delegate the math to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Literal

import torch
from afd_weights import QuantizedExpertWeights

from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.workspace import ComputeWorkspace

__all__ = ["ComputeBackend", "ComputeKind"]

ComputeKind = Literal["layered", "mega"]


class ComputeBackend(ABC):
    """One implementation of the expert math (reference torch or Ascend native).

    Contract: :meth:`prepare` runs once at construction and returns per-layer arguments the compute
    object owns; ``run_*`` write exactly ``ws.out[:T]`` and allocate no workspace of their own.
    """

    name: str = "abstract"

    @abstractmethod
    def unsupported_reason(
        self, kind: ComputeKind, weights: QuantizedExpertWeights, config: ComputeConfig
    ) -> str | None:
        """``None`` when this backend can run ``kind`` on ``weights``; else why not."""

    @abstractmethod
    def prepare(self, kind: ComputeKind, weights: QuantizedExpertWeights) -> Mapping[int, object]:
        """Per-layer arguments, keyed by layer id."""

    @abstractmethod
    def run_layered(
        self,
        layer_args: object,
        weights: QuantizedExpertWeights,
        ws: ComputeWorkspace,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        """Layered path: separate quantize/route, GEMM1, GEMM2 and combine steps."""

    @abstractmethod
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
        """Mega path: one fused dispatch + FFN + combine call."""
