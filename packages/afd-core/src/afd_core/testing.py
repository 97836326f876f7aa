"""Helpers for multi-process tests of AFD connectors (used by afd-core's tests; usable by others).

Invariants:
* :func:`free_ports` hands out ports below the OS's ephemeral range (Linux:
  ``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 by default), never inside it: a port
  the OS numbers itself (``bind(0)``) can be taken by any socket a starting engine opens between
  the check and the server's own bind (seen: ``EADDRINUSE`` on the AFD port), while a port below
  the range is only ever taken by a process that asks for it by number. Within one process no
  port is handed out twice.
* :func:`run_world` never hangs: every rank runs in a spawned process, results come back through
  a queue, and after ``timeout_s`` every still-running process is killed and reported as
  ``"timeout"``.
* A rank's outcome is ``("ok", value)``, ``("error", "<ExcType>: <message>", traceback_text)``,
  ``("exit", exitcode)`` (it died without reporting) or ``("timeout", None)``.
* :func:`run_stages_in_turns` stands in for the runtime's stage executor where the runtime cannot
  be imported (afd-remote's and afd-cam's tests): the stages of a split step take turns at
  ``dbo_yield`` through afd-core's hook point.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import random
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from afd_core.forward_context import (
    AFDForwardMetadata,
    install_stage_hooks,
    installed_stage_hooks,
)

__all__ = [
    "TurnTakingHooks",
    "ephemeral_port_range",
    "free_port",
    "free_ports",
    "run_stages_in_turns",
    "run_world",
]

#: Where Linux keeps the range of ports it numbers sockets from.
EPHEMERAL_RANGE_FILE: Final[Path] = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Linux's default range, used where the file cannot be read.
DEFAULT_EPHEMERAL_RANGE: Final[tuple[int, int]] = (32768, 60999)
#: The lowest port handed out (above the well-known and most registered service ports).
LOWEST_PORT: Final[int] = 10000
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The OS's ephemeral port range ``(low, high)``, inclusive."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def _candidate_window(low: int, high: int) -> range:
    """Ports outside the ephemeral range ``[low, high]``: below it when there is room."""
    if low - LOWEST_PORT >= 1000:
        return range(LOWEST_PORT, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    raise ValueError(
        f"ip_local_port_range={low} {high} leaves no test ports outside the OS's ephemeral "
        f"range; allowed: a range leaving 1000 ports free below it (from {LOWEST_PORT}) or above"
    )


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``count`` distinct TCP ports outside the ephemeral range that were free on ``host`` when
    asked (each was bound, all at once) and were not handed out before by this process."""
    if count < 1:
        raise ValueError(f"count={count!r}; allowed: >= 1")
    window = _candidate_window(*ephemeral_port_range())
    rng = random.SystemRandom()
    chosen: list[int] = []
    with contextlib.ExitStack() as stack, _handed_out_lock:
        for _ in range(50 * count):
            if len(chosen) == count:
                break
            port = rng.choice(window)
            if port in _handed_out or port in chosen:
                continue
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
        if len(chosen) < count:
            raise OSError(
                f"only {len(chosen)} of {count} free ports found on {host} in "
                f"{window.start}..{window.stop - 1}"
            )
        _handed_out.update(chosen)
    return tuple(chosen)


def free_port(host: str = "127.0.0.1") -> int:
    """One port as :func:`free_ports` chooses it."""
    return free_ports(1, host)[0]


def _entry(fn: Callable[..., Any], rank: int, args: tuple[Any, ...], out: Any) -> None:
    try:
        value = fn(rank, *args)
    except BaseException as err:
        out.put((rank, ("error", f"{type(err).__name__}: {err}", traceback.format_exc())))
        return
    out.put((rank, ("ok", value)))


def run_world(
    fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 60.0
) -> dict[int, tuple[Any, ...]]:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; return each rank's outcome.

    ``fn`` must be importable by the children (a module-level function of an importable module;
    ``sys.path`` is passed on by the spawn start method).
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, args, out), daemon=True) for r in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < nprocs and time.monotonic() < deadline:
        try:
            rank, outcome = out.get(timeout=0.05)
            results[rank] = outcome
            continue
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in results and proc.exitcode is not None:
                # Drain late reports before declaring the process dead.
                try:
                    while True:
                        r, outcome = out.get(timeout=0.2)
                        results[r] = outcome
                except queue.Empty:
                    pass
                if rank not in results:
                    results[rank] = ("exit", proc.exitcode)
    for rank, proc in enumerate(procs):
        if rank not in results:
            results[rank] = ("timeout", None)
        proc.join(timeout=0.5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    out.close()
    return results


_turn_local = threading.local()  # .turns (the run this thread's stage belongs to), .stage


class _Turns:
    def __init__(self, count: int, timeout_s: float) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.ended = [False] * count
        self.timeout_s = timeout_s

    def _pass_turn(self, stage: int) -> None:
        count = len(self.ended)
        for step in range(1, count + 1):
            other = (stage + step) % count
            if not self.ended[other]:
                self.turn = other
                break
        self.cond.notify_all()

    def _wait(self, stage: int) -> None:
        if not self.cond.wait_for(lambda: self.turn == stage, self.timeout_s):
            raise TimeoutError(f"stage {stage} never got its turn back")


class TurnTakingHooks:
    """:class:`~afd_core.forward_context.StageHooks` over whichever :func:`run_stages_in_turns`
    run the calling thread's stage belongs to (state per thread: ranks of the in-process
    transport are threads of one process, each running its own stages); idle, they do nothing."""

    def current_stage(self) -> int | None:
        return getattr(_turn_local, "stage", None)

    def yield_stage(self) -> None:
        turns: _Turns | None = getattr(_turn_local, "turns", None)
        if turns is None:
            return
        stage = _turn_local.stage
        with turns.cond:
            turns._pass_turn(stage)
            turns._wait(stage)

    def lookup_metadata(self) -> AFDForwardMetadata | None:
        return None


_TURN_HOOKS = TurnTakingHooks()


def run_stages_in_turns(stages: Sequence[Callable[[], Any]], timeout_s: float = 60.0) -> list[Any]:
    """A test stand-in for the runtime's stage executor (``afd_runtime.overlap``): run ``stages``
    on one thread each, exactly one at a time, the turn passed to the next unfinished stage at
    every :func:`~afd_core.forward_context.dbo_yield` (through :class:`TurnTakingHooks`, which
    it installs and leaves installed). Returns the results in order; the first error is
    re-raised after every stage ended."""
    turns = _Turns(len(stages), timeout_s)
    results: list[Any] = [None] * len(stages)
    errors: list[BaseException] = []

    def body(idx: int) -> None:
        _turn_local.turns, _turn_local.stage = turns, idx
        try:
            with turns.cond:
                turns._wait(idx)
            results[idx] = stages[idx]()
        except BaseException as err:
            errors.append(err)
        finally:
            _turn_local.turns = _turn_local.stage = None
            with turns.cond:
                turns.ended[idx] = True
                turns._pass_turn(idx)

    if installed_stage_hooks() is not _TURN_HOOKS:
        install_stage_hooks(_TURN_HOOKS)  # left installed: idle, it does nothing
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(stages))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * timeout_s)
    if errors:
        raise errors[0]
    return results
