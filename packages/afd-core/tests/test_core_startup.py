"""StartupCoordinator on an in-process store: ready, sticky failures, timeouts, unblocking."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from afd_core.errors import AFDCancelledError, AFDConfigError, AFDStartupError, AFDTimeoutError
from afd_core.session.startup import (
    StartupCoordinator,
    cancel_startup,
    check_startup_cancelled,
    clear_startup_cancel,
    open_tcp_store,
    startup_cancel_reason,
    startup_cancel_scope,
)


def coords(n: int, timeout_s: float = 5.0) -> list[StartupCoordinator]:
    store = dist.HashStore()
    return [StartupCoordinator(store, rank=r, world_size=n, timeout_s=timeout_s) for r in range(n)]


def test_barrier_all_ready() -> None:
    cs = coords(3)
    errors: list[BaseException] = []

    def run(c: StartupCoordinator) -> None:
        try:
            c.barrier("load")
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(c,)) for c in cs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_failure_unblocks_waiters_with_rank_stage_reason() -> None:
    cs = coords(3, timeout_s=30.0)
    raised: dict[int, BaseException] = {}

    def wait(c: StartupCoordinator) -> None:
        try:
            c.barrier("weights")
        except BaseException as err:
            raised[c.rank] = err

    threads = [threading.Thread(target=wait, args=(c,)) for c in cs[:2]]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert cs[2].publish_failure("weights", "checkpoint shard missing")
    for t in threads:
        t.join(10)
    assert set(raised) == {0, 1}
    for err in raised.values():
        assert isinstance(err, AFDStartupError)
        assert (err.rank, err.stage, err.reason) == (2, "weights", "checkpoint shard missing")
        assert "rank 2" in str(err) and "weights" in str(err)


def test_failure_is_sticky() -> None:
    c0, c1 = coords(2)
    c1.publish_failure("first", "root cause")
    c1.publish_failure("second", "consequence")
    failure = c0.failure_of(1)
    assert failure is not None and (failure.stage, failure.reason) == ("first", "root cause")
    assert c0.first_failure() == failure
    assert c0.failure_of(0) is None
    with pytest.raises(AFDStartupError):
        c0.raise_if_failed()


def test_timeout_names_stage_and_missing_ranks() -> None:
    c0, _c1, _c2 = coords(3, timeout_s=0.2)
    c0.publish_ready("ready")
    with pytest.raises(AFDTimeoutError, match=r"'ready'.*\[1, 2\]"):
        c0.wait_ready("ready")


def test_publish_failure_never_raises() -> None:
    class Broken:
        def add(self, key: str, value: int) -> int:
            raise RuntimeError("store gone")

    c = StartupCoordinator(Broken(), rank=0, world_size=1, timeout_s=1.0)  # type: ignore[arg-type]
    assert c.publish_failure("x", "y") is False


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": 0, "world_size": 0}, "world_size"),
        ({"rank": 0, "world_size": 1, "timeout_s": 0}, "timeout_s"),
        ({"rank": 0, "world_size": 1, "poll_interval_s": 0}, "poll_interval_s"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, float], field: str) -> None:
    args = {"timeout_s": 1.0, **kwargs}
    with pytest.raises(AFDConfigError) as info:
        StartupCoordinator(dist.HashStore(), **args)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.fixture
def no_cancel() -> Iterator[None]:
    clear_startup_cancel()
    yield
    clear_startup_cancel()


def test_cancel_unblocks_wait_keys_naming_stage_and_reason(no_cancel: None) -> None:
    c0, _ = coords(2, timeout_s=30.0)
    threading.Timer(0.3, cancel_startup, ("SIGTERM",)).start()
    t0 = time.monotonic()
    with pytest.raises(AFDCancelledError) as err:
        c0.barrier("handshake")
    assert time.monotonic() - t0 < 5.0
    assert (err.value.stage, err.value.reason) == ("handshake", "SIGTERM")
    assert "cancelled during 'handshake': SIGTERM" in str(err.value)


def test_cancel_keeps_first_reason_until_cleared(no_cancel: None) -> None:
    assert startup_cancel_reason() is None
    check_startup_cancelled("x")  # not cancelled: no error
    cancel_startup("SIGTERM")
    cancel_startup("SIGINT")
    assert startup_cancel_reason() == "SIGTERM"
    with pytest.raises(AFDCancelledError, match="'x': SIGTERM"):
        check_startup_cancelled("x")
    clear_startup_cancel()
    assert startup_cancel_reason() is None
    c0, c1 = coords(2)
    c1.publish_ready("s")
    c0.wait_ready("s", ranks=[1])  # waits work again


def test_cancel_unblocks_a_store_client_waiting_for_its_server(no_cancel: None) -> None:
    from afd_core.testing import free_port

    port = free_port()  # nothing listens there
    threading.Timer(1.0, cancel_startup, ("SIGTERM",)).start()
    t0 = time.monotonic()
    with pytest.raises(AFDCancelledError) as err:
        open_tcp_store("127.0.0.1", port, is_master=False, timeout_s=60.0)
    assert 0.9 < time.monotonic() - t0 < 5.0
    assert err.value.stage == "connect"


def test_a_cancel_scope_ends_only_its_own_threads_waits(no_cancel: None) -> None:
    """Setting a scope's event ends the waits of the thread inside the scope, naming the stage
    and the scope's reason; another thread's wait on the same store, and the process-wide
    cancellation, are untouched; leaving the scope restores the outer one."""
    c0, c1, c2 = coords(3, timeout_s=30.0)
    closing = threading.Event()
    out: dict[str, object] = {}

    def scoped() -> None:
        with startup_cancel_scope(closing, "the link closed"):
            try:
                c0.wait_ready("handshake", ranks=[2])
            except AFDCancelledError as err:
                out["scoped"] = (err.stage, err.reason, time.monotonic())
        check_startup_cancelled("after")  # outside the scope: not cancelled
        out["after"] = True

    def unscoped() -> None:
        c1.wait_ready("handshake", ranks=[2])
        out["unscoped"] = time.monotonic()

    threads = [threading.Thread(target=scoped), threading.Thread(target=unscoped)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    set_at = time.monotonic()
    closing.set()
    threads[0].join(5.0)
    assert not threads[0].is_alive()
    stage, reason, at = out["scoped"]  # type: ignore[misc]
    assert (stage, reason) == ("handshake", "the link closed")
    assert at - set_at < 2.0
    assert out["after"] is True
    assert startup_cancel_reason() is None
    assert threads[1].is_alive()  # still waiting: only the scoped thread was cancelled
    c2.publish_ready("handshake")
    threads[1].join(5.0)
    assert "unscoped" in out


def test_cancel_scopes_nest_and_the_innermost_applies(no_cancel: None) -> None:
    outer, inner = threading.Event(), threading.Event()
    with startup_cancel_scope(outer, "outer"):
        with startup_cancel_scope(inner, "inner"):
            outer.set()
            check_startup_cancelled("s")  # the inner scope's event is not set
            inner.set()
            with pytest.raises(AFDCancelledError, match="'s': inner"):
                check_startup_cancelled("s")
        with pytest.raises(AFDCancelledError, match="'s': outer"):
            check_startup_cancelled("s")
    check_startup_cancelled("s")


def test_a_claim_waiting_for_a_round_is_cancelled(no_cancel: None) -> None:
    """A rank other than 0 waits in ``claim`` for world rank 0's round; cancellation ends that
    wait within one poll (it was bounded only by the startup deadline)."""
    from afd_core.session.rounds import claim_round

    closing = threading.Event()
    threading.Timer(0.5, closing.set).start()
    t0 = time.monotonic()
    with startup_cancel_scope(closing, "stopped"), pytest.raises(AFDCancelledError) as err:
        claim_round(
            dist.HashStore(), 1, time.monotonic() + 30.0, who="ffn 0", startup_timeout_s=30.0
        )
    assert err.value.stage == "claim"
    assert time.monotonic() - t0 < 5.0


def test_store_client_connects_once_its_server_appears(no_cancel: None) -> None:
    from afd_core.testing import free_port

    port = free_port()
    servers: list[dist.TCPStore] = []

    def serve() -> None:
        time.sleep(1.0)
        servers.append(dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False))

    server = threading.Thread(target=serve)
    server.start()
    client = open_tcp_store("127.0.0.1", port, is_master=False, timeout_s=30.0)
    client.set("k", "v")
    server.join(30)  # the server listens before its constructor returns
    assert servers[0].get("k") == b"v"
    assert client.timeout.total_seconds() == 30.0
