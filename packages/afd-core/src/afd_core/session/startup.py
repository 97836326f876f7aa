"""Startup coordination over a torch.distributed store: ready flags, sticky failures, timeouts.

Key layout (under whatever prefix the store carries)::

    ready/<stage>/<rank>   "1" once <rank> finished <stage>
    failed/<rank>          "<stage>\\n<reason>", the first failure <rank> published (sticky)
    failcount/<rank>       counter making the first failure win

Invariants:
* Every wait is bounded (``timeout_s``) and polls the failure keys of the ranks it waits on: a
  published failure unblocks every waiter, which raises :class:`AFDStartupError` naming the failed
  rank, its stage and its reason; an expired wait raises :class:`AFDTimeoutError` naming the
  stage and the ranks still missing.
* A failure is sticky: later publications by the same rank do not overwrite the first reason.
* Publishing a failure never raises (the store may already be gone); it returns whether it
  reached the store.
* Cancellation: :func:`cancel_startup` (called e.g. from a SIGTERM handler; it only stores a
  string, so it is safe in a signal handler) makes every startup wait of this process that
  checks it -- each poll of :meth:`StartupCoordinator.wait_keys` (so every barrier), and the
  client's connection retries in :func:`open_tcp_store` -- raise :class:`AFDCancelledError`
  within one poll interval. It stays set until :func:`clear_startup_cancel`.
  :func:`startup_cancel_scope` does the same for one thread's waits while an event is set (an
  object that owns a reconnecting thread -- the Attention link, the FFN service -- ends that
  thread's wait when it closes, without cancelling the rest of the process). The blocking
  C++ calls in between (one store operation, a process group's creation once every rank is
  present) are not interruptible; each is bounded by its own timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from afd_core.errors import AFDCancelledError, AFDConfigError, AFDStartupError, AFDTimeoutError
from afd_core.session.access import StoreGate, StoreTunnel, listen_socket

__all__ = [
    "StartupCoordinator",
    "StartupFailure",
    "cancel_startup",
    "check_startup_cancelled",
    "clear_startup_cancel",
    "open_tcp_store",
    "startup_cancel_reason",
    "startup_cancel_scope",
]


@dataclass
class _ServedStore:
    """A master's store server and, with a deployment secret, the gate in front of it."""

    store: dist.TCPStore
    gate: StoreGate | None


#: Why startup was cancelled in this process (``None``: not cancelled). A plain assignment, so
#: :func:`cancel_startup` can run inside a signal handler (no lock that the interrupted thread
#: might hold).
_CANCEL_REASON: str | None = None
#: How long one connection probe of a store client waits before it checks cancellation again.
CONNECT_PROBE_S = 0.5


def cancel_startup(reason: str) -> None:
    """Cancel every startup wait of this process (see the module docstring); idempotent, the
    first reason is kept. Safe to call from a signal handler."""
    global _CANCEL_REASON
    if _CANCEL_REASON is None:
        _CANCEL_REASON = str(reason) or "cancelled"


def startup_cancel_reason() -> str | None:
    """The reason given to :func:`cancel_startup`, or ``None`` when startup is not cancelled."""
    return _CANCEL_REASON


def clear_startup_cancel() -> None:
    """Allow startup waits again (a process that keeps running after a cancelled startup)."""
    global _CANCEL_REASON
    _CANCEL_REASON = None


#: The calling thread's scoped cancellation, ``(event, reason)`` (see startup_cancel_scope).
_SCOPE = threading.local()


@contextlib.contextmanager
def startup_cancel_scope(event: threading.Event, reason: str) -> Iterator[None]:
    """Inside the block, the calling thread's startup waits also raise
    :class:`AFDCancelledError` (with ``reason``) within one poll once ``event`` is set.

    For a thread that (re)initialises a connector on behalf of an object that may close
    meanwhile: closing sets ``event`` and joins the thread, so the process never exits with the
    thread inside a store call (a thread woken there while the interpreter finalizes aborts
    the process). Scopes nest; the innermost one applies."""
    previous = getattr(_SCOPE, "current", None)
    _SCOPE.current = (event, str(reason) or "cancelled")
    try:
        yield
    finally:
        _SCOPE.current = previous


def check_startup_cancelled(stage: str) -> None:
    """Raise :class:`AFDCancelledError` naming ``stage`` if startup was cancelled (in this
    process, or in the calling thread's :func:`startup_cancel_scope`)."""
    reason = _CANCEL_REASON
    if reason is None:
        scope = getattr(_SCOPE, "current", None)
        if scope is not None and scope[0].is_set():
            reason = scope[1]
    if reason is not None:
        raise AFDCancelledError(stage, reason)


def _wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Probe ``host:port`` until something accepts a TCP connection, checking cancellation
    between probes; on expiry return (the store client then reports its own timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check_startup_cancelled("connect")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        try:
            with socket.create_connection((host, port), timeout=min(CONNECT_PROBE_S, remaining)):
                return
        except OSError:
            time.sleep(min(CONNECT_PROBE_S, max(deadline - time.monotonic(), 0.0)))


_MASTER_STORES: dict[tuple[str, int], _ServedStore] = {}


def open_tcp_store(
    host: str, port: int, *, is_master: bool, timeout_s: float, secret: bytes | None = None
) -> dist.TCPStore:
    """Open the TCPStore at ``host:port`` (the master also serves it).

    The master's store listens only on ``host`` (never on every interface). With a deployment
    ``secret`` (see :mod:`afd_core.session.access`) the store itself listens on an ephemeral loopback
    port and ``host:port`` is a :class:`~afd_core.session.access.StoreGate` admitting only connections
    that prove the secret; a client then authenticates to it before torch's store client
    connects (:class:`~afd_core.session.access.StoreTunnel`), raising
    :class:`~afd_core.errors.AFDAccessError` when the secrets differ.

    The master's store server is cached per ``(host, port)`` for the life of the process so that
    a connector can be closed and initialised again without re-binding the port (clients of a
    new initialisation use a fresh key prefix, see ``P2PConnector``). Clients retry the
    connection until ``timeout_s`` expires (the master may start later); while no server
    listens they wait in silent probes that honour :func:`cancel_startup` (raising
    :class:`AFDCancelledError`), and connect once one does.
    """
    check_startup_cancelled("connect")
    timeout = timedelta(seconds=timeout_s)
    if is_master:
        cached = _MASTER_STORES.get((host, port))
        if cached is not None:
            return cached.store
        if secret is None:
            listener = listen_socket(host, port)
            store = _serve_store(host, listener, timeout)
            _MASTER_STORES[(host, port)] = _ServedStore(store, None)
            return store
        public = listen_socket(host, port)  # first: a port in use fails before anything runs
        try:
            backend = listen_socket("127.0.0.1", 0)
            backend_port = int(backend.getsockname()[1])
            store = _serve_store("127.0.0.1", backend, timeout)
        except BaseException:
            public.close()
            raise
        gate = StoreGate(public, ("127.0.0.1", backend_port), secret)
        _MASTER_STORES[(host, port)] = _ServedStore(store, gate)
        return store
    started = time.monotonic()
    _wait_for_listener(host, port, timeout_s)
    remaining = max(timeout_s - (time.monotonic() - started), 0.001)
    if secret is None:
        client = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=remaining))
        client.set_timeout(timeout)
        return client
    tunnel = StoreTunnel(host, port, secret, remaining)
    try:
        client = dist.TCPStore(
            "127.0.0.1", tunnel.port, None, False, timeout=timedelta(seconds=remaining)
        )
        client.set_timeout(timeout)
        return client
    finally:
        tunnel.close()


def _serve_store(host: str, listener: socket.socket, timeout: timedelta) -> dist.TCPStore:
    """A master TCPStore serving on ``listener`` (bound and listening; the store owns it)."""
    port = int(listener.getsockname()[1])
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host,
            port,
            None,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,  # the backend that serves on a socket it is given
        )
    except BaseException:
        os.close(fd)
        raise


def release_store_servers() -> None:
    """Drop the cached master stores (their servers stop once no connector uses them) and close
    their gates."""
    served = list(_MASTER_STORES.values())
    _MASTER_STORES.clear()
    for entry in served:
        if entry.gate is not None:
            entry.gate.close()


@dataclass(frozen=True)
class StartupFailure:
    """A failure published by ``rank`` during ``stage``."""

    rank: int
    stage: str
    reason: str


class StartupCoordinator:
    """Ready/failure signalling among ``world_size`` ranks sharing ``store``."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        poll_interval_s: float = 0.01,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise AFDConfigError("world_size", world_size, "a positive int")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise AFDConfigError("rank", rank, f"an int in 0..{world_size - 1}")
        if not timeout_s > 0:
            raise AFDConfigError("timeout_s", timeout_s, "a number of seconds > 0")
        if not poll_interval_s > 0:
            raise AFDConfigError("poll_interval_s", poll_interval_s, "a number of seconds > 0")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.poll_interval_s = float(poll_interval_s)

    # -- publishing ----------------------------------------------------------------------

    def publish_ready(self, stage: str) -> None:
        """Mark this rank as done with ``stage``."""
        self.store.set(f"ready/{stage}/{self.rank}", "1")

    def publish_failure(self, stage: str, reason: str) -> bool:
        """Publish this rank's failure (first one wins); never raises; True if it reached the store."""
        try:
            if self.store.add(f"failcount/{self.rank}", 1) == 1:
                self.store.set(f"failed/{self.rank}", f"{stage}\n{reason}")
            return True
        except Exception:
            return False

    # -- reading ---------------------------------------------------------------------------

    def failure_of(self, rank: int) -> StartupFailure | None:
        """The failure ``rank`` published, if any (non-blocking)."""
        key = f"failed/{rank}"
        if not self.store.check([key]):
            return None
        stage, _, reason = self.store.get(key).decode("utf-8", "replace").partition("\n")
        return StartupFailure(rank, stage, reason)

    def first_failure(self, ranks: Iterable[int] | None = None) -> StartupFailure | None:
        """The failure of the lowest failed rank among ``ranks`` (default: all but this one)."""
        candidates = (
            [r for r in range(self.world_size) if r != self.rank] if ranks is None else ranks
        )
        for rank in candidates:
            failure = self.failure_of(rank)
            if failure is not None:
                return failure
        return None

    def raise_if_failed(self, ranks: Iterable[int] | None = None) -> None:
        """Raise :class:`AFDStartupError` if any of ``ranks`` published a failure."""
        failure = self.first_failure(ranks)
        if failure is not None:
            raise AFDStartupError(failure.rank, failure.stage, failure.reason)

    # -- waiting ---------------------------------------------------------------------------

    def wait_keys(
        self, keys: Mapping[int, str], stage: str, timeout_s: float | None = None
    ) -> None:
        """Wait until every ``keys[rank]`` exists, failing fast on a failure of any other rank
        (:class:`AFDStartupError`) and on :func:`cancel_startup` (:class:`AFDCancelledError`)."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        pending = dict(keys)
        while True:
            check_startup_cancelled(stage)
            for rank, key in list(pending.items()):
                if self.store.check([key]):
                    del pending[rank]
            if not pending:
                return
            self.raise_if_failed([r for r in range(self.world_size) if r != self.rank])
            if time.monotonic() >= deadline:
                raise AFDTimeoutError(
                    f"AFD startup stage {stage!r}: world ranks {sorted(pending)} not ready "
                    f"after {timeout:g}s"
                )
            time.sleep(self.poll_interval_s)

    def wait_ready(
        self, stage: str, ranks: Iterable[int] | None = None, timeout_s: float | None = None
    ) -> None:
        """Wait until ``ranks`` (default: every rank) published ready for ``stage``."""
        selected = range(self.world_size) if ranks is None else ranks
        self.wait_keys({r: f"ready/{stage}/{r}" for r in selected}, stage, timeout_s)

    def barrier(self, stage: str, timeout_s: float | None = None) -> None:
        """Publish ready for ``stage`` and wait for every rank to do the same."""
        self.publish_ready(stage)
        self.wait_ready(stage, timeout_s=timeout_s)
