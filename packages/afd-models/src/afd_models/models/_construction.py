"""Scoped replacement of one attribute of a vLLM model module while an AFD model is constructed.

An adapter that only needs a different block class where upstream's constructor instantiates one
by name (e.g. DeepSeek's ``deepseek_v2.DeepseekV2MoE``) swaps that name for the duration of the
upstream constructor with :func:`construction_override` instead of copying the constructor.

Invariants: the original attribute is restored on exit, also when the block raises; overrides are
serialised by one process-wide (re-entrant) lock, so concurrent constructions never see each
other's replacement; a missing attribute (a vLLM that renamed it) raises ``AttributeError`` naming
it before anything changes.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_OVERRIDE_LOCK = threading.RLock()


@contextmanager
def construction_override(module: types.ModuleType, name: str, value: Any) -> Iterator[None]:
    """Replace ``module.<name>`` with ``value`` for the duration of the block (restored after).

    Only for use while constructing a model; serialised by a process-wide lock. Raises
    ``AttributeError`` naming the attribute when ``module`` has no such attribute (a vLLM that
    renamed it), before changing anything.
    """
    if not hasattr(module, name):
        raise AttributeError(
            f"{module.__name__}.{name} does not exist; this AFD adapter targets vLLM 0.32.x"
        )
    with _OVERRIDE_LOCK:
        original = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, original)
