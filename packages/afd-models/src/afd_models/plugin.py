"""vLLM ``general_plugins`` entry point for AFD.

vLLM calls :func:`register` in every process it starts, possibly more than once, so it must be
re-entrant and cheap. It never imports vLLM at module import time.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register AFD with vLLM. Idempotent: later calls are no-ops."""
    global _registered
    if _registered:
        return
    _registered = True
