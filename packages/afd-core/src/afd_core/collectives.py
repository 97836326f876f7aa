"""The TP row layout and all-gather shared by the Attention-side helpers (afd-remote, afd-cam)
and the runtime's step announcement.

:func:`rows_per_tp_rank` and :func:`tp_slice_rows` are the one rule for an Attention TP worker's
slice under routed TP padding: afd-remote's layout slices by them and afd-runtime announces
:func:`tp_slice_rows` to the FFN ranks, so the counts the FFN expects and the rows that arrive
cannot disagree.

Layout code takes a :data:`RowGather` callable instead of a process group, so it can be tested
without ``torch.distributed``; :func:`torch_row_gather` binds one to a real group (gloo in tests,
vLLM's ``get_tp_group().device_group`` at runtime; this package never imports vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from afd_core.errors import AFDPayloadError

RowGather = Callable[[torch.Tensor], torch.Tensor]
"""All-gathers equal-shaped tensors along dim 0 across the TP group, concatenated in rank order."""


def rows_per_tp_rank(num_tokens: int, tp_size: int) -> int:
    """The slice length of each of ``tp_size`` TP workers for ``num_tokens`` replicated tokens
    under routed TP padding: ``ceil(num_tokens / tp_size)`` (``num_tokens`` itself when
    ``tp_size == 1``; 0 for 0). The rows a worker actually sends are :func:`tp_slice_rows`; the
    all-gather pads every worker's output to this length locally."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise AFDPayloadError("num_tokens", num_tokens, "an int >= 0")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise AFDPayloadError("tp_size", tp_size, "an int >= 1")
    return -(-num_tokens // tp_size)


def tp_slice_rows(num_tokens: int, tp_size: int, tp_rank: int) -> int:
    """The real rows TP worker ``tp_rank`` sends of ``num_tokens`` replicated tokens: its slice
    ``[r * c, (r + 1) * c)`` (``c = rows_per_tp_rank``) clipped to the tokens. The zero rows
    that pad the last slices to ``c`` for the all-gather never travel, so the slices of ranks
    ``0..T-1`` add up to exactly ``num_tokens``."""
    per_rank = rows_per_tp_rank(num_tokens, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise AFDPayloadError("tp_rank", tp_rank, f"an int in 0..{tp_size - 1}")
    start = min(num_tokens, tp_rank * per_rank)
    return min(num_tokens, start + per_rank) - start


def torch_row_gather(group: dist.ProcessGroup | None) -> RowGather:
    """Return a :data:`RowGather` over ``group`` using ``torch.distributed.all_gather_single``.

    ``group=None`` means the default (world) group, as in ``torch.distributed``.
    """

    def gather(local: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(group)
        local = local.contiguous()
        out = local.new_empty((local.shape[0] * world, *local.shape[1:]))
        dist.all_gather_single(out, local, group=group)
        return out

    return gather
