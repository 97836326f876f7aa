"""CAM model-side TP/SP layout, padding, output restoration and the DBO receive handoff.

Submodules (importing this package imports none of vLLM):

* :mod:`afd_cam.layout` -- :class:`CAMStage`, :class:`CAMStageLayout` (stage split of a parent
  batch on one TP rank, TP or SP layout).
* :mod:`afd_cam.stages` -- :func:`prepare_stage_inputs`, :func:`restore_stage_outputs`,
  :func:`split_replicated` (layout conversion, padding, restoration).
* :mod:`afd_cam.handoff` -- :class:`ReceiveHandoff` (when each dispatched stage is received).

The TP row all-gather they take is :mod:`afd_core.collectives` (shared with afd-remote).
"""

from importlib.metadata import version as _version

from afd_cam.errors import AFDCamError, AFDCamHandoffError
from afd_cam.handoff import ReceiveHandoff
from afd_cam.layout import CAMStage, CAMStageLayout
from afd_cam.stages import (
    CAMStageInputs,
    prepare_stage_inputs,
    restore_stage_outputs,
    split_replicated,
)

__version__ = _version("afd-cam")

__all__ = [
    "AFDCamError",
    "AFDCamHandoffError",
    "CAMStage",
    "CAMStageInputs",
    "CAMStageLayout",
    "ReceiveHandoff",
    "__version__",
    "prepare_stage_inputs",
    "restore_stage_outputs",
    "split_replicated",
]
