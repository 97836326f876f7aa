"""SIGTERM/SIGINT end an AFD role's startup waits (waiting for its peer role) at once.

vLLM 0.32's engine core only records a termination signal while the engine is being built (its
handler cannot interrupt construction), and an AFD worker's ``load_model`` may wait up to
``startup_timeout_s`` for the peer role inside that construction. :func:`cancel_startup_on_signals`
installs, in the engine core's main thread, a handler that first calls
:func:`afd_core.startup.cancel_startup` (every startup wait of afd-core then raises
:class:`afd_core.errors.AFDCancelledError` within one poll) and then chains to the handler it
replaced, so vLLM's own shutdown bookkeeping still runs.

Invariants: isolated (only the two signals' handlers of the calling process change), idempotent
(a handler already chained is not chained again), main thread only (elsewhere it does nothing
and returns False); a replaced default action (``SIG_DFL``) is kept: the handler restores it and
re-raises the signal; an ignored signal (``SIG_IGN``) stays ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Final

from afd_core.session.startup import cancel_startup

# Under "vllm.": in an API server process only vLLM's logger tree has handlers.
logger = logging.getLogger("vllm.afd.signals")

#: The signals that cancel startup.
CANCEL_SIGNALS: Final[tuple[signal.Signals, ...]] = (signal.SIGTERM, signal.SIGINT)
_MARK: Final[str] = "_afd_cancels_startup"


def _chained(previous: Any) -> Callable[[int, FrameType | None], Any]:
    def handler(signum: int, frame: FrameType | None) -> Any:
        cancel_startup(signal.Signals(signum).name)
        if callable(previous):
            return previous(signum, frame)
        # The replaced action was the default one (terminate): restore and re-deliver it.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return None

    setattr(handler, _MARK, True)
    handler.afd_previous = previous  # type: ignore[attr-defined]
    return handler


def cancel_startup_on_signals(signals: Iterable[signal.Signals] = CANCEL_SIGNALS) -> bool:
    """Chain :func:`afd_core.startup.cancel_startup` in front of each signal's current handler.

    Returns False (changing nothing) outside the main thread, True otherwise."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in signals:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or getattr(previous, _MARK, False):
            continue
        signal.signal(sig, _chained(previous))
    return True


def cancels_startup(sig: signal.Signals) -> bool:
    """True when ``sig``'s current handler cancels startup (see :func:`cancel_startup_on_signals`)."""
    return bool(getattr(signal.getsignal(sig), _MARK, False))


#: How long the main thread may stay in its wait after a termination signal before the signal
#: is re-sent to it.
FORWARD_GRACE_S: Final[float] = 1.0
#: At most this many re-sends per block.
MAX_FORWARDS: Final[int] = 3


def _blocked_in_zmq_poll(thread_ident: int) -> bool:
    """True when the thread's innermost Python frame is pyzmq's poll (a C wait)."""
    import sys

    frame = sys._current_frames().get(thread_ident)
    if frame is None:
        return False
    return frame.f_code.co_name == "poll" and "zmq" in frame.f_code.co_filename


class _MainThreadSignalForwarder:
    """Re-sends SIGTERM/SIGINT to the main thread while it stays blocked in a zmq poll.

    vLLM 0.32's API server waits for its engine cores in one ``zmq`` poll of up to
    ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s) in the main thread, with vLLM's ``_interrupt_init``
    as SIGTERM handler (it raises ``KeyboardInterrupt``). Measured on CPU during an AFD
    Attention startup: the first SIGTERM was lost -- the handler ran (recorded here) but the
    main thread stayed in the poll; a second SIGTERM stopped it. (Python handlers run only in
    the main thread; the interrupted pyzmq poll retries on ``EINTR``.) While active, this
    forwarder watches every signal through :func:`signal.set_wakeup_fd` (the C-level handler
    writes each one there, whatever thread takes it) and, when the main thread is still blocked
    in a zmq poll :data:`FORWARD_GRACE_S` after a termination signal, sends that signal to the
    main thread itself (``pthread_kill``), at most :data:`MAX_FORWARDS` times. Once the
    handler's exception propagates the main thread leaves the poll (vLLM's cleanup runs) and
    nothing more is sent. Bytes are passed on to the previous wakeup fd (uvloop's).
    """

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.forwarded: list[int] = []
        #: Termination signals whose Python handler ran inside the block.
        self.handled: list[int] = []
        self._handlers: dict[int, Any] = {}
        self._active = False
        self._stop = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _MainThreadSignalForwarder:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            if callable(previous):
                self._handlers[sig] = previous
                signal.signal(sig, self._recording(previous))
        self._active = True
        self._thread = threading.Thread(
            target=self._watch,
            args=(threading.main_thread().ident,),
            daemon=True,
            name="afd-signal-forwarder",
        )
        self._thread.start()
        return self

    def _recording(self, previous: Callable[[int, FrameType | None], Any]) -> Any:
        def handler(signum: int, frame: FrameType | None) -> Any:
            self.handled.append(signum)
            return previous(signum, frame)

        handler.afd_recording = True  # type: ignore[attr-defined]
        return handler

    def __exit__(self, *_exc: object) -> None:
        self._active = False
        self._stop.set()
        for sig, previous in self._handlers.items():
            if getattr(signal.getsignal(sig), "afd_recording", False):
                signal.signal(sig, previous)
        signal.set_wakeup_fd(self._previous_fd)
        if self._thread is not None:
            self._thread.join(5.0)
        if self._pipe is not None:
            for fd in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pipe = None

    def _watch(self, main_ident: int | None) -> None:
        import select

        assert self._pipe is not None
        r = self._pipe[0]
        pending: dict[int, float] = {}
        while not self._stop.is_set():
            ready, _, _ = select.select([r], [], [], 0.1)
            if ready:
                try:
                    data = os.read(r, 512)
                except OSError:
                    data = b""
                if data and self._previous_fd >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self._previous_fd, data)
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        logger.info("AFD: %s received", signal.Signals(signum).name)
                        self.seen.append(signum)
                        pending.setdefault(signum, time.monotonic() + FORWARD_GRACE_S)
            now = time.monotonic()
            for signum, due in list(pending.items()):
                if now < due:
                    continue
                del pending[signum]
                if (
                    self._active
                    and main_ident is not None
                    and len(self.forwarded) < MAX_FORWARDS
                    and _blocked_in_zmq_poll(main_ident)
                ):
                    self.forwarded.append(signum)
                    logger.info(
                        "AFD: still waiting %gs after %s; re-sent to the main thread",
                        FORWARD_GRACE_S,
                        signal.Signals(signum).name,
                    )
                    with contextlib.suppress(OSError, ValueError):
                        signal.pthread_kill(main_ident, signum)


@contextlib.contextmanager
def termination_reaches_main_thread() -> Iterator[_MainThreadSignalForwarder | None]:
    """Within the block, a SIGTERM/SIGINT after which the main thread stays blocked in a zmq
    poll for :data:`FORWARD_GRACE_S` is re-sent to the main thread (see
    :class:`_MainThreadSignalForwarder`). Outside the main thread: does nothing (yields
    ``None``)."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    with _MainThreadSignalForwarder() as forwarder:
        yield forwarder
