"""Receive buffers for connectors: recycled (default), kept (stable addresses) or fresh.

A connector receives every transfer into a tensor it then hands to its caller. Allocating that
tensor fresh each time is cheap on CUDA/NPU (caching allocators) but not on CPU, where a large
tensor is mapped anew and every page faults and is zeroed when the transport first writes it
(about 1 ms per 16 MiB). :class:`RecvBufferPool` removes that cost without changing what callers
may do with a received tensor.

Policies, per pool:

* ``"recycle"`` (CPU default): buffers per key, kept while the key holds fewer than
  :data:`RECYCLE_SLOTS` of them or at most :data:`RECYCLE_BYTES` in all (and never more than
  :data:`RECYCLE_MAX_SLOTS`); a buffer is handed out again only when no tensor references its
  memory any more (the storage's use count is back to what the pool alone holds), so a tensor a
  caller keeps is never overwritten. Holding only a tensor's ``untyped_storage()`` object is not
  seen: keep the tensor (or a view) instead. When every kept buffer is busy and the key is full,
  the pool allocates a fresh, untracked tensor.
* ``"kept"`` (``reuse_buffers``): three buffers per key used in turn, stable addresses (what
  graph capture needs); a tensor is overwritten two receives later, whatever holds it.
* ``"fresh"``: a new tensor every time (non-CPU devices, or a torch without the use-count hook).

Invariants: a returned tensor is always a new view object (never the pool's own tensor), of
exactly the requested shape and dtype, on the pool's device; buffers only grow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

__all__ = ["RECYCLE_BYTES", "RECYCLE_MAX_SLOTS", "RECYCLE_SLOTS", "BufferPolicy", "RecvBufferPool"]

RECYCLE_SLOTS = 4
"""Recycled buffers a key may always keep, whatever their size."""

RECYCLE_BYTES = 64 << 20
"""Beyond :data:`RECYCLE_SLOTS`, a key keeps more buffers while their total stays within this."""

RECYCLE_MAX_SLOTS = 64
"""Most recycled buffers per key (bounds the scan for a free one)."""

BufferPolicy = Literal["recycle", "kept", "fresh"]

# Used by torch's own Inductor (cudagraph trees) for the same purpose; absent -> "fresh".
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _storage_handle(buf: torch.Tensor) -> int:
    """The storage's handle for the use-count hook (valid while ``buf`` lives: the pool keeps it)."""
    return int(buf.untyped_storage()._cdata)


def _view(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """A new tensor object over the first ``rows`` rows (``detach`` is the cheapest alias)."""
    return buf.detach() if buf.shape[0] == rows else buf[:rows]


class RecvBufferPool:
    """Receive buffers of one connector (see the module docstring)."""

    def __init__(self, device: torch.device, *, keep: bool) -> None:
        self.device = device
        self.policy: BufferPolicy
        if keep:
            self.policy = "kept"
        elif device.type == "cpu" and _storage_use_count is not None:
            self.policy = "recycle"
        else:
            self.policy = "fresh"
        self._kept: dict[tuple[int, ...], torch.Tensor] = {}
        self._turns: dict[tuple[int, ...], int] = {}
        # key -> [(buffer, its storage handle, the storage's use count when only the pool holds it)]
        self._recycled: dict[tuple[int, ...], list[tuple[torch.Tensor, int, int]]] = {}
        self._last: dict[tuple[int, ...], int] = {}  # key -> index of the buffer handed out last

    def get(self, key: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` to receive into, for the transfer slot ``key``."""
        if self.policy == "fresh":
            return torch.empty(shape, dtype=dtype, device=self.device)
        if self.policy == "kept":
            turn = self._turns.get(key, 0)
            self._turns[key] = (turn + 1) % 3
            kept_key = (*key, turn)
            buf = self._kept.get(kept_key)
            if buf is None or not self._fits(buf, shape, dtype):
                buf = self._new(shape, dtype)
                self._kept[kept_key] = buf
            return _view(buf, shape[0])
        use_count = _storage_use_count
        assert use_count is not None
        slots = self._recycled.setdefault(key, [])
        # Start at the buffer handed out last: in request/reply it is free again (and warm in
        # cache); in a burst the next one along usually is, so the scan stays short.
        start = self._last.get(key, 0)
        count = len(slots)
        for step in range(count):
            i = (start + step) % count
            buf, handle, idle = slots[i]
            if use_count(handle) <= idle:
                if not self._fits(buf, shape, dtype):
                    # Grow this free buffer, unless that breaks the key's budget: then drop it.
                    del slots[i]
                    break
                self._last[key] = i
                return _view(buf, shape[0])
        buf = self._new(shape, dtype)
        if len(slots) < RECYCLE_SLOTS or (
            len(slots) < RECYCLE_MAX_SLOTS
            and sum(b.nbytes for b, _, _ in slots) + buf.nbytes <= RECYCLE_BYTES
        ):
            self._last[key] = len(slots)
            slots.append(self._tracked(buf))
        return _view(buf, shape[0])

    @staticmethod
    def _tracked(buf: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        assert _storage_use_count is not None
        handle = _storage_handle(buf)
        return buf, handle, _storage_use_count(handle)

    def clear(self) -> None:
        """Drop every buffer (the tensors callers still hold stay valid)."""
        self._kept.clear()
        self._turns.clear()
        self._recycled.clear()
        self._last.clear()

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((max(shape[0], 1), *shape[1:]), dtype=dtype, device=self.device)

    @staticmethod
    def _fits(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return buf.dtype == dtype and buf.shape[0] >= shape[0] and buf.shape[1:] == shape[1:]
