"""Top-k routing on the Attention side (gate on Attention, connectors that carry top-k).

A :data:`RoutingFunction` maps ``(router_logits [tokens, experts], top_k, renormalize)`` to
``(topk_weights float32 [tokens, top_k], topk_ids int32 [tokens, top_k])``. Model adapters pass
their own (grouped top-k, sigmoid scoring, score-correction bias ...); :func:`softmax_topk` is the
plain softmax router. No vLLM import: the adapter owns any vLLM-specific selection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd_remote.errors import AFDRemoteError

RoutingFunction = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
"""``(router_logits, top_k, renormalize) -> (topk_weights, topk_ids)``."""


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in float32), keep the ``top_k`` largest per token.

    Returns ``(weights float32 [T, top_k], ids int32 [T, top_k])``; with ``renormalize`` each
    token's kept weights sum to 1. Ties resolve as ``torch.topk`` does (lower id first on CPU).

    Raises:
        AFDRemoteError: ``router_logits`` is not 2-D, or ``top_k`` is not in ``1..num_experts``.
    """
    if router_logits.dim() != 2:
        raise AFDRemoteError(
            "router_logits", tuple(router_logits.shape), "a 2-D [tokens, experts] tensor"
        )
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise AFDRemoteError("top_k", top_k, f"an int in 1..{num_experts} (the expert count)")
    scores = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
