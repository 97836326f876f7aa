"""TP/SP layout conversion, padding and output restoration for CAM pipeline stages.

:func:`prepare_stage_inputs` turns this rank's parent hidden states (and residuals) into one
padded input per stage; :func:`restore_stage_outputs` turns per-stage outputs back into the parent
layout. :func:`split_replicated` does the same split for replicated per-token tensors such as
positions.

Round trip (the property the tests check for every layout): for a parent tensor ``x`` in this
rank's layout whose padding rows (parent rows at or after ``layout.real_tokens``) are zero,
``restore_stage_outputs(prepare_stage_inputs(x))`` equals ``x`` exactly. Padding rows always come
back as zeros; real rows are never altered.

Under sequence parallelism each direction uses a single TP all-gather: hidden states and residuals
are concatenated on the last dimension (they must share dtype and device), and on the way back all
stages are gathered together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from afd_core.collectives import RowGather

from afd_cam.errors import AFDCamError
from afd_cam.layout import CAMStageLayout


@dataclass(frozen=True)
class CAMStageInputs:
    """Per-stage inputs in this rank's layout.

    Invariants: one entry per stage; ``hidden_states[i]`` has
    ``layout.local_rows(stages[i].input_tokens)`` rows; ``residuals`` is None or aligned with
    ``hidden_states`` row for row.
    """

    hidden_states: tuple[torch.Tensor, ...]
    residuals: tuple[torch.Tensor, ...] | None


def split_replicated(
    tensor: torch.Tensor, layout: CAMStageLayout, *, token_dim: int | None = None
) -> tuple[torch.Tensor, ...]:
    """Slice each stage's real rows out of a replicated parent tensor and zero-pad them.

    ``tensor`` holds the full parent batch on every rank (``parent_input_tokens`` entries on
    ``token_dim``). ``token_dim`` defaults to 0 for 1-D tensors and 1 for 2-D ones (vLLM's
    ``[axes, tokens]`` M-RoPE positions); pass it explicitly otherwise.

    Raises:
        AFDCamError: ``token_dim`` is out of range or has the wrong length.
    """
    if token_dim is None:
        token_dim = 1 if tensor.dim() == 2 else 0
    if not 0 <= token_dim < tensor.dim():
        raise AFDCamError("token_dim", token_dim, f"must index a dim of {tuple(tensor.shape)}")
    if tensor.shape[token_dim] != layout.parent_input_tokens:
        raise AFDCamError(
            "tensor",
            tuple(tensor.shape),
            f"expected {layout.parent_input_tokens} entries on token_dim={token_dim}",
        )
    moved = tensor.movedim(token_dim, 0)
    out = []
    for stage in layout.stages:
        rows = _pad_rows(moved[stage.start : stage.stop], stage.input_tokens)
        out.append(rows.movedim(0, token_dim))
    return tuple(out)


def prepare_stage_inputs(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    layout: CAMStageLayout,
    gather: RowGather | None = None,
) -> CAMStageInputs:
    """Convert this rank's parent hidden states (and residual) into padded per-stage inputs.

    TP layout: slice each stage from the replicated parent and zero-pad to ``input_tokens``.
    SP layout: all-gather the local shards (one collective), slice and pad each stage, then keep
    this rank's ``input_tokens / tp_size`` rows of each stage.

    Args:
        hidden_states: ``[layout.local_rows(parent_input_tokens), H]``.
        residual: None or ``[same rows, H_r]`` with the hidden states' dtype and device.
        gather: the TP row gather; required only for a sharded (SP, ``tp_size > 1``) layout.

    Returns:
        Per-stage tensors; a stage without padding rows is a view of the input (stage windows
        are disjoint, so in-place updates of one stage never touch another).

    Raises:
        AFDCamError: a shape, dtype or device mismatch, or a missing gather (before any collective).
    """
    local_parent = layout.local_rows(layout.parent_input_tokens)
    _check_2d("hidden_states", hidden_states, local_parent)
    if residual is not None:
        _check_2d("residual", residual, local_parent)
        _check_same_kind("residual", residual, hidden_states)
    if layout.is_sharded and gather is None:
        raise AFDCamError("gather", None, "a sequence-parallel layout needs a TP row gather")

    if layout.is_sharded:
        assert gather is not None
        width = hidden_states.shape[1]
        combined = hidden_states if residual is None else torch.cat((hidden_states, residual), 1)
        windows = _stage_windows(
            _checked_gather(gather, combined, layout.parent_input_tokens), layout
        )
        hidden_out = tuple(w[:, :width] for w in windows)
        residual_out = tuple(w[:, width:] for w in windows) if residual is not None else None
    else:
        hidden_out = _stage_windows(hidden_states, layout)
        residual_out = _stage_windows(residual, layout) if residual is not None else None
    return CAMStageInputs(hidden_states=hidden_out, residuals=residual_out)


def restore_stage_outputs(
    hidden_states: Sequence[torch.Tensor],
    residuals: Sequence[torch.Tensor | None] | None,
    layout: CAMStageLayout,
    gather: RowGather | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reassemble per-stage outputs into this rank's parent layout.

    Each stage output is trimmed to its real rows, the stages are concatenated in order and the
    result is zero-padded to ``parent_input_tokens``. Under SP all stages are gathered first (one
    collective) and the padded parent is re-sharded to this rank.

    Args:
        hidden_states: one ``[layout.local_rows(stage.input_tokens), H]`` tensor per stage.
        residuals: None, or one residual per stage (all None or all tensors).
        gather: the TP row gather; required only for a sharded layout.

    Returns:
        ``(hidden_states, residual)`` with ``layout.local_rows(parent_input_tokens)`` rows each;
        ``residual`` is None when no residuals were given.

    Raises:
        AFDCamError: wrong stage count, a stage output row mismatch ("stage output token count
            mismatch"), mixed None/tensor residuals, dtype/device mismatch, or a missing gather.
    """
    hidden = tuple(hidden_states)
    if len(hidden) != layout.num_stages:
        raise AFDCamError(
            "hidden_states", len(hidden), f"expected one output per stage ({layout.num_stages})"
        )
    res = _normalise_residuals(residuals, layout.num_stages)
    width = None
    for idx, (stage, out) in enumerate(zip(layout.stages, hidden, strict=True)):
        rows = layout.local_rows(stage.input_tokens)
        _check_stage_rows(f"hidden_states[{idx}]", out, rows)
        if width is None:
            width = out.shape[1]
        elif out.shape[1] != width:
            raise AFDCamError(f"hidden_states[{idx}]", tuple(out.shape), f"expected width {width}")
        _check_same_kind(f"hidden_states[{idx}]", out, hidden[0])
        if res is not None:
            _check_stage_rows(f"residuals[{idx}]", res[idx], rows)
            _check_same_kind(f"residuals[{idx}]", res[idx], hidden[0])
            if res[idx].shape[1] != res[0].shape[1]:
                raise AFDCamError(
                    f"residuals[{idx}]", tuple(res[idx].shape), "residual widths differ by stage"
                )
    if layout.is_sharded and gather is None:
        raise AFDCamError("gather", None, "a sequence-parallel layout needs a TP row gather")
    assert width is not None

    if not layout.is_sharded:
        return (
            _assemble_parent(hidden, layout),
            _assemble_parent(res, layout) if res is not None else None,
        )
    assert gather is not None
    combined = [out if res is None else torch.cat((out, res[i]), 1) for i, out in enumerate(hidden)]
    parent = _assemble_parent(_gather_stages(gather, combined, layout), layout)
    return parent[:, :width], (parent[:, width:] if res is not None else None)


def _stage_windows(full: torch.Tensor, layout: CAMStageLayout) -> tuple[torch.Tensor, ...]:
    """This rank's rows of every zero-padded stage of the full parent tensor ``full``."""
    out = []
    for stage in layout.stages:
        local = layout.local_slice(stage.input_tokens)
        out.append(_window(full, stage.start, stage.actual_tokens, local.start, local.stop))
    return tuple(out)


def _assemble_parent(stages: Sequence[torch.Tensor], layout: CAMStageLayout) -> torch.Tensor:
    """This rank's rows of the parent rebuilt from full stage tensors (trim, concat, zero-pad)."""
    real = torch.cat([t[: s.actual_tokens] for t, s in zip(stages, layout.stages, strict=True)])
    local = layout.local_slice(layout.parent_input_tokens)
    return _window(real, 0, real.shape[0], local.start, local.stop)


def _window(src: torch.Tensor, start: int, actual: int, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``src[start : start + actual]`` followed by zero rows.

    A view of ``src`` when the window holds no padding row; otherwise one copy of the window only.
    """
    part = src[start + min(lo, actual) : start + min(hi, actual)]
    missing = (hi - lo) - part.shape[0]
    if missing == 0:
        return part
    return torch.cat((part, part.new_zeros((missing, *part.shape[1:]))), dim=0)


def _gather_stages(
    gather: RowGather, local: list[torch.Tensor], layout: CAMStageLayout
) -> list[torch.Tensor]:
    """All-gather every stage's local rows with one collective; return full stage tensors."""
    local_rows = [t.shape[0] for t in local]
    total_local = sum(local_rows)
    gathered = _checked_gather(gather, torch.cat(local, dim=0), total_local * layout.tp_size)
    by_rank = gathered.reshape(layout.tp_size, total_local, gathered.shape[1])
    out = []
    offset = 0
    for rows in local_rows:
        out.append(by_rank[:, offset : offset + rows].reshape(layout.tp_size * rows, -1))
        offset += rows
    return out


def _checked_gather(gather: RowGather, local: torch.Tensor, expected_rows: int) -> torch.Tensor:
    gathered = gather(local)
    if tuple(gathered.shape) != (expected_rows, *local.shape[1:]):
        raise AFDCamError(
            "gathered",
            tuple(gathered.shape),
            f"TP gather must return {(expected_rows, *local.shape[1:])}",
        )
    return gathered


def _normalise_residuals(
    residuals: Sequence[torch.Tensor | None] | None, num_stages: int
) -> tuple[torch.Tensor, ...] | None:
    if residuals is None:
        return None
    res = tuple(residuals)
    if len(res) != num_stages:
        raise AFDCamError("residuals", len(res), f"expected one residual per stage ({num_stages})")
    present = [r is not None for r in res]
    if not any(present):
        return None
    if not all(present):
        raise AFDCamError(
            "residuals",
            tuple(present),
            "Async CAM stages returned inconsistent residual layouts (mixed None and tensors)",
        )
    return tuple(r for r in res if r is not None)


def _pad_rows(rows: torch.Tensor, total: int) -> torch.Tensor:
    missing = total - rows.shape[0]
    if missing == 0:
        return rows
    return torch.cat((rows, rows.new_zeros((missing, *rows.shape[1:]))), dim=0)


def _check_2d(field: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != rows:
        raise AFDCamError(field, tuple(tensor.shape), f"expected a 2-D tensor with {rows} rows")


def _check_stage_rows(field: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.dim() != 2:
        raise AFDCamError(field, tuple(tensor.shape), "expected a 2-D [tokens, hidden] tensor")
    if tensor.shape[0] != rows:
        raise AFDCamError(
            field,
            tuple(tensor.shape),
            f"stage output token count mismatch: expected {rows}, got {tensor.shape[0]}",
        )


def _check_same_kind(field: str, tensor: torch.Tensor, ref: torch.Tensor) -> None:
    if tensor.dtype != ref.dtype or tensor.device != ref.device:
        raise AFDCamError(
            field,
            (tensor.dtype, str(tensor.device)),
            f"must match hidden_states dtype/device {(ref.dtype, str(ref.device))}",
        )
