"""Routed TP padding: hand each replicated token to the remote FFN exactly once.

Under plain tensor parallelism every TP rank holds the same ``N`` tokens. If every rank dispatched
all of them, each token would reach the FFN ``T`` times. Instead rank ``r`` dispatches its slice
``[r * c, (r + 1) * c)`` of the tokens, ``c = ceil(N / T)``, clipped to ``N``: the last ranks send
fewer rows (possibly none), and no padding row travels. Before the all-gather (which needs equal
shapes) each rank zero-pads its FFN output to ``c`` rows; the gathered ``T * c`` rows, in rank
order, are trimmed back to ``N``.

With sequence parallelism (each rank already holds its own shard) or ``T == 1`` the layout passes
through: the rank dispatches its tensor unchanged and restores nothing.

Invariants (for every ``N >= 0`` and ``T >= 1``):

* the local slices of ranks ``0..T-1`` are disjoint, contiguous, in rank order and cover exactly
  ``[0, N)``, so every real token is dispatched by exactly one rank and nothing else is;
* ``restore(FFN(prepare(x)))`` on every rank equals ``FFN(x)`` for a row-wise FFN;
* every check runs before any collective, so a wrong shape never leaves peers waiting.

The collective is a :data:`RowGather` callable, so the pure functions run without
``torch.distributed``; :class:`RoutedTPPadding` binds one to a process group (gloo in tests,
vLLM's ``get_tp_group().device_group`` at runtime).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from afd_core.collectives import RowGather, rows_per_tp_rank, torch_row_gather, tp_slice_rows

from afd_remote.errors import AFDRemoteError

"""All-gathers equal-shaped tensors along dim 0 across the TP group, in rank order."""


@dataclass(frozen=True)
class RoutedDispatchLayout:
    """Where this TP rank's dispatched rows sit in the parent (replicated) batch.

    Invariants: ``0 <= tp_rank < tp_size``; ``parent_tokens >= 0``; when
    :attr:`requires_tp_all_gather` is false the layout is the identity
    (``local_start == 0``, ``local_stop == padded_tokens == parent_tokens``).
    """

    parent_tokens: int
    tp_rank: int
    tp_size: int
    use_sequence_parallel: bool = False

    def __post_init__(self) -> None:
        _check_int("parent_tokens", self.parent_tokens, minimum=0)
        _check_int("tp_size", self.tp_size, minimum=1)
        _check_int("tp_rank", self.tp_rank, minimum=0)
        if self.tp_rank >= self.tp_size:
            raise AFDRemoteError(
                "tp_rank", self.tp_rank, f"in [0, tp_size) with tp_size={self.tp_size}"
            )
        if not isinstance(self.use_sequence_parallel, bool):
            raise AFDRemoteError("use_sequence_parallel", self.use_sequence_parallel, "a bool")

    @property
    def requires_tp_all_gather(self) -> bool:
        """True when rows are split across TP ranks (plain TP with ``tp_size > 1``)."""
        return self.tp_size > 1 and not self.use_sequence_parallel

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank dispatches: ``ceil(parent_tokens / tp_size)`` when split."""
        if not self.requires_tp_all_gather:
            return self.parent_tokens
        return rows_per_tp_rank(self.parent_tokens, self.tp_size)

    @property
    def padded_tokens(self) -> int:
        """Parent rows after zero padding: a multiple of ``tp_size`` when split."""
        if not self.requires_tp_all_gather:
            return self.parent_tokens
        return self.rows_per_rank * self.tp_size

    @property
    def local_start(self) -> int:
        """First padded-parent row this rank dispatches."""
        return self.tp_rank * self.rows_per_rank if self.requires_tp_all_gather else 0

    @property
    def local_stop(self) -> int:
        """One past the last padded-parent row this rank dispatches."""
        return self.local_start + self.rows_per_rank

    @property
    def local_tokens(self) -> int:
        """Real rows this rank dispatches (and must receive back): its slice clipped to the
        parent tokens (:func:`afd_core.collectives.tp_slice_rows`)."""
        if not self.requires_tp_all_gather:
            return self.parent_tokens
        return tp_slice_rows(self.parent_tokens, self.tp_size, self.tp_rank)


def plan_routed_dispatch(
    num_tokens: int, *, tp_rank: int, tp_size: int, use_sequence_parallel: bool = False
) -> RoutedDispatchLayout:
    """Return the dispatch layout of ``num_tokens`` parent rows for one TP rank."""
    return RoutedDispatchLayout(
        parent_tokens=num_tokens,
        tp_rank=tp_rank,
        tp_size=tp_size,
        use_sequence_parallel=use_sequence_parallel,
    )


def slice_for_dispatch(
    tensor: torch.Tensor, layout: RoutedDispatchLayout, *, field: str = "hidden_states"
) -> torch.Tensor:
    """This rank's rows of ``tensor`` (``layout.local_tokens`` of them, a view; no padding).

    Applies to every row-aligned payload tensor (hidden states, router logits, top-k ids and
    weights, input ids) so they stay aligned. Passthrough layouts return ``tensor`` itself.

    Raises:
        AFDRemoteError: ``tensor`` has no token dim or a row count other than
            ``layout.parent_tokens`` (``field`` names the payload field).
    """
    _check_rows(field, tensor, layout.parent_tokens)
    if not layout.requires_tp_all_gather:
        return tensor
    parent = layout.parent_tokens
    return tensor[min(layout.local_start, parent) : min(layout.local_stop, parent)]


def restore_dispatched_output(
    local_output: torch.Tensor, layout: RoutedDispatchLayout, gather: RowGather | None
) -> torch.Tensor:
    """Turn this rank's FFN output back into the parent layout.

    Split layouts zero-pad the output to ``rows_per_rank`` rows (equal shapes for the
    collective), all-gather the ranks' outputs in rank order and trim to the parent's rows;
    passthrough layouts return ``local_output`` itself (``gather`` may then be None).

    Raises:
        AFDRemoteError: ``local_output`` does not have ``layout.local_tokens`` rows (checked before
            the collective), the gather returned a wrong row count, or ``gather`` is None for a
            split layout.
    """
    _check_rows("local_output", local_output, layout.local_tokens)
    if not layout.requires_tp_all_gather:
        return local_output
    if gather is None:
        raise AFDRemoteError(
            "gather", None, f"a split layout with tp_size={layout.tp_size} needs a TP row gather"
        )
    missing = layout.rows_per_rank - layout.local_tokens
    if missing:
        pad = local_output.new_zeros((missing, *local_output.shape[1:]))
        local_output = torch.cat((local_output, pad), dim=0)
    gathered = gather(local_output)
    _check_rows("gathered_output", gathered, layout.padded_tokens)
    return gathered[: layout.parent_tokens]


class RoutedTPPadding:
    """Routed TP padding bound to one TP process group.

    Args:
        group: the TP group, or None for "no tensor parallelism" (``tp_size == 1``, passthrough).
            Note: unlike ``torch.distributed``, None does NOT mean the world group. At runtime
            pass vLLM's ``get_tp_group().device_group`` (this package never imports vLLM).
        use_sequence_parallel: True when each rank already holds its own token shard; the layout
            then passes through whatever the TP size.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, *, use_sequence_parallel: bool = False
    ) -> None:
        if not isinstance(use_sequence_parallel, bool):
            raise AFDRemoteError("use_sequence_parallel", use_sequence_parallel, "a bool")
        self.group = group
        self.use_sequence_parallel = use_sequence_parallel
        if group is None:
            self.tp_rank, self.tp_size = 0, 1
        else:
            self.tp_rank = dist.get_rank(group)
            self.tp_size = dist.get_world_size(group)
        self._gather: RowGather | None = (
            torch_row_gather(group) if group is not None and self.tp_size > 1 else None
        )

    @property
    def is_passthrough(self) -> bool:
        """True when this rank dispatches its tokens unchanged."""
        return self.tp_size == 1 or self.use_sequence_parallel

    def plan(self, num_tokens: int) -> RoutedDispatchLayout:
        """Layout of ``num_tokens`` parent rows on this rank."""
        return plan_routed_dispatch(
            num_tokens,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            use_sequence_parallel=self.use_sequence_parallel,
        )

    def slice(
        self, tensor: torch.Tensor, layout: RoutedDispatchLayout, *, field: str = "hidden_states"
    ) -> torch.Tensor:
        """This rank's rows of ``tensor`` (see :func:`slice_for_dispatch`)."""
        return slice_for_dispatch(tensor, layout, field=field)

    def restore(self, local_output: torch.Tensor, layout: RoutedDispatchLayout) -> torch.Tensor:
        """Parent-layout output (see :func:`restore_dispatched_output`)."""
        return restore_dispatched_output(local_output, layout, self._gather)


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AFDRemoteError(field, value, f"an int >= {minimum}")


def _check_rows(field: str, tensor: torch.Tensor, expected: int) -> None:
    if tensor.dim() == 0:
        raise AFDRemoteError(field, tuple(tensor.shape), "must have a token (first) dimension")
    if tensor.shape[0] != expected:
        raise AFDRemoteError(
            field, tuple(tensor.shape), f"expected {expected} rows in the first dimension"
        )
