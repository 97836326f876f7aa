"""The preallocated buffers a compute object owns and reuses on every call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ComputeWorkspace"]


@dataclass(frozen=True, eq=False)
class ComputeWorkspace:
    """Buffers sized once for ``max_tokens``; every call writes into views of them.

    * ``out`` ``[max_tokens, H]`` (compute dtype): the result; a call returns ``out[:T]``, which the
      next call overwrites.
    * ``topk_ids`` ``[max_tokens, K]`` int32: staging for the native ops' int32 ids.
    * ``topk_weights`` ``[max_tokens, K]``: router weights in the dtype the path consumes (compute
      dtype for Layered, fp32 for Mega).
    * ``group_list`` int64 ``[E]``: the cumulative group list (Layered W8A8 GEMM1).
    * ``zero_bias`` int32 ``[E, H]`` or None: the W8A8 zero bias Layered hands to the native GEMM2;
      Mega never has one.
    * ``expert_token_nums`` int32 ``[E]``: Mega's per-expert token counts output.

    Invariant: the buffers' data pointers never change after construction.
    """

    out: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    group_list: torch.Tensor
    expert_token_nums: torch.Tensor
    zero_bias: torch.Tensor | None

    @classmethod
    def allocate(
        cls,
        *,
        max_tokens: int,
        top_k: int,
        hidden: int,
        num_experts: int,
        dtype: torch.dtype,
        weights_dtype: torch.dtype,
        with_zero_bias: bool,
        device: torch.device,
    ) -> ComputeWorkspace:
        """Allocate every buffer once (zeros, so no uninitialised memory is ever read)."""
        return cls(
            out=torch.zeros(max_tokens, hidden, dtype=dtype, device=device),
            topk_ids=torch.zeros(max_tokens, top_k, dtype=torch.int32, device=device),
            topk_weights=torch.zeros(max_tokens, top_k, dtype=weights_dtype, device=device),
            group_list=torch.zeros(num_experts, dtype=torch.int64, device=device),
            expert_token_nums=torch.zeros(num_experts, dtype=torch.int32, device=device),
            zero_bias=(
                torch.zeros(num_experts, hidden, dtype=torch.int32, device=device)
                if with_zero_bias
                else None
            ),
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        """The allocated buffers by name (``zero_bias`` omitted when absent)."""
        names = ("out", "topk_ids", "topk_weights", "group_list", "expert_token_nums", "zero_bias")
        found = {n: getattr(self, n) for n in names}
        return {n: t for n, t in found.items() if t is not None}
