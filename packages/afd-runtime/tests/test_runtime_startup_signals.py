"""SIGTERM/SIGINT cancel startup waits (afd_runtime.signals), the FFN service stops on it, a
cancelled Attention init exits 0, fault injection (afd_runtime.faults), load-failure publication."""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from afd_core.config import AFDConfig
from afd_core.errors import AFDCancelledError, AFDConfigError, AFDTimeoutError
from afd_core.session.startup import clear_startup_cancel, startup_cancel_reason
from afd_core.testing import free_port
from afd_runtime.faults import FAULT_ENV, InjectedFaultError, fault_injected, raise_if_injected
from afd_runtime.signals import cancel_startup_on_signals, cancels_startup
from afd_runtime.workers.base import init_or_exit_on_signal, publish_load_failure

sys.path.insert(0, str(Path(__file__).parent))
import afd_runtime_service_ranks as ranks


@pytest.fixture
def handlers() -> Iterator[list[int]]:
    """Installs a recording SIGTERM handler (like vLLM's engine core) and Python's default SIGINT
    handler (a job runner or ``nohup`` may start pytest with SIGINT ignored, which
    ``cancel_startup_on_signals`` rightly leaves alone); restores everything."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    seen: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    clear_startup_cancel()
    try:
        yield seen
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        clear_startup_cancel()


def _deliver(sig: signal.Signals) -> None:
    signal.raise_signal(sig)
    time.sleep(0.05)  # the handler runs at the next bytecode boundary of the main thread


def test_sigterm_cancels_startup_and_still_runs_the_previous_handler(handlers: list[int]) -> None:
    assert cancel_startup_on_signals()
    assert cancels_startup(signal.SIGTERM) and cancels_startup(signal.SIGINT)
    _deliver(signal.SIGTERM)
    assert startup_cancel_reason() == "SIGTERM"
    assert handlers == [signal.SIGTERM]


def test_install_is_idempotent(handlers: list[int]) -> None:
    assert cancel_startup_on_signals()
    first = signal.getsignal(signal.SIGTERM)
    assert cancel_startup_on_signals()
    assert signal.getsignal(signal.SIGTERM) is first
    _deliver(signal.SIGTERM)
    assert handlers == [signal.SIGTERM]  # chained once, not twice


def test_ignored_signal_stays_ignored(handlers: list[int]) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert cancel_startup_on_signals([signal.SIGTERM])
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    _deliver(signal.SIGTERM)
    assert startup_cancel_reason() is None


def test_outside_the_main_thread_nothing_changes(handlers: list[int]) -> None:
    before = signal.getsignal(signal.SIGTERM)
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(cancel_startup_on_signals()))
    t.start()
    t.join()
    assert out == [False]
    assert signal.getsignal(signal.SIGTERM) is before


def test_default_action_is_kept_after_cancelling() -> None:
    code = (
        "import signal, sys\n"
        "from afd_runtime.signals import cancel_startup_on_signals\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "cancel_startup_on_signals()\n"
        "signal.raise_signal(signal.SIGTERM)\n"
        "sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGTERM


class _Connector:
    def __init__(self, err: BaseException | None) -> None:
        self.err = err

    def init(self) -> None:
        if self.err is not None:
            raise self.err


def test_cancelled_attention_init_exits_zero(handlers: list[int]) -> None:
    with pytest.raises(SystemExit) as exit_:
        init_or_exit_on_signal(_Connector(AFDCancelledError("handshake", "SIGTERM")), "rank 0")  # type: ignore[arg-type]
    assert exit_.value.code == 0
    assert isinstance(exit_.value.__cause__, AFDCancelledError)
    assert gc.get_freeze_count() > 0  # no final GC pass over the engine at exit
    gc.unfreeze()
    with pytest.raises(AFDTimeoutError):
        init_or_exit_on_signal(_Connector(AFDTimeoutError("t")), "rank 0")  # type: ignore[arg-type]
    init_or_exit_on_signal(_Connector(None), "rank 0")  # type: ignore[arg-type]
    assert cancels_startup(signal.SIGTERM)


@pytest.mark.timeout(120)
def test_ffn_service_waiting_for_attention_stops_on_sigterm_without_error() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=ranks.ffn_waiting_then_sigterm, args=(free_port(), q))
    proc.start()
    try:
        name, ended, (elapsed, failed, deployments) = q.get(timeout=90)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
    assert (name, ended, failed, deployments) == ("ffn", True, False, 0)
    assert elapsed < 5.0  # one connection probe (0.5 s), not the 60 s startup timeout


def test_fault_injection_names_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert not fault_injected("ffn_load")
    raise_if_injected("ffn_load", "x")  # not injected: nothing
    monkeypatch.setenv(FAULT_ENV, "ffn_load")
    assert fault_injected("ffn_load") and not fault_injected("mega_bind")
    with pytest.raises(
        InjectedFaultError, match=r"^load failed \(injected: AFD_INJECT_FAULT=ffn_load\)$"
    ):
        raise_if_injected("ffn_load", "load")
    monkeypatch.setenv(FAULT_ENV, "ffn_lod")
    with pytest.raises(AFDConfigError, match="'AFD_INJECT_FAULT': got 'ffn_lod'") as err:
        fault_injected("ffn_load")
    assert "'mega_bind'" in err.value.allowed
    with pytest.raises(AFDConfigError, match="'nope'"):
        fault_injected("nope")


def test_delay_injection_is_seeded_bounded_and_refuses_bad_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time as _time

    from afd_runtime.faults import DELAY_ENV, delay_injector

    monkeypatch.delenv(DELAY_ENV, raising=False)
    assert delay_injector("x") is None
    monkeypatch.setenv(DELAY_ENV, "3")
    slept: list[float] = []
    monkeypatch.setattr(_time, "sleep", slept.append)
    first, second = delay_injector("ffn-0"), delay_injector("ffn-0")
    assert first is not None and second is not None
    for _ in range(50):
        first()
        second()
    assert slept[0::2] == slept[1::2]  # the same seed, the same delays
    assert all(0.0 <= d <= 0.003 for d in slept) and len(set(slept)) > 1
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv(DELAY_ENV, bad)
        with pytest.raises(AFDConfigError, match=f"'AFD_INJECT_DELAY_MS': got '{bad}'"):
            delay_injector("x")


def test_load_failure_publication_is_bounded_without_an_attention_role() -> None:
    cfg = AFDConfig.from_mapping(
        {"role": "ffn", "port": free_port(), "startup_timeout_s": 1.5, "timeout_s": 1.5}
    )
    t0 = time.monotonic()
    assert publish_load_failure(cfg, 0, OSError("bad weights")) is False
    assert time.monotonic() - t0 < 10.0


def test_a_sigterm_taken_by_another_thread_reaches_the_main_thread() -> None:
    """The main thread blocks in a zmq poll (as vLLM's API server does while its engine cores
    start); SIGTERM is sent to another thread, so the poll is not interrupted: the forwarder
    re-sends it to the main thread, whose handler then runs within the grace."""
    pytest.importorskip("zmq")
    code = r"""
import os, signal, sys, threading, time
import zmq
from afd_runtime.signals import termination_reaches_main_thread

def interrupt(*_):
    raise KeyboardInterrupt("terminated")

signal.signal(signal.SIGTERM, interrupt)
sock = zmq.Context().socket(zmq.PULL)
sock.bind("tcp://127.0.0.1:*")
other = threading.Thread(target=lambda: time.sleep(30), daemon=True)
other.start()
t0 = time.monotonic()
try:
    with termination_reaches_main_thread() as fwd:
        threading.Timer(0.5, signal.pthread_kill, (other.ident, signal.SIGTERM)).start()
        sock.poll(timeout=20000)
        print("not interrupted", flush=True)
        sys.exit(3)
except KeyboardInterrupt:
    print(f"interrupted {time.monotonic() - t0:.2f} forwarded={fwd.forwarded} handled={fwd.handled}")
    assert signal.getsignal(signal.SIGTERM) is interrupt
    sys.exit(0)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("interrupted") and "forwarded=[15]" in line, line
    assert float(line.split()[1]) < 5.0, line
