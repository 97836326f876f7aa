"""The TP row all-gather shared by the Attention-side helpers (afd-remote, afd-cam).

Layout code takes a :data:`RowGather` callable instead of a process group, so it can be tested
without ``torch.distributed``; :func:`torch_row_gather` binds one to a real group (gloo in tests,
vLLM's ``get_tp_group().device_group`` at runtime; this package never imports vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

RowGather = Callable[[torch.Tensor], torch.Tensor]
"""All-gathers equal-shaped tensors along dim 0 across the TP group, concatenated in rank order."""


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
