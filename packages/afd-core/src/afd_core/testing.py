"""Helpers for multi-process tests of AFD connectors (used by afd-core's tests; usable by others).

Invariants:
* :func:`run_world` never hangs: every rank runs in a spawned process, results come back through
  a queue, and after ``timeout_s`` every still-running process is killed and reported as
  ``"timeout"``.
* A rank's outcome is ``("ok", value)``, ``("error", "<ExcType>: <message>", traceback_text)``,
  ``("exit", exitcode)`` (it died without reporting) or ``("timeout", None)``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "run_world"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
