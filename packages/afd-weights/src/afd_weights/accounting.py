"""Weight accounting: the bytes a module's parameters occupy.

Invariants: a tensor reachable under two names (tied weights) is counted once; buffers (rotary
caches and the like) are not weights and are never counted; nothing is copied or moved.
"""

from __future__ import annotations

import torch


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters (a tensor shared by two names counted once).

    Buffers (rotary caches and the like) are not weights and are not counted.
    """
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    for t in module.parameters():
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
