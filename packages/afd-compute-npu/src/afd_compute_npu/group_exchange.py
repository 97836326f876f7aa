"""Mega's dispatch and combine over a torch.distributed group, as plain collectives.

What the fused kernel does over ``W`` ranks, each holding ``E_local`` contiguous experts (expert
``e`` on rank ``e // E_local``): every rank's tokens reach the ranks of their top-k experts and
come back summed. :func:`combine_over_group` does it with an all-gather of every rank's rows, a
``share`` computed by each rank for all of them (only the slots of its own experts, with local
ids; the others at weight 0) and an fp32 all-reduce of the shares; each rank keeps its own rows.
The reference backend's Mega runs its quantized math through it, and afd-runtime its float
reference (the accuracy measurement), so both see the same exchange.

Every rank of the group must call it once per layer, with 0 rows too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Share", "combine_over_group"]

#: ``(hidden [N, H], local ids [N, k], weights [N, k]) -> [N, H]``: one rank's share of ``N`` rows
#: (slots of other ranks' experts have weight 0 and local id 0).
Share = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def combine_over_group(
    group: Any,
    world_size: int,
    rank: int,
    experts_per_rank: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    share: Share,
) -> torch.Tensor | None:
    """This rank's rows of the group's combined output ``[T, H]`` (fp32), or ``None`` when no
    rank of the group has a row (nothing is exchanged then). ``topk_ids`` are global."""
    t = int(hidden_states.shape[0])
    count = torch.tensor([t], dtype=torch.int64, device=hidden_states.device)
    sizes = [int(c) for c in _all_gather(group, world_size, count).flatten().tolist()]
    if not sum(sizes):
        return None
    x, ids, p = (
        _gather_rows(group, world_size, rows, sizes)
        for rows in (hidden_states, topk_ids.long(), topk_weights)
    )
    mine = torch.div(ids, experts_per_rank, rounding_mode="floor") == rank
    local_ids = torch.where(mine, ids - rank * experts_per_rank, 0)
    shares = share(x, local_ids, torch.where(mine, p, torch.zeros_like(p))).float()
    group.allreduce([shares]).wait()  # the sum over the group
    start = sum(sizes[:rank])
    return shares[start : start + t]


def _all_gather(group: Any, world_size: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` of every group rank, stacked in rank order (equal shapes)."""
    out = [torch.empty_like(tensor) for _ in range(world_size)]
    group.allgather([out], [tensor]).wait()
    return torch.stack(out)


def _gather_rows(group: Any, world_size: int, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every group rank's ``rows`` (rank ``r`` has ``sizes[r]``), concatenated in rank order."""
    padded = rows.new_zeros((max(max(sizes), 1), *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    gathered = _all_gather(group, world_size, padded)
    return torch.cat([gathered[r, :n] for r, n in enumerate(sizes)])
