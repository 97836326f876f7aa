"""Liveness and goodbye on the session's store.

Each FFN rank adds to ``alive/<rank>`` every :data:`HEARTBEAT_S`; each Attention rank reads its
FFN peers' counters and reports a peer whose counter has not moved for
:data:`LIVENESS_TIMEOUT_S` (stage ``liveness``: the process is gone or stalled). A rank that
closes cleanly sets ``left/<rank>`` first (its goodbye): a watcher then reports it at its next
look (stage ``goodbye``) instead of after the liveness timeout, and a transport waiting on that
peer can stop waiting (:func:`has_left`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from afd_core.errors import AFDPeerError

__all__ = ["HEARTBEAT_S", "LIVENESS_TIMEOUT_S", "has_left", "say_goodbye", "start_liveness"]

#: How often an FFN rank beats its heartbeat on the store and an Attention rank reads it.
HEARTBEAT_S = 1.0
#: An FFN peer whose heartbeat has not moved for this long is reported lost (``liveness``).
#: Generous: a busy 2-core host can stall a thread for a while; in-flight transfers to a
#: vanished peer fail at once anyway (a transport notices the peer's goodbye or lost link).
LIVENESS_TIMEOUT_S = 10.0


def say_goodbye(store: Any, world_rank: int) -> None:
    """Mark ``world_rank`` as having left this round cleanly; never raises."""
    with contextlib.suppress(Exception):  # the store is gone: nobody is left to tell
        store.set(f"left/{world_rank}", "1")


def has_left(store: Any, world_rank: int) -> bool:
    """Whether ``world_rank`` said goodbye in this round (``False`` if the store is gone)."""
    try:
        return bool(store.check([f"left/{world_rank}"]))
    except Exception:
        return False


def start_liveness(
    store: Any,
    world_rank: int,
    *,
    beat: bool,
    watch: Sequence[int],
    on_lost: Callable[[AFDPeerError], None],
    stop: threading.Event,
) -> None:
    """Start this rank's liveness thread: beat its own counter (``beat``) and/or watch the
    ``watch`` peers', calling ``on_lost`` once with the first lost peer's :class:`AFDPeerError`.
    The thread ends when ``stop`` is set."""
    if not beat and not watch:
        return
    threading.Thread(
        target=_run,
        args=(store, world_rank, beat, tuple(watch), on_lost, stop),
        name=f"afd-liveness-{world_rank}",
        daemon=True,
    ).start()


def _run(
    store: Any,
    world_rank: int,
    beat: bool,
    watch: tuple[int, ...],
    on_lost: Callable[[AFDPeerError], None],
    stop: threading.Event,
) -> None:
    seen = {rank: (-1, time.monotonic()) for rank in watch}
    while True:
        if beat:
            try:
                store.add(f"alive/{world_rank}", 1)
            except Exception:  # the store's server is gone: the connector's ops will say so
                return
        if stop.wait(HEARTBEAT_S):
            return
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            try:
                if store.check([f"left/{rank}"]):
                    stage, reason = "goodbye", "left the session (closed)"
                else:
                    value = int(store.add(f"alive/{rank}", 0))
                    if value != count:
                        seen[rank] = (value, now)
                        continue
                    if now - since < LIVENESS_TIMEOUT_S:
                        continue
                    stage = "liveness"
                    reason = f"no heartbeat for {now - since:.1f}s (process gone or stalled)"
            except Exception as err:
                stage = "liveness"
                reason = f"the rendezvous store is unreachable: {type(err).__name__}: {err}"
            if not stop.is_set():
                on_lost(AFDPeerError(rank, stage, reason))
            return
