"""Layout conversion, padding and restoration: restore(prepare(x)) is exact for every layout.

Sequence-parallel layouts run one thread per TP rank with an in-process all-gather (a barrier and
a shared slot list), so every rank's result is checked against the same parent tensor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from afd_cam import (
    AFDCamError,
    CAMStageInputs,
    CAMStageLayout,
    prepare_stage_inputs,
    restore_stage_outputs,
    split_replicated,
)
from afd_core.collectives import RowGather
from hypothesis import given, settings
from hypothesis import strategies as st

T = TypeVar("T")


class ThreadWorld:
    """T threads acting as TP ranks; ``gather(rank)`` is an exact in-process all-gather."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.calls = 0

    def gather(self, rank: int) -> RowGather:
        def fn(local: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = local.clone()
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            out = torch.cat([s for s in self.slots if s is not None], dim=0)
            self.barrier.wait()
            return out

        return fn

    def run(self, fn: Callable[[int], T]) -> list[T]:
        results: list[object] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:
                errors[rank] = err
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        if any(t.is_alive() for t in threads):
            self.barrier.abort()
            raise AssertionError("a simulated TP rank did not finish")
        for err in errors:
            if err is not None:
                raise err
        return results  # type: ignore[return-value]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[CAMStageLayout, int, bool]:
    tp_size = draw(st.integers(1, 4))
    use_sp = draw(st.booleans())
    mult = tp_size if use_sp else 1
    counts = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    inputs = [-(-(c + draw(st.integers(0, 2))) // mult) * mult for c in counts]
    real = sum(counts)
    parent = -(-real // mult) * mult + mult * draw(st.integers(0, 2))
    layout = CAMStageLayout.from_token_counts(
        counts,
        input_tokens=inputs,
        parent_input_tokens=parent,
        tp_size=tp_size,
        use_sequence_parallel=use_sp,
    )
    width = draw(st.integers(1, 4))
    with_residual = draw(st.booleans())
    return layout, width, with_residual


def _for_rank(layout: CAMStageLayout, rank: int) -> CAMStageLayout:
    return CAMStageLayout(
        stages=layout.stages,
        parent_input_tokens=layout.parent_input_tokens,
        tp_size=layout.tp_size,
        tp_rank=rank,
        use_sequence_parallel=layout.use_sequence_parallel,
    )


def _parent(layout: CAMStageLayout, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1000, 1000, (layout.parent_input_tokens, width), generator=gen)
    x = x.to(torch.float32)
    x[layout.real_tokens :] = 0
    return x


def _expected_stage(x: torch.Tensor, layout: CAMStageLayout, idx: int, rank: int) -> torch.Tensor:
    stage = layout.stages[idx]
    full = torch.zeros((stage.input_tokens, x.shape[1]), dtype=x.dtype)
    full[: stage.actual_tokens] = x[stage.start : stage.stop]
    if layout.is_sharded:
        rows = stage.input_tokens // layout.tp_size
        return full[rank * rows : (rank + 1) * rows]
    return full


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 2**16))
def test_round_trip_is_exact_for_every_layout(
    spec: tuple[CAMStageLayout, int, bool], seed: int
) -> None:
    base, width, with_residual = spec
    hidden = _parent(base, width, seed)
    residual = _parent(base, width + 1, seed + 1) if with_residual else None
    world = ThreadWorld(base.tp_size)

    def rank_fn(rank: int) -> tuple[CAMStageInputs, tuple[torch.Tensor, torch.Tensor | None]]:
        layout = _for_rank(base, rank)
        local = layout.local_slice(layout.parent_input_tokens)
        gather = world.gather(rank)
        res_local = residual[local] if residual is not None else None
        inputs = prepare_stage_inputs(hidden[local], res_local, layout, gather)
        # A row-wise "FFN" so the check sees values, not just identity.
        outs = [h * 2 + 1 for h in inputs.hidden_states]
        restored = restore_stage_outputs(outs, inputs.residuals, layout, gather)
        identity = restore_stage_outputs(inputs.hidden_states, inputs.residuals, layout, gather)
        assert torch.equal(identity[0], hidden[local])
        return inputs, restored

    results = world.run(rank_fn)
    expected_ffn = hidden * 2 + 1
    expected_ffn[base.real_tokens :] = 0
    for rank, (inputs, (out, res_out)) in enumerate(results):
        layout = _for_rank(base, rank)
        local = layout.local_slice(layout.parent_input_tokens)
        for idx in range(layout.num_stages):
            assert torch.equal(
                inputs.hidden_states[idx], _expected_stage(hidden, layout, idx, rank)
            )
        assert torch.equal(out, expected_ffn[local])
        if residual is None:
            assert inputs.residuals is None
            assert res_out is None
        else:
            assert inputs.residuals is not None
            for idx in range(layout.num_stages):
                assert torch.equal(
                    inputs.residuals[idx], _expected_stage(residual, layout, idx, rank)
                )
            assert res_out is not None
            assert torch.equal(res_out, residual[local])
    # One collective per direction per rank when sharded (prepare, restore, identity restore).
    assert world.calls == (3 if base.is_sharded else 0)


def test_padding_rows_come_back_zero() -> None:
    layout = CAMStageLayout.from_token_counts([2, 1], input_tokens=[3, 2], parent_input_tokens=5)
    x = torch.arange(10, dtype=torch.float32).view(5, 2) + 1
    inputs = prepare_stage_inputs(x, None, layout)
    assert torch.equal(inputs.hidden_states[0], torch.tensor([[1.0, 2], [3, 4], [0, 0]]))
    assert torch.equal(inputs.hidden_states[1], torch.tensor([[5.0, 6], [0, 0]]))
    out, res = restore_stage_outputs(inputs.hidden_states, None, layout)
    assert res is None
    assert torch.equal(out[:3], x[:3])
    assert torch.equal(out[3:], torch.zeros(2, 2))


def test_stage_padding_rows_are_ignored_on_restore() -> None:
    layout = CAMStageLayout.from_token_counts([2, 1], input_tokens=[3, 2])
    outs = [torch.tensor([[1.0], [2.0], [99.0]]), torch.tensor([[3.0], [98.0]])]
    out, _ = restore_stage_outputs(outs, None, layout)
    assert torch.equal(out, torch.tensor([[1.0], [2.0], [3.0]]))


def test_split_replicated_positions_1d_and_2d() -> None:
    layout = CAMStageLayout.from_token_counts(
        [3, 2], tp_size=2, tp_rank=1, use_sequence_parallel=True, parent_input_tokens=6
    )
    pos = torch.arange(6)
    s0, s1 = split_replicated(pos, layout)
    assert torch.equal(s0, torch.tensor([0, 1, 2, 0]))
    assert torch.equal(s1, torch.tensor([3, 4]))
    mrope = torch.stack((pos, pos + 10, pos + 20))
    m0, m1 = split_replicated(mrope, layout)
    assert torch.equal(m0, torch.tensor([[0, 1, 2, 0], [10, 11, 12, 0], [20, 21, 22, 0]]))
    assert torch.equal(m1, torch.tensor([[3, 4], [13, 14], [23, 24]]))
    tok_first = torch.stack((pos, pos), dim=1)
    t0, _ = split_replicated(tok_first, layout, token_dim=0)
    assert torch.equal(t0, torch.tensor([[0, 0], [1, 1], [2, 2], [0, 0]]))


def test_split_replicated_rejects() -> None:
    layout = CAMStageLayout.from_token_counts([3])
    with pytest.raises(AFDCamError) as info:
        split_replicated(torch.arange(4), layout)
    assert info.value.field == "tensor"
    with pytest.raises(AFDCamError) as info:
        split_replicated(torch.arange(3), layout, token_dim=1)
    assert info.value.field == "token_dim"


def _sp_layout(rank: int = 0) -> CAMStageLayout:
    return CAMStageLayout.from_token_counts(
        [2, 2], tp_size=2, tp_rank=rank, use_sequence_parallel=True
    )


def _never_gather(_: torch.Tensor) -> torch.Tensor:
    raise AssertionError("the collective must not run after a failed check")


@pytest.mark.parametrize(
    ("hidden", "residual", "gather", "field"),
    [
        (torch.zeros(3, 2), None, _never_gather, "hidden_states"),
        (torch.zeros(2), None, _never_gather, "hidden_states"),
        (torch.zeros(2, 2), torch.zeros(1, 2), _never_gather, "residual"),
        (torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64), _never_gather, "residual"),
        (torch.zeros(2, 2), None, None, "gather"),
    ],
)
def test_prepare_rejects_before_gather(
    hidden: torch.Tensor, residual: torch.Tensor | None, gather: RowGather | None, field: str
) -> None:
    with pytest.raises(AFDCamError) as info:
        prepare_stage_inputs(hidden, residual, _sp_layout(), gather)
    assert info.value.field == field


def test_restore_rejects_row_mismatch_with_counts() -> None:
    layout = _sp_layout()
    with pytest.raises(
        AFDCamError, match="stage output token count mismatch: expected 1, got 2"
    ) as info:
        restore_stage_outputs([torch.zeros(1, 2), torch.zeros(2, 2)], None, layout, _never_gather)
    assert info.value.field == "hidden_states[1]"


@pytest.mark.parametrize(
    ("hidden", "residuals", "field"),
    [
        ([torch.zeros(1, 2)], None, "hidden_states"),
        ([torch.zeros(1, 2), torch.zeros(1, 3)], None, "hidden_states[1]"),
        ([torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64)], None, "hidden_states[1]"),
        ([torch.zeros(1, 2), torch.zeros(1, 2)], [torch.zeros(1, 2)], "residuals"),
        ([torch.zeros(1, 2), torch.zeros(1, 2)], [torch.zeros(1, 2), None], "residuals"),
        (
            [torch.zeros(1, 2), torch.zeros(1, 2)],
            [torch.zeros(1, 2), torch.zeros(2, 2)],
            "residuals[1]",
        ),
        (
            [torch.zeros(1, 2), torch.zeros(1, 2)],
            [torch.zeros(1, 2), torch.zeros(1, 3)],
            "residuals[1]",
        ),
    ],
)
def test_restore_rejects_before_gather(
    hidden: list[torch.Tensor], residuals: list[torch.Tensor | None] | None, field: str
) -> None:
    with pytest.raises(AFDCamError) as info:
        restore_stage_outputs(hidden, residuals, _sp_layout(), _never_gather)
    assert info.value.field == field


def test_mixed_residuals_message() -> None:
    with pytest.raises(AFDCamError, match="inconsistent residual layouts"):
        restore_stage_outputs(
            [torch.zeros(1, 2), torch.zeros(1, 2)], [None, torch.zeros(1, 2)], _sp_layout(), None
        )


def test_all_none_residuals_mean_no_residual() -> None:
    layout = CAMStageLayout.from_token_counts([1, 1])
    out, res = restore_stage_outputs([torch.ones(1, 2), torch.ones(1, 2)], [None, None], layout)
    assert res is None
    assert torch.equal(out, torch.ones(2, 2))


def test_restore_rejects_missing_gather_and_bad_gather() -> None:
    layout = _sp_layout()
    outs = [torch.zeros(1, 2), torch.zeros(1, 2)]
    with pytest.raises(AFDCamError) as info:
        restore_stage_outputs(outs, None, layout, None)
    assert info.value.field == "gather"
    with pytest.raises(AFDCamError) as info:
        restore_stage_outputs(outs, None, layout, lambda t: t)
    assert info.value.field == "gathered"
