"""Routed TP padding as pure functions (TP ranks simulated in one process).

The multi-process gloo version of these checks is in test_remote_tp_gloo.py.
"""

from __future__ import annotations

import pytest
import torch
from afd_core.errors import AFDError
from afd_remote import (
    AFDRemoteError,
    RoutedTPPadding,
    plan_routed_dispatch,
    restore_dispatched_output,
    slice_for_dispatch,
)


def _parent(rows: int, width: int = 3) -> torch.Tensor:
    # Row i starts with i + 1, so every real row is identifiable and non-zero.
    base = torch.arange(1, rows + 1, dtype=torch.float32).unsqueeze(1)
    return base * torch.tensor([1.0, 10.0, 100.0][:width])


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4, 5])
def test_every_token_dispatched_once_and_restored(tp_size: int) -> None:
    for rows in range(21):
        x = _parent(rows)
        ids = torch.arange(rows)
        layouts = [plan_routed_dispatch(rows, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
        local = [slice_for_dispatch(x, lay) for lay in layouts]
        local_ids = [slice_for_dispatch(ids, lay, field="input_ids") for lay in layouts]
        per_rank = -(-rows // tp_size)
        # Slices are contiguous, in rank order, and cover exactly the parent: no padding row
        # is sent; only the last ranks' slices are short (or empty).
        assert torch.equal(torch.cat(local), x)
        assert torch.equal(torch.cat(local_ids), ids)
        sizes = [t.shape[0] for t in local]
        assert sizes == [lay.local_tokens for lay in layouts] and sum(sizes) == rows
        assert all(s <= per_rank for s in sizes)
        outputs = [t * 2 + 1 for t in local]
        # The all-gather sees every rank's output zero-padded to per_rank rows.
        gathered = torch.cat(
            [torch.cat((o, torch.zeros(per_rank - o.shape[0], 3))) for o in outputs]
        )
        for lay in layouts:
            restored = restore_dispatched_output(outputs[lay.tp_rank], lay, lambda _, g=gathered: g)
            assert torch.equal(restored, x * 2 + 1)


def test_layout_numbers() -> None:
    lay = plan_routed_dispatch(17, tp_rank=3, tp_size=4)
    assert (lay.rows_per_rank, lay.padded_tokens, lay.local_start, lay.local_stop) == (
        5,
        20,
        15,
        20,
    )
    assert lay.requires_tp_all_gather
    assert lay.local_tokens == 2  # rows 15 and 16: the slice clipped to the 17 tokens
    empty = plan_routed_dispatch(0, tp_rank=1, tp_size=2)
    assert (empty.rows_per_rank, empty.padded_tokens, empty.local_start) == (0, 0, 0)


@pytest.mark.parametrize(("tp_size", "use_sp"), [(1, False), (1, True), (4, True)])
def test_passthrough_returns_the_same_tensors(tp_size: int, use_sp: bool) -> None:
    x = _parent(5)
    lay = plan_routed_dispatch(
        5, tp_rank=tp_size - 1, tp_size=tp_size, use_sequence_parallel=use_sp
    )
    assert not lay.requires_tp_all_gather
    assert (lay.local_start, lay.local_stop, lay.padded_tokens) == (0, 5, 5)
    assert slice_for_dispatch(x, lay) is x
    out = x * 2
    assert restore_dispatched_output(out, lay, None) is out


def test_padding_object_without_group_is_tp1() -> None:
    pad = RoutedTPPadding(None)
    assert (pad.tp_rank, pad.tp_size, pad.is_passthrough) == (0, 1, True)
    lay = pad.plan(3)
    x = _parent(3)
    assert pad.slice(x, lay) is x
    assert pad.restore(x, lay) is x


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_tokens": -1, "tp_rank": 0, "tp_size": 1}, "parent_tokens"),
        ({"num_tokens": 2, "tp_rank": 0, "tp_size": 0}, "tp_size"),
        ({"num_tokens": 2, "tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"num_tokens": 2, "tp_rank": -1, "tp_size": 2}, "tp_rank"),
        ({"num_tokens": 2.0, "tp_rank": 0, "tp_size": 2}, "parent_tokens"),
        (
            {"num_tokens": 2, "tp_rank": 0, "tp_size": 2, "use_sequence_parallel": 1},
            "use_sequence_parallel",
        ),
    ],
)
def test_layout_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(AFDRemoteError) as info:
        plan_routed_dispatch(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert isinstance(info.value, AFDError)


def _no_gather(_: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the collective must not run after a failed check")


def test_slice_and_restore_reject_wrong_rows_before_the_collective() -> None:
    lay = plan_routed_dispatch(5, tp_rank=0, tp_size=2)
    with pytest.raises(AFDRemoteError) as info:
        slice_for_dispatch(torch.zeros(4, 2), lay, field="router_logits")
    assert (info.value.field, info.value.value) == ("router_logits", (4, 2))
    with pytest.raises(AFDRemoteError) as info:
        slice_for_dispatch(torch.tensor(1.0), lay)
    assert info.value.field == "hidden_states"
    with pytest.raises(AFDRemoteError) as info:
        restore_dispatched_output(torch.zeros(2, 2), lay, _no_gather)
    assert (info.value.field, info.value.value) == ("local_output", (2, 2))
    with pytest.raises(AFDRemoteError) as info:
        restore_dispatched_output(torch.zeros(3, 2), lay, None)
    assert info.value.field == "gather"
    with pytest.raises(AFDRemoteError) as info:
        restore_dispatched_output(torch.zeros(3, 2), lay, lambda t: t)
    assert info.value.field == "gathered_output"


def test_padding_rejects_non_bool_sp() -> None:
    with pytest.raises(AFDRemoteError) as info:
        RoutedTPPadding(None, use_sequence_parallel="yes")  # type: ignore[arg-type]
    assert info.value.field == "use_sequence_parallel"
