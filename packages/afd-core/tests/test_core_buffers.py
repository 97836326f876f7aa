"""RecvBufferPool: recycled buffers are never handed out while a tensor references them."""

from __future__ import annotations

import pytest
import torch
from afd_core import buffers
from afd_core.buffers import RECYCLE_BYTES, RECYCLE_MAX_SLOTS, RECYCLE_SLOTS, RecvBufferPool

CPU = torch.device("cpu")


def test_policy_by_device_and_option() -> None:
    assert RecvBufferPool(CPU, keep=False).policy == "recycle"
    assert RecvBufferPool(CPU, keep=True).policy == "kept"
    assert RecvBufferPool(torch.device("meta"), keep=False).policy == "fresh"


def test_recycle_reuses_memory_only_when_unreferenced() -> None:
    pool = RecvBufferPool(CPU, keep=False)
    a = pool.get((0,), (4, 8), torch.float32)
    a_ptr = a.data_ptr()
    a.fill_(1.0)
    # Held by the caller: the next transfer gets other memory, ``a`` keeps its data.
    b = pool.get((0,), (4, 8), torch.float32)
    assert b.data_ptr() != a_ptr
    b.fill_(2.0)
    assert torch.equal(a, torch.ones(4, 8))
    # A view of ``a`` keeps its memory out of the pool as well.
    view = a[1:]
    del a
    c = pool.get((0,), (4, 8), torch.float32)
    assert c.data_ptr() not in (a_ptr, b.data_ptr())
    pooled = {a_ptr, b.data_ptr(), c.data_ptr()}
    del view, b, c
    # Nothing references them any more: memory comes back from the pool, same shape/dtype.
    d = pool.get((0,), (4, 8), torch.float32)
    assert d.data_ptr() in pooled and d.shape == (4, 8) and d.dtype == torch.float32
    # An alias made through DLPack (as `np.from_dlpack` and other libraries make) keeps it out too.
    d_ptr = d.data_ptr()
    alias = torch.from_dlpack(d)
    del d
    held = [pool.get((0,), (4, 8), torch.float32) for _ in range(3)]
    assert d_ptr not in {t.data_ptr() for t in held}
    assert alias.data_ptr() == d_ptr
    del alias, held
    again = [pool.get((0,), (4, 8), torch.float32) for _ in range(4)]  # held: all distinct
    assert d_ptr in {t.data_ptr() for t in again}


def test_recycle_prefers_the_buffer_handed_out_last() -> None:
    pool = RecvBufferPool(CPU, keep=False)
    first = pool.get((0,), (2, 8), torch.float32)
    second = pool.get((0,), (2, 8), torch.float32)
    ptr = second.data_ptr()
    del first, second
    # Request/reply: the same (warm) buffer again and again while each result is dropped.
    assert {pool.get((0,), (2, 8), torch.float32).data_ptr() for _ in range(5)} == {ptr}


def test_recycle_grows_and_bounds_slots() -> None:
    pool = RecvBufferPool(CPU, keep=False)
    small = pool.get((1,), (2, 8), torch.float32)
    ptr = small.data_ptr()
    del small
    fewer = pool.get((1,), (1, 8), torch.float32)  # fits: same memory, fewer rows
    assert fewer.data_ptr() == ptr and fewer.shape == (1, 8)
    del fewer
    bigger = pool.get((1,), (64, 8), torch.float32)  # grows the free slot
    assert bigger.shape == (64, 8)
    other_dtype = pool.get((1,), (64, 8), torch.float16)
    assert other_dtype.dtype == torch.float16
    held = [pool.get((2,), (3, 8), torch.float32) for _ in range(RECYCLE_MAX_SLOTS + 3)]
    assert len({t.data_ptr() for t in held}) == len(held)  # all distinct while held
    # Small buffers: up to the count cap.
    assert len(pool._recycled[(2,)].slots) == RECYCLE_MAX_SLOTS
    del held
    # Large buffers: RECYCLE_SLOTS always, more only within RECYCLE_BYTES.
    rows = RECYCLE_BYTES // (4 * 1024) // 2  # half the byte budget per buffer
    big = [pool.get((4,), (rows, 1024), torch.float32) for _ in range(RECYCLE_SLOTS + 2)]
    assert len(pool._recycled[(4,)].slots) == RECYCLE_SLOTS
    del big
    empty = pool.get((3,), (0, 8), torch.float32)
    assert empty.shape == (0, 8)


def test_recycle_growth_stays_within_the_byte_budget() -> None:
    pool = RecvBufferPool(CPU, keep=False)
    # A burst of small transfers leaves many small free buffers ...
    burst = [pool.get((5,), (1, 1024), torch.float32) for _ in range(RECYCLE_MAX_SLOTS)]
    del burst
    # ... then a burst of large ones (held together) must not grow them all past the budget.
    rows = RECYCLE_BYTES // (4 * 1024) // 8  # an eighth of the budget per buffer
    big = [pool.get((5,), (rows, 1024), torch.float32) for _ in range(RECYCLE_MAX_SLOTS)]
    assert all(t.shape == (rows, 1024) for t in big)
    assert len({t.data_ptr() for t in big}) == len(big)
    kept = pool._recycled[(5,)].slots
    assert sum(s.buf.nbytes for s in kept if s.rows >= rows) <= RECYCLE_BYTES


def test_kept_rotates_three_stable_buffers() -> None:
    pool = RecvBufferPool(CPU, keep=True)
    ptrs = [pool.get((0,), (4, 8), torch.float32).data_ptr() for _ in range(6)]
    assert ptrs[:3] == ptrs[3:] and len(set(ptrs[:3])) == 3


def test_fresh_without_use_count_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "_storage_use_count", None)
    pool = RecvBufferPool(CPU, keep=False)
    assert pool.policy == "fresh"
    assert pool.get((0,), (2, 3), torch.int64).shape == (2, 3)
