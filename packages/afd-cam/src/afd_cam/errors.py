"""Exception types raised by afd_cam.

Every error names the offending field and value and says what is allowed; layout and shape errors
are raised before any collective, so a bad input never leaves TP peers waiting. All derive from
afd-core's :class:`~afd_core.errors.AFDError`.
"""

from __future__ import annotations

from typing import Any

from afd_core.errors import AFDError


class AFDCamError(AFDError, ValueError):
    """A layout, tensor or stage value afd_cam cannot use.

    Attributes:
        field: the argument, layout field or stage item at fault (e.g. ``stages[1].start``).
        value: the rejected value (a shape or a scalar, never a whole tensor).
        allowed: what is accepted.
    """

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid afd_cam value {field!r}: got {value!r}; allowed: {allowed}")


class AFDCamHandoffError(AFDError, RuntimeError):
    """The receive handoff was used out of order: a receive without a pending dispatch, or a second
    dispatch while the stage's previous receive is still pending.

    Attributes:
        stage_idx: the stage whose handoff state was wrong.
    """

    def __init__(self, stage_idx: int, message: str) -> None:
        super().__init__(f"Async CAM stage {stage_idx} {message}")
        self.stage_idx = stage_idx
