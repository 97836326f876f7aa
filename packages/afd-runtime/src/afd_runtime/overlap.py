"""The stage executor of a two-stage overlap (DBO): the ping-pong that runs a split step.

A step the runner split (at request boundaries, :func:`afd_core.stage_plan.plan_stages`) runs
through :func:`run_overlapped`: one callable per stage, each on its own thread, **exactly one
running at a time**: a stage runs until it calls :func:`afd_core.forward_context.dbo_yield` (the
remote FFN proxy does, between sending a layer's payload and receiving its output; the yield
reaches :func:`overlap_yield` through :mod:`afd_runtime.stage_hooks`) and the next stage still
running takes the turn. So while stage
0's FFN round trip is in flight, stage 1 computes its attention for the same layer, and so on::

    stage 0: attn L0 | send L0 ~yield~                 | recv L0, attn L1 | send L1 ~yield~ ...
    stage 1:                  | attn L0 | send L0 ~yield~                  | recv L0, attn L1 ...

Invariants:

* at most one stage runs at any moment; turns pass in stage order (0, 1, 0, 1, ...), skipping
  stages that have ended, so each layer's transfers leave in stage order on every step;
* a stage that raises ends the run: every other stage's next yield raises
  :class:`AFDOverlapError`, and :func:`run_overlapped` re-raises the first error (the original
  exception object) after every thread has ended; nothing is left running;
* every wait is bounded by ``timeout_s`` (a stage that keeps the turn longer fails the run with
  :class:`AFDTimeoutError` naming the stage that held it);
* each stage runs in a copy of the caller's :mod:`contextvars` context; ``on_resume(stage)`` is
  called on the stage's thread each time it takes the turn (the runtime restores the stage's vLLM
  forward context there);
* stages run on a process-wide pool of daemon threads (``afd-stage-<n>``), created on first use
  and reused by every later run (starting two threads per step cost more than a step's turn
  switches on a loaded 2-core host); a thread still busy (a stage stuck past its timeout) is never
  handed a second stage: the pool grows instead.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from afd_core.errors import AFDConfigError, AFDOverlapError, AFDTimeoutError

__all__ = [
    "current_overlap_stage",
    "overlap_yield",
    "run_overlapped",
]

T = TypeVar("T")

_local = threading.local()


def current_overlap_stage() -> int | None:
    """The stage the calling thread runs inside :func:`run_overlapped`, else ``None``."""
    run = getattr(_local, "run", None)
    return None if run is None else int(_local.stage)


def overlap_yield() -> bool:
    """Hand the turn to the next running stage and wait for it to come back.

    Returns False (and does nothing) outside :func:`run_overlapped` or when every other stage has
    ended; True after a round trip of the turn.

    Raises:
        AFDOverlapError: another stage failed while this one waited.
        AFDTimeoutError: the turn did not come back within the run's ``timeout_s``.
    """
    run: _Run[Any] | None = getattr(_local, "run", None)
    if run is None:
        return False
    return run.yield_turn(int(_local.stage))


class _Run(Generic[T]):
    """The shared state of one :func:`run_overlapped` call."""

    def __init__(self, num_stages: int, timeout_s: float, on_resume: Callable[[int], None] | None):
        self.n = num_stages
        self.timeout_s = timeout_s
        self.on_resume = on_resume
        self.cond = threading.Condition()
        self.turn = -1  # nobody runs until the caller starts stage 0
        self.ended = [False] * num_stages
        self.results: list[Any] = [None] * num_stages
        self.error: BaseException | None = None
        self.failed_stage: int | None = None

    # -- called with self.cond held ----------------------------------------------------------

    def _next_live(self, stage: int) -> int | None:
        for step in range(1, self.n + 1):
            other = (stage + step) % self.n
            if not self.ended[other]:
                return other
        return None

    def _wait_turn(self, stage: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while self.turn != stage:
            if self.error is not None:
                raise AFDOverlapError(
                    f"stage {stage} stopped: stage {self.failed_stage} failed with "
                    f"{type(self.error).__name__}: {self.error}"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise AFDTimeoutError(
                    f"stage {stage} waited {self.timeout_s:g}s for its turn; stage {self.turn} "
                    "kept it (a stage must yield or end within timeout_s)"
                )
            self.cond.wait(left)
        if self.error is not None:
            raise AFDOverlapError(
                f"stage {stage} stopped: stage {self.failed_stage} failed with "
                f"{type(self.error).__name__}: {self.error}"
            )

    # -- stage-thread operations -------------------------------------------------------------

    def yield_turn(self, stage: int) -> bool:
        with self.cond:
            if self.error is not None:
                raise AFDOverlapError(
                    f"stage {stage} stopped: stage {self.failed_stage} failed with "
                    f"{type(self.error).__name__}: {self.error}"
                )
            nxt = self._next_live(stage)
            if nxt is None or nxt == stage:
                return False
            self.turn = nxt
            self.cond.notify_all()
            self._wait_turn(stage)
        if self.on_resume is not None:
            self.on_resume(stage)
        return True

    def body(self, stage: int, fn: Callable[[], T]) -> None:
        _local.run, _local.stage = self, stage
        try:
            with self.cond:
                self._wait_turn(stage)
            if self.on_resume is not None:
                self.on_resume(stage)
            self.results[stage] = fn()
        except BaseException as exc:  # recorded; re-raised by run_overlapped
            with self.cond:
                if self.error is None:
                    self.error, self.failed_stage = exc, stage
        finally:
            _local.run = None
            with self.cond:
                self.ended[stage] = True
                nxt = self._next_live(stage)
                if self.turn == stage or self.error is not None:
                    self.turn = -1 if nxt is None else nxt
                self.cond.notify_all()


class _Worker:
    """One pooled stage thread: runs the jobs it is handed, one at a time."""

    def __init__(self, name: str) -> None:
        self.busy = False
        self.jobs: queue.SimpleQueue[tuple[Callable[[], object], threading.Event]] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self.jobs.get()
            try:
                job()  # _Run.body: records every error itself
            finally:
                self.busy = False
                done.set()


_POOL: list[_Worker] = []
_POOL_LOCK = threading.Lock()


def _take_workers(count: int, name: str) -> list[_Worker]:
    with _POOL_LOCK:
        taken = [w for w in _POOL if not w.busy][:count]
        while len(taken) < count:
            worker = _Worker(f"{name}-{len(_POOL)}")
            _POOL.append(worker)
            taken.append(worker)
        for worker in taken:
            worker.busy = True
    return taken


def run_overlapped(
    stages: Sequence[Callable[[], T]],
    *,
    timeout_s: float,
    on_resume: Callable[[int], None] | None = None,
    name: str = "afd-stage",
) -> list[T]:
    """Run each callable of ``stages`` on its own (pooled) thread, one at a time, switching at
    yields.

    Returns the stages' results in stage order. A lone stage never waits at a yield.

    Raises:
        AFDConfigError: no stage, or ``timeout_s`` is not a positive number.
        BaseException: the first error a stage raised (see the module invariants).
        AFDTimeoutError: a stage did not end within ``2 * timeout_s`` after the run's last turn
            change (its thread stays busy and leaves the pool's rotation).
    """
    if not stages:
        raise AFDConfigError("stages", list(stages), "one callable per stage")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise AFDConfigError("timeout_s", timeout_s, "seconds > 0")
    run: _Run[T] = _Run(len(stages), float(timeout_s), on_resume)
    done = [threading.Event() for _ in stages]
    for idx, (worker, fn) in enumerate(zip(_take_workers(len(stages), name), stages, strict=True)):
        ctx = contextvars.copy_context()
        worker.jobs.put((functools.partial(ctx.run, run.body, idx, fn), done[idx]))
    with run.cond:
        run.turn = 0
        run.cond.notify_all()
    for idx, finished in enumerate(done):
        # Each stage's waits are bounded by timeout_s, so a stage ends unless its body blocks
        # outside them; the caller waits twice that without a turn change, then gives up (the
        # stage's own error first, when it recorded one).
        while not finished.is_set():
            with run.cond:
                before = run.turn
            if finished.wait(2 * run.timeout_s):
                break
            with run.cond:
                stuck = run.turn == before
            if stuck:
                if run.error is not None:
                    raise run.error
                raise AFDTimeoutError(
                    f"stage {idx} did not end within {2 * run.timeout_s:g}s "
                    f"(turn held by stage {before})"
                )
    if run.error is not None:
        raise run.error
    return list(run.results)
