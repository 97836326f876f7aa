"""How a parent batch is split into CAM pipeline stages on one TP rank.

A *parent batch* has ``parent_input_tokens`` rows (real tokens first, then padding such as a graph
bucket). Its real tokens are cut into contiguous, ordered, non-empty *stages*; stage ``i`` covers
parent rows ``[start, start + actual_tokens)`` and runs with ``input_tokens >= actual_tokens`` rows
(the rest zero padding).

Two TP layouts exist for hidden states and residuals:

* **TP (replicated)**: every TP rank holds all ``parent_input_tokens`` rows and each stage's
  ``input_tokens`` rows.
* **SP (sequence parallel)**: rank ``r`` holds rows ``[r * n / T, (r + 1) * n / T)`` of every
  length-``n`` tensor, so ``parent_input_tokens`` and every stage's ``input_tokens`` must be
  multiples of ``tp_size``.

Positions (and other per-token metadata) are always replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from afd_cam.errors import AFDCamError


@dataclass(frozen=True)
class CAMStage:
    """One pipeline stage of a parent batch.

    Invariants: ``start >= 0``; ``0 < actual_tokens <= input_tokens``.
    """

    start: int
    actual_tokens: int
    input_tokens: int

    def __post_init__(self) -> None:
        _check_int("start", self.start, minimum=0)
        _check_int("actual_tokens", self.actual_tokens, minimum=1)
        _check_int("input_tokens", self.input_tokens, minimum=self.actual_tokens)

    @property
    def stop(self) -> int:
        """One past the stage's last real parent row."""
        return self.start + self.actual_tokens

    @property
    def pad_tokens(self) -> int:
        """Zero rows appended to the stage's real rows."""
        return self.input_tokens - self.actual_tokens


@dataclass(frozen=True)
class CAMStageLayout:
    """The stages of one parent batch as seen by one TP rank.

    Invariants (checked at construction):

    * at least one stage; stage 0 starts at row 0 and each stage starts where the previous stopped;
    * the real tokens (``stages[-1].stop``) fit in ``parent_input_tokens``;
    * ``0 <= tp_rank < tp_size``;
    * with sequence parallelism, ``parent_input_tokens`` and every ``input_tokens`` are multiples
      of ``tp_size``.
    """

    stages: tuple[CAMStage, ...]
    parent_input_tokens: int
    tp_size: int = 1
    tp_rank: int = 0
    use_sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stages, tuple) or not self.stages:
            raise AFDCamError("stages", self.stages, "a non-empty tuple of CAMStage")
        expected_start = 0
        for idx, stage in enumerate(self.stages):
            if not isinstance(stage, CAMStage):
                raise AFDCamError(f"stages[{idx}]", stage, "a CAMStage")
            if stage.start != expected_start:
                raise AFDCamError(
                    f"stages[{idx}].start",
                    stage.start,
                    f"stages must be contiguous and ordered; expected start={expected_start}",
                )
            expected_start = stage.stop
        _check_int("parent_input_tokens", self.parent_input_tokens, minimum=expected_start)
        _check_int("tp_size", self.tp_size, minimum=1)
        _check_int("tp_rank", self.tp_rank, minimum=0)
        if self.tp_rank >= self.tp_size:
            raise AFDCamError(
                "tp_rank", self.tp_rank, f"in [0, tp_size) with tp_size={self.tp_size}"
            )
        if not isinstance(self.use_sequence_parallel, bool):
            raise AFDCamError("use_sequence_parallel", self.use_sequence_parallel, "a bool")
        if self.is_sharded:
            if self.parent_input_tokens % self.tp_size:
                raise AFDCamError(
                    "parent_input_tokens",
                    self.parent_input_tokens,
                    f"a multiple of tp_size={self.tp_size} with sequence parallelism",
                )
            for idx, stage in enumerate(self.stages):
                if stage.input_tokens % self.tp_size:
                    raise AFDCamError(
                        f"stages[{idx}].input_tokens",
                        stage.input_tokens,
                        f"a multiple of tp_size={self.tp_size} with sequence parallelism",
                    )

    @classmethod
    def from_token_counts(
        cls,
        actual_tokens: Sequence[int],
        *,
        parent_input_tokens: int | None = None,
        input_tokens: Sequence[int] | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        use_sequence_parallel: bool = False,
    ) -> CAMStageLayout:
        """Build contiguous stages from per-stage real token counts.

        ``input_tokens`` defaults to each count rounded up to a multiple of ``tp_size`` under
        sequence parallelism (unchanged otherwise); ``parent_input_tokens`` defaults to the real
        token total, rounded up the same way.
        """
        multiple = tp_size if (use_sequence_parallel and tp_size > 1) else 1
        counts = tuple(actual_tokens)
        if input_tokens is None:
            padded = tuple(_round_up(c, multiple) if isinstance(c, int) else c for c in counts)
        else:
            padded = tuple(input_tokens)
            if len(padded) != len(counts):
                raise AFDCamError(
                    "input_tokens", padded, f"needs one entry per stage ({len(counts)})"
                )
        stages = []
        start = 0
        for actual, inp in zip(counts, padded, strict=True):
            stage = CAMStage(start=start, actual_tokens=actual, input_tokens=inp)
            stages.append(stage)
            start = stage.stop
        parent = _round_up(start, multiple) if parent_input_tokens is None else parent_input_tokens
        return cls(
            stages=tuple(stages),
            parent_input_tokens=parent,
            tp_size=tp_size,
            tp_rank=tp_rank,
            use_sequence_parallel=use_sequence_parallel,
        )

    @classmethod
    def split_evenly(
        cls,
        num_tokens: int,
        num_stages: int = 2,
        *,
        parent_input_tokens: int | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        use_sequence_parallel: bool = False,
    ) -> CAMStageLayout:
        """Token-balanced split of ``num_tokens`` real tokens into ``num_stages`` stages.

        Earlier stages take the remainder (e.g. 5 tokens, 2 stages -> 3 + 2).
        """
        _check_int("num_stages", num_stages, minimum=1)
        _check_int("num_tokens", num_tokens, minimum=num_stages)
        base, extra = divmod(num_tokens, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
        return cls.from_token_counts(
            counts,
            parent_input_tokens=parent_input_tokens,
            tp_size=tp_size,
            tp_rank=tp_rank,
            use_sequence_parallel=use_sequence_parallel,
        )

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def real_tokens(self) -> int:
        """Real (unpadded) parent tokens covered by the stages."""
        return self.stages[-1].stop

    @property
    def is_sharded(self) -> bool:
        """True when hidden states and residuals are row-sharded across ``tp_size > 1`` ranks."""
        return self.use_sequence_parallel and self.tp_size > 1

    def local_rows(self, total_rows: int) -> int:
        """Rows this rank holds of a ``total_rows`` tensor in the hidden-state layout."""
        return total_rows // self.tp_size if self.is_sharded else total_rows

    def local_slice(self, total_rows: int) -> slice:
        """This rank's rows of a ``total_rows`` tensor in the hidden-state layout."""
        rows = self.local_rows(total_rows)
        start = self.tp_rank * rows if self.is_sharded else 0
        return slice(start, start + rows)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _check_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AFDCamError(field, value, f"an int >= {minimum}")
