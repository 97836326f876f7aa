"""Exception types raised by afd_cam.

Every error names the offending field and value and says what is allowed; layout and shape errors
are raised before any collective, so a bad input never leaves TP peers waiting. All derive from
afd-core's :class:`~afd_core.errors.AFDError`.
"""

from __future__ import annotations

from afd_core.errors import AFDError, AFDFieldError


class AFDCamError(AFDFieldError, ValueError):
    """A layout or tensor value afd_cam cannot use (``field`` / ``value`` / ``allowed`` as in
    afd-core's :class:`~afd_core.errors.AFDFieldError`, e.g. ``field="tp_size"``)."""

    subject = "afd_cam value"


class AFDCamHandoffError(AFDError, RuntimeError):
    """The receive handoff was used out of order: a receive without a pending dispatch, or a second
    dispatch while the stage's previous receive is still pending.

    Attributes:
        stage_idx: the stage whose handoff state was wrong.
    """

    def __init__(self, stage_idx: int, message: str) -> None:
        super().__init__(f"Async CAM stage {stage_idx} {message}")
        self.stage_idx = stage_idx
