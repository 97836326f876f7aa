"""Install and read the AFD metadata of the current forward, and the DBO yield hook.

Invariants:
* :func:`set_afd_forward_metadata` installs the metadata for the duration of a ``with`` block in
  two places: a :class:`contextvars.ContextVar` (works without vLLM, e.g. in unit tests) and, when
  a vLLM forward context is active, ``ForwardContext.additional_kwargs["afd_metadata"]`` (so vLLM's
  DBO micro-batch threads, which do not inherit context variables, see it too). Both are restored
  on exit, even on error.
* :func:`get_afd_forward_metadata` prefers the active vLLM forward context's entry, then the
  context variable, and raises :class:`AFDContextError` when neither holds metadata.
* vLLM is never imported here: its modules are only consulted if already loaded in the process.
* :func:`dbo_yield` hands the turn to the other stage when the caller runs inside afd-core's
  two-stage overlap (:func:`afd_core.overlap.run_overlapped`), else yields to vLLM's dual-batch
  overlap when that runs in this process, else does nothing. :func:`current_stage_idx` follows
  the same order.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from afd_core.errors import AFDContextError
from afd_core.overlap import current_overlap_stage, overlap_yield

if TYPE_CHECKING:
    from afd_core.connector import AFDConnectorBase

__all__ = [
    "AFD_FORWARD_CONTEXT_KEY",
    "AFDForwardMetadata",
    "current_stage_idx",
    "dbo_yield",
    "get_afd_forward_metadata",
    "has_afd_forward_metadata",
    "set_afd_forward_metadata",
]

AFD_FORWARD_CONTEXT_KEY = "afd_metadata"
"""Key under vLLM ``ForwardContext.additional_kwargs`` holding :class:`AFDForwardMetadata`."""

_current: contextvars.ContextVar[AFDForwardMetadata | None] = contextvars.ContextVar(
    "afd_forward_metadata", default=None
)


@dataclass(frozen=True)
class AFDForwardMetadata:
    """What the AFD layers of one forward need: the connector and the stage layout.

    ``stage_idx`` is the stage (micro-batch) of this forward when DBO is off; with vLLM DBO the
    current micro-batch id wins (see :func:`current_stage_idx`). ``num_tokens`` is this rank's
    token count per stage when known.
    """

    connector: AFDConnectorBase
    stage_idx: int = 0
    num_stages: int = 1
    layer_idx: int | None = None
    num_tokens: tuple[int, ...] | None = None
    is_warmup: bool = False
    is_capture: bool = False

    def __post_init__(self) -> None:
        from afd_core.connector import AFDConnectorBase

        if not isinstance(self.connector, AFDConnectorBase):
            raise AFDContextError(
                f"AFDForwardMetadata.connector must be an AFDConnectorBase, "
                f"got {type(self.connector).__name__}"
            )
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int):
            raise AFDContextError(f"num_stages must be an int, got {self.num_stages!r}")
        if self.num_stages < 1:
            raise AFDContextError(f"num_stages must be >= 1, got {self.num_stages}")
        if (
            isinstance(self.stage_idx, bool)
            or not isinstance(self.stage_idx, int)
            or not 0 <= self.stage_idx < self.num_stages
        ):
            raise AFDContextError(
                f"stage_idx must be an int in 0..{self.num_stages - 1}, got {self.stage_idx!r}"
            )
        if self.layer_idx is not None and (
            isinstance(self.layer_idx, bool)
            or not isinstance(self.layer_idx, int)
            or self.layer_idx < 0
        ):
            raise AFDContextError(f"layer_idx must be None or an int >= 0, got {self.layer_idx!r}")
        if self.num_tokens is not None:
            counts = tuple(self.num_tokens)
            if len(counts) != self.num_stages or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts
            ):
                raise AFDContextError(
                    f"num_tokens must hold {self.num_stages} non-negative ints, "
                    f"got {self.num_tokens!r}"
                )
            object.__setattr__(self, "num_tokens", counts)

    def with_layer(self, layer_idx: int) -> AFDForwardMetadata:
        """A copy with ``layer_idx`` set."""
        return replace(self, layer_idx=layer_idx)

    def with_stage(self, stage_idx: int) -> AFDForwardMetadata:
        """A copy with ``stage_idx`` set."""
        return replace(self, stage_idx=stage_idx)


def _vllm_forward_context() -> Any | None:
    """The active vLLM ForwardContext, if vLLM is loaded and one is set; never imports vLLM."""
    module = sys.modules.get("vllm.forward_context")
    if module is None:
        return None
    try:
        if not module.is_forward_context_available():
            return None
        return module.get_forward_context()
    except Exception:
        return None


@contextmanager
def set_afd_forward_metadata(metadata: AFDForwardMetadata) -> Iterator[AFDForwardMetadata]:
    """Install ``metadata`` for the enclosed forward (nests; restores the previous on exit)."""
    if not isinstance(metadata, AFDForwardMetadata):
        raise AFDContextError(
            f"set_afd_forward_metadata needs an AFDForwardMetadata, got {type(metadata).__name__}"
        )
    token = _current.set(metadata)
    fctx = _vllm_forward_context()
    kwargs: dict[str, Any] | None = getattr(fctx, "additional_kwargs", None) if fctx else None
    missing = object()
    previous: Any = missing
    if isinstance(kwargs, dict):
        previous = kwargs.get(AFD_FORWARD_CONTEXT_KEY, missing)
        kwargs[AFD_FORWARD_CONTEXT_KEY] = metadata
    try:
        yield metadata
    finally:
        if isinstance(kwargs, dict):
            if previous is missing:
                kwargs.pop(AFD_FORWARD_CONTEXT_KEY, None)
            else:
                kwargs[AFD_FORWARD_CONTEXT_KEY] = previous
        _current.reset(token)


def _lookup() -> AFDForwardMetadata | None:
    fctx = _vllm_forward_context()
    if fctx is not None:
        kwargs = getattr(fctx, "additional_kwargs", None)
        if isinstance(kwargs, dict):
            meta = kwargs.get(AFD_FORWARD_CONTEXT_KEY)
            if isinstance(meta, AFDForwardMetadata):
                return meta
    return _current.get()


def has_afd_forward_metadata() -> bool:
    """True when :func:`get_afd_forward_metadata` would succeed."""
    return _lookup() is not None


def get_afd_forward_metadata() -> AFDForwardMetadata:
    """The installed metadata; raises :class:`AFDContextError` when there is none."""
    meta = _lookup()
    if meta is None:
        raise AFDContextError(
            "no AFD forward metadata is installed for this forward; wrap the forward in "
            "afd_core.forward_context.set_afd_forward_metadata(...) (or attach it to vLLM's "
            f"ForwardContext.additional_kwargs[{AFD_FORWARD_CONTEXT_KEY!r}])"
        )
    return meta


def _vllm_ubatching() -> Any | None:
    return sys.modules.get("vllm.v1.worker.ubatching")


def current_stage_idx() -> int:
    """The current stage: afd-core's overlap stage, else vLLM's DBO micro-batch id when DBO
    runs, else the metadata's stage."""
    stage = current_overlap_stage()
    if stage is not None:
        return stage
    ubatching = _vllm_ubatching()
    if ubatching is not None:
        try:
            if ubatching.dbo_enabled():
                return int(ubatching.dbo_current_ubatch_id())
        except Exception:
            pass
    return get_afd_forward_metadata().stage_idx


def dbo_yield() -> None:
    """Yield to the other stage (afd-core's overlap, else vLLM's ``dbo_yield``); a no-op
    without either."""
    if overlap_yield():
        return
    ubatching = _vllm_ubatching()
    if ubatching is None:
        return
    enabled = getattr(ubatching, "dbo_enabled", None)
    if enabled is not None and enabled():
        ubatching.dbo_yield()
