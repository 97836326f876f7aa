"""The runtime's :class:`afd_core.forward_context.StageHooks`: vLLM's forward context and DBO.

afd-core's AFD layers ask three things of whoever drives the forward (the stage running on this
thread, a yield to the other stage, the forward's AFD metadata); in a vLLM worker the answers
come from here:

* the stage: afd-runtime's own executor (:func:`afd_runtime.overlap.current_overlap_stage`), else
  vLLM's dual-batch-overlap micro-batch id when vLLM's DBO runs, else ``None`` (the metadata's);
* the yield: the executor's turn (:func:`afd_runtime.overlap.overlap_yield`), else vLLM's
  ``dbo_yield`` when vLLM's DBO runs, else nothing;
* the metadata: ``ForwardContext.additional_kwargs[AFD_FORWARD_CONTEXT_KEY]`` of vLLM's active
  forward context (each split stage has its own, see :mod:`afd_runtime.stages`; vLLM's DBO
  micro-batch threads share it without inheriting context variables), else ``None``.

:func:`install` is idempotent and runs at worker start (:mod:`afd_runtime.workers.base`).
"""

from __future__ import annotations

from typing import Any

from afd_core.forward_context import (
    AFD_FORWARD_CONTEXT_KEY,
    AFDForwardMetadata,
    install_stage_hooks,
    installed_stage_hooks,
)
from vllm import forward_context as fc
from vllm.v1.worker import ubatching

from afd_runtime.overlap import current_overlap_stage, overlap_yield

__all__ = ["VLLMStageHooks", "install"]


def _vllm_dbo() -> Any | None:
    """vLLM's micro-batching module when its dual-batch overlap is on, else None."""
    try:
        return ubatching if ubatching.dbo_enabled() else None
    except Exception:  # no DBO context on this thread
        return None


class VLLMStageHooks:
    """Stage, yield and metadata for AFD layers running inside a vLLM worker."""

    def current_stage(self) -> int | None:
        stage = current_overlap_stage()
        if stage is not None:
            return stage
        dbo = _vllm_dbo()
        if dbo is None:
            return None
        try:
            return int(dbo.dbo_current_ubatch_id())
        except Exception:  # a thread vLLM's DBO did not register: the metadata's stage
            return None

    def yield_stage(self) -> None:
        if overlap_yield():
            return
        dbo = _vllm_dbo()
        if dbo is not None:
            dbo.dbo_yield()

    def lookup_metadata(self) -> AFDForwardMetadata | None:
        if not fc.is_forward_context_available():
            return None
        kwargs = getattr(fc.get_forward_context(), "additional_kwargs", None)
        meta = kwargs.get(AFD_FORWARD_CONTEXT_KEY) if isinstance(kwargs, dict) else None
        return meta if isinstance(meta, AFDForwardMetadata) else None


def install() -> VLLMStageHooks:
    """Install :class:`VLLMStageHooks` for this process unless they already are; return them."""
    current = installed_stage_hooks()
    if isinstance(current, VLLMStageHooks):
        return current
    hooks = VLLMStageHooks()
    install_stage_hooks(hooks)
    return hooks
