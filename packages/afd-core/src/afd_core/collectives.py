"""The TP row layout and all-gather shared by the Attention-side helpers (afd-remote, afd-cam)
and the runtime's step announcement.

:func:`rows_per_tp_rank` is the one rule for how many rows an Attention TP worker sends under
routed TP padding: afd-remote's layout slices by it and afd-runtime announces it to the FFN ranks,
so the counts the FFN expects and the rows that arrive cannot disagree.

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
    """Rows each of ``tp_size`` TP workers sends for ``num_tokens`` replicated tokens under
    routed TP padding: ``ceil(num_tokens / tp_size)`` (``num_tokens`` itself when
    ``tp_size == 1``; 0 for 0). The last workers' slices are completed with zero rows."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise AFDPayloadError("num_tokens", num_tokens, "an int >= 0")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise AFDPayloadError("tp_size", tp_size, "an int >= 1")
    return -(-num_tokens // tp_size)


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
