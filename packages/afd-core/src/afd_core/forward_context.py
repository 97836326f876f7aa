"""Install and read the AFD metadata of the current forward; the stage hook point.

Invariants:
* :func:`set_afd_forward_metadata` installs the metadata in a :class:`contextvars.ContextVar` for
  the duration of a ``with`` block (nests; restored on exit, even on error).
* :func:`get_afd_forward_metadata` asks the installed :class:`StageHooks` first (the runtime finds
  the metadata of the running stage there, e.g. in vLLM's forward context, which DBO micro-batch
  threads share without inheriting context variables), then the context variable, and raises
  :class:`AFDContextError` when neither holds metadata.
* :func:`dbo_yield` and :func:`current_stage_idx` ask the installed hooks: yield to the other
  stage / the stage running on this thread. With no hooks installed (or hooks that report no
  stage) ``dbo_yield`` does nothing and the stage is the metadata's ``stage_idx``.
* This module knows nothing of the runtime that drives the forward: the hooks are the one point
  where afd-runtime plugs its stage executor and vLLM's forward context in
  (:func:`install_stage_hooks`, once per process, at worker start).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from afd_core.errors import AFDContextError

if TYPE_CHECKING:
    from afd_core.connector import AFDConnectorBase

__all__ = [
    "AFD_FORWARD_CONTEXT_KEY",
    "AFDForwardMetadata",
    "StageHooks",
    "current_stage_idx",
    "dbo_yield",
    "get_afd_forward_metadata",
    "has_afd_forward_metadata",
    "install_stage_hooks",
    "installed_stage_hooks",
    "set_afd_forward_metadata",
]

AFD_FORWARD_CONTEXT_KEY = "afd_metadata"
"""The key a runtime stores :class:`AFDForwardMetadata` under in its own per-forward state (vLLM:
``ForwardContext.additional_kwargs``), for its :meth:`StageHooks.lookup_metadata`."""

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


@runtime_checkable
class StageHooks(Protocol):
    """What the runtime that drives a forward tells the AFD layers (the one hook point).

    Every method is called on the thread running the forward (or one of its stages) and must
    not block except :meth:`yield_stage`, which blocks until this stage's turn comes back."""

    def current_stage(self) -> int | None:
        """The stage (micro-batch) running on this thread, or ``None`` when no stage executor
        runs here (the metadata's ``stage_idx`` then counts)."""
        ...

    def yield_stage(self) -> None:
        """Hand the turn to the other stage and wait for it to come back; return at once when
        no other stage runs."""
        ...

    def lookup_metadata(self) -> AFDForwardMetadata | None:
        """The metadata of the forward running on this thread when the runtime holds it (e.g.
        in vLLM's forward context), else ``None``."""
        ...


_hooks: StageHooks | None = None
_hooks_lock = threading.Lock()


def install_stage_hooks(hooks: StageHooks | None) -> StageHooks | None:
    """Install ``hooks`` for this process (``None`` removes them); returns the previous ones.

    Raises:
        AFDContextError: ``hooks`` does not implement :class:`StageHooks`.
    """
    global _hooks
    if hooks is not None and not isinstance(hooks, StageHooks):
        raise AFDContextError(
            f"install_stage_hooks needs a StageHooks (current_stage, yield_stage, "
            f"lookup_metadata), got {type(hooks).__name__}"
        )
    with _hooks_lock:
        previous, _hooks = _hooks, hooks
    return previous


def installed_stage_hooks() -> StageHooks | None:
    """The hooks :func:`install_stage_hooks` installed, if any."""
    return _hooks


@contextmanager
def set_afd_forward_metadata(metadata: AFDForwardMetadata) -> Iterator[AFDForwardMetadata]:
    """Install ``metadata`` for the enclosed forward (nests; restores the previous on exit)."""
    if not isinstance(metadata, AFDForwardMetadata):
        raise AFDContextError(
            f"set_afd_forward_metadata needs an AFDForwardMetadata, got {type(metadata).__name__}"
        )
    token = _current.set(metadata)
    try:
        yield metadata
    finally:
        _current.reset(token)


def _lookup() -> AFDForwardMetadata | None:
    hooks = _hooks
    if hooks is not None:
        meta = hooks.lookup_metadata()
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
            "afd_core.forward_context.set_afd_forward_metadata(...) (or let the runtime's "
            "StageHooks.lookup_metadata find it)"
        )
    return meta


def current_stage_idx() -> int:
    """The current stage: the hooks' stage when a stage executor runs on this thread, else the
    metadata's ``stage_idx``."""
    hooks = _hooks
    stage = hooks.current_stage() if hooks is not None else None
    if stage is not None:
        return int(stage)
    return get_afd_forward_metadata().stage_idx


def dbo_yield() -> None:
    """Yield to the other stage through the installed hooks; a no-op without them."""
    hooks = _hooks
    if hooks is not None:
        hooks.yield_stage()
