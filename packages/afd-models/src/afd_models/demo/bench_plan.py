"""``afd bench`` against ``afd plan``: the cost model's TPOT next to the measured one.

Each TPOT row of an ``afd bench`` result (see :mod:`afd_models.demo.bench`) names a deployment;
:func:`candidate_for` turns it into afd-plan's :class:`~afd_plan.plan.Candidate` on the tiny or
wide checkpoint, :func:`compare_with_plan` predicts it on a hardware profile (this host's
calibrated one, ``afd bench --profile``) and reports predicted against measured, the error, and
whether the model ranks the setups in the measured order.

Mapping (``b`` = the row's batch: requests in flight on the whole server):

==============================  =====================================================
setup                           candidate
==============================  =====================================================
``plain`` / ``plain wide``      colocated on one device (one thread), batch ``b``
``afd A:F`` (``gate-attn``)     ``A`` Attention ranks, ``F`` FFN ranks, ``b / A`` per rank
``... stages=2``                the same with ``S = 2``
``... wide``                    on the wide checkpoint
==============================  =====================================================

Not compared: ``plain (vLLM default threads)`` (every core on one device: not a device of the
profile) and the quantized rows (the CPU reference computes dequantize to fp32: their cost is
not the quantized GEMM the model prices). The gate's placement is not a term of the model: a
``gate-attn`` row is predicted like its ``gate on FFN`` twin.

Engine anchors: the engine's own software per step (``step_overhead``, ``sequence_overhead``) and
per message (``message_overhead``) are taken from the compared run itself when it measured
them: plain on the tiny checkpoint at two batch sizes and ``afd 1:1`` at batch 1 (the rows
``afd bench --profile`` calibrates them on; :func:`afd_models.demo.calibrate.engine_overheads`);
on a profile whose ``host_cores`` are fewer than three, the run's ``afd 1:2 gate-attn`` at batch
1 also gives the host's ``oversubscription_cost`` (three engines on the cores). Those rows are
then *anchors* (fitted, marked, not counted in the error target) and every other row is a
prediction from them and the profile's rates. Why: the same plain run measured
3.06 ms in one ``afd bench`` and 4.37 ms in the calibration run an hour before it on the shared
VM, which alone put every prediction 40 % off.

Order: two rows at the same batch count as ordered otherwise than measured when the model
reverses an order the measurement establishes: with several engine starts for both
(``afd bench --starts``) their per-start medians do not overlap, otherwise they are more than
5 % apart.

Workload: every request's prompt is one of the demo prompts (about :data:`PROMPT_TOKENS`
tokens) and it decodes ``max_tokens`` tokens; decode is priced at the mean context.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from afd_plan.hardware import HardwareProfile
from afd_plan.plan import Candidate, predict
from afd_plan.shape import load_model_shape
from afd_plan.workload import Workload

__all__ = [
    "PROMPT_TOKENS",
    "PlanComparison",
    "PlannedRow",
    "candidate_for",
    "compare_with_plan",
    "render_plan_comparison",
]

#: Tokens of a demo prompt (they are 4 to 7 words).
PROMPT_TOKENS: Final[int] = 6
#: The calibration target of issue "afd plan": every compared row within this relative error.
TARGET_ERROR: Final[float] = 0.25

_SETUP = re.compile(
    r"^(?:(?P<plain>plain)|afd (?P<a>\d+):(?P<f>\d+)(?: gate-attn)?)"
    r"(?P<wide> wide)?(?: stages=(?P<s>\d+))?$"
)


def candidate_for(setup: str, batch: int) -> tuple[str, Candidate] | None:
    """``(width, candidate)`` for one bench row, or ``None`` for a row the model does not price
    (see the module docstring). ``width`` is ``"tiny"`` or ``"wide"``."""
    m = _SETUP.match(setup)
    if m is None:
        return None
    width = "wide" if m["wide"] else "tiny"
    stages = int(m["s"] or 1)
    if m["plain"]:
        return width, Candidate(1, 0, stages, batch)
    a, f = int(m["a"]), int(m["f"])
    return width, Candidate(a, f, stages, max(1, math.ceil(batch / a)))


@dataclass(frozen=True)
class PlannedRow:
    """One bench row with the model's prediction (milliseconds)."""

    setup: str
    batch: int
    measured_ms: float
    predicted_ms: float
    binding: str
    #: The engine overheads were fitted on this row (see the module docstring).
    anchor: bool = False
    #: With several engine starts (``afd bench --starts``): each start's median TPOT.
    start_ms: tuple[float, ...] = ()

    def tied_with(self, other: PlannedRow) -> bool:
        """Whether the measurement cannot order the two rows: with several engine starts for
        both, their per-start ranges overlap; otherwise they are within 5 % of each other."""
        if len(self.start_ms) > 1 and len(other.start_ms) > 1:
            return min(self.start_ms) <= max(other.start_ms) and (
                min(other.start_ms) <= max(self.start_ms)
            )
        gap = abs(self.measured_ms - other.measured_ms)
        return gap <= 0.05 * min(self.measured_ms, other.measured_ms)

    @property
    def error(self) -> float:
        """``predicted / measured - 1``."""
        return self.predicted_ms / self.measured_ms - 1.0

    @property
    def within_target(self) -> bool:
        return abs(self.error) <= TARGET_ERROR


@dataclass(frozen=True)
class PlanComparison:
    """Every priced row, and the pairs of rows the model orders otherwise than measured."""

    profile: str
    rows: tuple[PlannedRow, ...]
    misordered: tuple[tuple[str, str], ...]
    #: The engine overheads fitted on this run's anchor rows (s), or ``None`` (the profile's).
    anchored: Mapping[str, float] | None = None

    @property
    def predicted(self) -> tuple[PlannedRow, ...]:
        """The rows that are predictions (not anchors)."""
        return tuple(r for r in self.rows if not r.anchor)

    @property
    def within_target(self) -> int:
        """Predicted rows within the target error."""
        return sum(r.within_target for r in self.predicted)

    def to_json(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "target_error": TARGET_ERROR,
            "anchored": None if self.anchored is None else dict(self.anchored),
            "rows": [{**asdict(r), "error": r.error} for r in self.rows],
            "predicted_rows": len(self.predicted),
            "within_target": self.within_target,
            "misordered": [list(p) for p in self.misordered],
        }


def compare_with_plan(
    tpot_rows: Sequence[Mapping[str, Any]],
    checkpoints: Mapping[str, str | Path],
    hw: HardwareProfile,
    *,
    max_tokens: int,
    prompt_tokens: int = PROMPT_TOKENS,
    anchor: bool = True,
) -> PlanComparison:
    """Predict every priced row of ``tpot_rows`` (an ``afd bench`` result's ``"tpot"`` list) on
    ``hw``; ``checkpoints`` maps ``"tiny"`` / ``"wide"`` to the checkpoints the bench ran. With
    ``anchor`` and the anchor rows measured, the engine overheads come from them (module
    docstring).

    Raises ``KeyError`` naming a width a row needs and ``checkpoints`` lacks."""
    work = Workload(input_len=prompt_tokens, output_len=max_tokens)
    anchors = _anchor_rows(tpot_rows, hw) if anchor and "tiny" in checkpoints else None
    anchored: dict[str, float] | None = None
    if anchors is not None:
        from afd_models.demo.calibrate import EngineCalibration, engine_overheads

        plain, afd, shared = anchors
        anchored = engine_overheads(
            {**hw.to_mapping(), "step_overhead": 0.0, "sequence_overhead": 0.0},
            EngineCalibration(
                model=str(checkpoints["tiny"]),
                max_tokens=max_tokens,
                plain_tpot_s={b: ms / 1e3 for b, ms in plain.items()},
                afd_tpot_s=afd / 1e3,
                shared_tpot_s=None if shared is None else shared / 1e3,
            ),
        )
        hw = hw.with_overrides(**anchored)
    shapes: dict[str, Any] = {}
    rows: list[PlannedRow] = []
    for raw in tpot_rows:
        setup, batch = str(raw["setup"]), int(raw["batch"])
        found = candidate_for(setup, batch)
        if found is None:
            continue
        width, cand = found
        if width not in shapes:
            if width not in checkpoints:
                raise KeyError(f"checkpoints[{width!r}]: the row {setup!r} runs on it")
            shapes[width] = load_model_shape(checkpoints[width])
        pred = predict(shapes[width], work, hw, cand)
        is_anchor = anchors is not None and (
            (setup == "plain" and batch in anchors[0])
            or (setup, batch) == _PAIR_ANCHOR
            or ((setup, batch) == _SHARED_ANCHOR and anchors[2] is not None)
        )
        starts = tuple(float(x) for x in raw.get("start_tpot_ms", ()))
        rows.append(
            PlannedRow(
                setup,
                batch,
                float(raw["tpot_ms"]),
                pred.tpot_s * 1e3,
                pred.binding,
                is_anchor,
                starts,
            )
        )
    return PlanComparison(hw.name, tuple(rows), _misordered(rows), anchored)


#: The anchor row of the exchange's per-message cost, and of a shared host's oversubscription.
_PAIR_ANCHOR: Final[tuple[str, int]] = ("afd 1:1", 1)
_SHARED_ANCHOR: Final[tuple[str, int]] = ("afd 1:2 gate-attn", 1)


def _anchor_rows(
    tpot_rows: Sequence[Mapping[str, Any]], hw: HardwareProfile
) -> tuple[dict[int, float], float, float | None] | None:
    """The run's engine anchors: plain (tiny) at its smallest and largest batch, ``afd 1:1`` at
    batch 1, and ``afd 1:2 gate-attn`` at batch 1 when ``hw`` shares fewer than three cores
    (else ``None`` in its place) (milliseconds); ``None`` unless the first three were
    measured."""
    by_row = {(str(r["setup"]), int(r["batch"])): float(r["tpot_ms"]) for r in tpot_rows}
    plain = {b: ms for (setup, b), ms in by_row.items() if setup == "plain"}
    if len(plain) < 2 or _PAIR_ANCHOR not in by_row:
        return None
    from afd_models.demo.calibrate import SHARED_HOST_ENGINES

    lo, hi = min(plain), max(plain)
    shared = by_row.get(_SHARED_ANCHOR) if 0 < hw.host_cores < SHARED_HOST_ENGINES else None
    return {lo: plain[lo], hi: plain[hi]}, by_row[_PAIR_ANCHOR], shared


def _misordered(rows: Sequence[PlannedRow]) -> tuple[tuple[str, str], ...]:
    """Pairs of rows at the same batch whose measured order the prediction reverses (rows the
    measurement cannot order, :meth:`PlannedRow.tied_with`, are not compared)."""
    out: list[tuple[str, str]] = []
    for i, x in enumerate(rows):
        for y in rows[i + 1 :]:
            if x.batch != y.batch or x.tied_with(y):
                continue
            if (x.measured_ms < y.measured_ms) != (x.predicted_ms < y.predicted_ms):
                out.append((f"{x.setup} b={x.batch}", f"{y.setup} b={y.batch}"))
    return tuple(out)


def render_plan_comparison(cmp: PlanComparison) -> str:
    """A text table: setup, batch, measured and predicted TPOT, error, binding resource."""
    lines = [
        f"afd plan on profile {cmp.profile!r} against the measured TPOT "
        f"(target: within {TARGET_ERROR:.0%})",
        f"{'setup':<26} {'batch':>5} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  binds",
    ]
    for r in cmp.rows:
        mark = "  (anchor)" if r.anchor else "" if r.within_target else "  *"
        lines.append(
            f"{r.setup:<26} {r.batch:>5} {r.measured_ms:>12.2f} {r.predicted_ms:>13.2f} "
            f"{r.error:>+8.0%}  {r.binding}{mark}"
        )
    if cmp.anchored is not None:
        lines.append(
            "engine overheads fitted on this run's anchor rows: "
            + ", ".join(
                f"{k} {v:.2f}" if k == "oversubscription_cost" else f"{k} {v * 1e6:.0f} us"
                for k, v in cmp.anchored.items()
            )
        )
    lines.append(
        f"{cmp.within_target}/{len(cmp.predicted)} predicted rows within {TARGET_ERROR:.0%}; "
        f"{len(cmp.misordered)} pair(s) ordered otherwise than measured"
        + "".join(f"\n  {a} vs {b}" for a, b in cmp.misordered)
    )
    return "\n".join(lines)
