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

Hot path (recycle): the buffer handed out last is tried first (request/reply: it is free again
and warm in cache), then the one after it (a caller that keeps the previous result alternates
between two); only when both are busy or do not fit does the pool scan the key's buffers.
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


class _Slot:
    """A recycled buffer and what the hot path compares against (plain Python values)."""

    __slots__ = ("buf", "dtype", "handle", "idle", "rows", "trailing")

    def __init__(self, buf: torch.Tensor) -> None:
        assert _storage_use_count is not None
        self.buf = buf
        self.rows: int = buf.shape[0]
        self.trailing = tuple(buf.shape[1:])
        self.dtype = buf.dtype
        # The storage's handle for the use-count hook (valid while the slot keeps ``buf``) and
        # the storage's use count when only the pool holds it.
        self.handle = int(buf.untyped_storage()._cdata)
        self.idle = _storage_use_count(self.handle)

    def is_free(self) -> bool:
        """No tensor but the pool's own references this buffer's memory."""
        assert _storage_use_count is not None
        return _storage_use_count(self.handle) <= self.idle

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A new view of ``shape`` over this buffer, or ``None`` (busy, or it does not fit)."""
        assert _storage_use_count is not None
        rows = shape[0]
        if (
            _storage_use_count(self.handle) > self.idle
            or self.rows < rows
            or self.dtype != dtype
            or self.trailing != shape[1:]
        ):
            return None
        return _view(self.buf, rows)


def _view(buf: torch.Tensor, rows: int) -> torch.Tensor:
    """A new tensor object over the first ``rows`` rows (``detach`` is the cheapest alias)."""
    return buf.detach() if buf.shape[0] == rows else buf[:rows]


class _Ring:
    """A key's recycled buffers and the index of the one handed out last."""

    __slots__ = ("last", "slots")

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.last = 0


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
        self._recycled: dict[tuple[int, ...], _Ring] = {}

    def get(self, key: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` to receive into, for the transfer slot ``key``."""
        ring = self._recycled.get(key)
        if ring is not None:
            # The hot paths: request/reply hands out the same buffer again (free and warm);
            # a caller that keeps the previous result alternates between two.
            slots = ring.slots
            i = ring.last
            view = slots[i].take(shape, dtype)
            if view is not None:
                return view
            i = i + 1 if i + 1 < len(slots) else 0
            view = slots[i].take(shape, dtype)
            if view is not None:
                ring.last = i
                return view
        if self.policy == "recycle":
            return self._recycle(key, shape, dtype)
        if self.policy == "fresh":
            return torch.empty(shape, dtype=dtype, device=self.device)
        turn = self._turns.get(key, 0)
        self._turns[key] = (turn + 1) % 3
        kept_key = (*key, turn)
        buf = self._kept.get(kept_key)
        if buf is None or not self._fits(buf, shape, dtype):
            buf = self._new(shape, dtype)
            self._kept[kept_key] = buf
        return _view(buf, shape[0])

    def _recycle(
        self, key: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """Scan ``key``'s buffers for a free one that fits, else allocate (kept within budget)."""
        ring = self._recycled.get(key)
        if ring is None:
            ring = self._recycled[key] = _Ring()
        slots = ring.slots
        count = len(slots)
        # Start after the buffer handed out last: in a burst the next one along is usually free.
        for step in range(1, count + 1):
            i = (ring.last + step) % count
            slot = slots[i]
            view = slot.take(shape, dtype)
            if view is not None:
                ring.last = i
                return view
            if slot.is_free():
                # Free but it does not fit: drop it (a new buffer is kept below only within the
                # key's byte budget, so a burst of small buffers cannot all grow large).
                del slots[i]
                break
        buf = self._new(shape, dtype)
        if len(slots) < RECYCLE_SLOTS or (
            len(slots) < RECYCLE_MAX_SLOTS
            and sum(s.buf.nbytes for s in slots) + buf.nbytes <= RECYCLE_BYTES
        ):
            ring.last = len(slots)
            slots.append(_Slot(buf))
        else:
            ring.last = min(ring.last, len(slots) - 1)
        return _view(buf, shape[0])

    def clear(self) -> None:
        """Drop every buffer (the tensors callers still hold stay valid)."""
        self._kept.clear()
        self._turns.clear()
        self._recycled.clear()

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((max(shape[0], 1), *shape[1:]), dtype=dtype, device=self.device)

    @staticmethod
    def _fits(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return buf.dtype == dtype and buf.shape[0] >= shape[0] and buf.shape[1:] == shape[1:]
