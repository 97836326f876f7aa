"""FFN service loop <-> Attention ranks over afd-core's in-process connector (threads of this
process, no gloo: what is tested is the service, not the transport)."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_core.config import AFDConfig
from afd_core.errors import AFDModelError
from afd_core.testing import free_port
from afd_runtime.ffn_service import FFNService

sys.path.insert(0, str(Path(__file__).parent))
import afd_runtime_service_ranks as ranks


class _Ctx:
    """The ``multiprocessing`` context surface the tests use, with threads."""

    Queue = queue.Queue
    Barrier = threading.Barrier

    @staticmethod
    def Process(target: Callable[..., Any], args: tuple[Any, ...]) -> threading.Thread:
        return threading.Thread(target=target, args=args, daemon=True)


def _run(
    num_attention: int, mode: str | tuple[str, ...], expected_steps: int, sessions: int = 1
) -> dict[str, tuple[Any, Any]]:
    """One FFN rank and ``sessions`` Attention deployments one after the other; ``mode`` is
    every deployment's, or one per deployment."""
    modes = (mode,) * sessions if isinstance(mode, str) else mode
    ctx = _Ctx()
    q = ctx.Queue()
    port = free_port()
    ffn = ctx.Process(target=ranks.ffn_main, args=(port, num_attention, expected_steps, False, q))
    ffn.start()
    out = {}
    try:
        for s in range(sessions):
            barrier = ctx.Barrier(num_attention)
            procs = [
                ctx.Process(
                    target=ranks.attention_main,
                    args=(port, r, num_attention, modes[s], q, barrier, f"s{s}" if s else ""),
                )
                for r in range(num_attention)
            ]
            for p in procs:
                p.start()
            for p in procs:
                p.join(200)
        for _ in range(num_attention * sessions + 2):
            name, a, b = q.get(timeout=200)
            out[name] = (a, b)
        ffn.join(30)
    finally:
        assert not ffn.is_alive(), "the FFN service thread did not end"
    return out


@pytest.mark.timeout(240)
def test_service_batches_two_attention_ranks_per_layer() -> None:
    out = _run(2, "ok", expected_steps=3)
    assert out["attention0"] == (True, None)
    assert out["attention1"] == (True, None)
    # 3 steps, 2 layers: one compute call per layer per step over both ranks' tokens.
    tokens = sum(2 * n + 1 for n in ranks.STEPS) * len(ranks.LAYERS)
    counters = {"afd_steps_total": 3, "afd_connections_total": 1, "afd_refusals_total": 0}
    assert out["ffn"] == ((3, 3 * len(ranks.LAYERS), tokens, 1, 0, counters), None)
    # Every call ran inside its step's scope, entered once per step with the step's batch.
    steps = [(2 * n + 1, len(ranks.LAYERS)) for n in ranks.STEPS]
    assert out["ffn-steps"] == (steps, 0)


@pytest.mark.timeout(240)
def test_compute_error_reaches_attention_with_the_ffn_text() -> None:
    out = _run(1, "fail", expected_steps=99)
    ok, err = out["attention0"]
    assert ok is True
    assert err is not None and err.startswith("AFDPeerError: AFD world rank 1 failed")
    assert "ffn compute (layer 3)" in err
    assert "ValueError: planted failure at 13 tokens" in err
    stats, ffn_err = out["ffn"]
    assert stats[0] == 3
    assert ffn_err == "ValueError: planted failure at 13 tokens"


@pytest.mark.timeout(240)
def test_ffn_outlives_an_attention_restart() -> None:
    out = _run(1, "ok", expected_steps=6, sessions=2)
    assert out["attention0"] == (True, None)
    assert out["attention0s1"] == (True, None)
    steps, _calls, _tokens, deployments, _refusals, counters = out["ffn"][0]
    assert (steps, deployments) == (6, 2)
    assert (counters["afd_steps_total"], counters["afd_connections_total"]) == (6, 2)
    assert out["ffn"][1] is None


@pytest.mark.timeout(240)
def test_a_disagreeing_attention_is_refused_and_the_ffn_serves_the_next() -> None:
    """The Attention deployment that disagrees fails naming the field; the FFN refuses it
    without failing and then serves a matching deployment (issue #31 item 6)."""
    out = _run(1, ("disagree", "ok"), expected_steps=3, sessions=2)
    ok, err = out["attention0"]
    assert ok is False
    assert err is not None and err.startswith("AFDHandshakeError")
    assert "compute_gate_on_attention" in err
    assert out["attention0s1"] == (True, None)
    steps, _calls, _tokens, deployments, refusals, counters = out["ffn"][0]
    assert (steps, deployments) == (3, 1)
    assert refusals >= 1 and counters["afd_refusals_total"] == refusals
    assert out["ffn"][1] is None  # no service error: the FFN did not fail


def test_service_rejects_empty_layers() -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn"})
    with pytest.raises(AFDModelError, match="'layer_indices': got \\[\\]"):
        FFNService(cfg, 0, (), ranks.compute, lambda: ranks.connector(cfg, 0))


@pytest.mark.timeout(240)
def test_expert_parallel_service_two_to_two() -> None:
    """2 Attention : 2 FFN ranks, each FFN rank computing only its experts' share; the combined
    outputs are exact, and a step that routes nothing to FFN rank 1 skips its compute."""
    ctx = _Ctx()
    q = ctx.Queue()
    port = free_port()
    ffns = [ctx.Process(target=ranks.ep_ffn_main, args=(port, f, q)) for f in range(2)]
    barrier = ctx.Barrier(2)
    atts = [
        ctx.Process(target=ranks.ep_attention_main, args=(port, r, q, barrier)) for r in range(2)
    ]
    out = {}
    try:
        for p in (*ffns, *atts):
            p.start()
        for _ in range(4):
            name, a, b = q.get(timeout=200)
            out[name] = (a, b)
    finally:
        for p in (*ffns, *atts):
            p.join(30)
            assert not p.is_alive(), "a rank thread did not end"
    for r in range(2):
        ok, counts = out[f"attention{r}"][0]
        assert ok and out[f"attention{r}"][1] is None
        # Step 1 (layers 1 and 3) dispatches every token to FFN rank 0 only.
        n = ranks.EP_STEPS[1] + r
        assert counts[2:4] == [(n, 0), (n, 0)]
    for f in range(2):
        (steps, calls), err = out[f"ffn{f}"]
        assert err is None and steps == len(ranks.EP_STEPS)
        expected_calls = 3 * len(ranks.LAYERS) if f == 0 else 2 * len(ranks.LAYERS)
        assert len(calls) == expected_calls, calls
        assert [layer for layer, _ in calls] == [1, 3] * (len(calls) // 2)


@pytest.mark.timeout(240)
def test_input_ids_reach_the_ffn_compute_row_aligned() -> None:
    """Token ids (payload field ``input_ids``) travel with the hidden states from two Attention
    ranks over the connector; the FFN service hands the compute both ranks' ids batched in
    the same order as their rows (the compute's reply depends on each row's id)."""
    ctx = _Ctx()
    q = ctx.Queue()
    port = free_port()
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=ranks.ids_ffn_main, args=(port, q))] + [
        ctx.Process(target=ranks.ids_attention_main, args=(port, r, q, barrier)) for r in range(2)
    ]
    out = {}
    try:
        for p in procs:
            p.start()
        for _ in range(3):
            name, a, b = q.get(timeout=200)
            out[name] = (a, b)
    finally:
        for p in procs:
            p.join(30)
            assert not p.is_alive(), "a rank thread did not end"
    steps = len(ranks.STEPS) * len(ranks.LAYERS)
    assert out["attention0"] == (True, steps)
    assert out["attention1"] == (True, steps)
    calls, without = out["ffn"][0]
    assert out["ffn"][1] is None and without == 0
    assert calls == [(layer, 2 * n + 1) for n in ranks.STEPS for layer in ranks.LAYERS]


class _FailingBind:
    """A compute that binds to the connector's communicator (as Mega does) and cannot."""

    needs_bind = True
    collective = False

    def __init__(self) -> None:
        self.opened_before_bind: list[bool] = []

    def bind(self, connector: Any) -> None:
        self.opened_before_bind.append(not connector.is_initialized)  # not ready yet
        raise RuntimeError("planted bind failure")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no step runs unbound")


@pytest.mark.timeout(120)
def test_a_failed_bind_fails_the_ffn_and_reaches_attention_in_stage_bind() -> None:
    """The FFN service binds between the connector's open_groups() and confirm_ready(); a
    failure is published (stage ``bind``), so the Attention rank's start fails at once naming
    the FFN rank and the reason, and the FFN service fails (retrying could not help)."""
    from afd_core.errors import AFDStartupError

    port = free_port()
    compute = _FailingBind()
    cfg = ranks.config("ffn", port)
    svc = FFNService(cfg, 0, ranks.LAYERS, compute, lambda: ranks.connector(cfg, 0))
    attention = ranks.connector(ranks.config("attention", port), 0)
    svc.start()
    try:
        with pytest.raises(AFDStartupError) as err:
            attention.init()
        assert (err.value.rank, err.value.stage) == (1, "bind"), err.value
        assert "RuntimeError: planted bind failure" in str(err.value)
        assert svc.wait(30) and svc.failed
        assert compute.opened_before_bind == [True]
        with pytest.raises(Exception, match="planted bind failure"):
            svc.raise_if_failed()
    finally:
        svc.stop()
        attention.close()


@pytest.mark.timeout(240)
def test_draft_steps_run_only_the_draft_layers() -> None:
    """Speculative decoding over the P2P connector (receive-ahead on): the FFN service runs the
    target layers for ordinary steps and only the draft (MTP) layer for steps announced
    ``is_draft``, in the order the Attention rank sends them, with each step's own count."""
    ctx = _Ctx()
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=ranks.draft_ffn_main, args=(port, q)),
        ctx.Process(target=ranks.draft_attention_main, args=(port, q)),
    ]
    out = {}
    try:
        for p in procs:
            p.start()
        for _ in range(2):
            name, a, b = q.get(timeout=200)
            out[name] = (a, b)
    finally:
        for p in procs:
            p.join(30)
            assert not p.is_alive(), "a rank did not end"
    expected = [
        (layer, n)
        for n, draft in ranks.DRAFT_STEPS
        for layer in ((ranks.DRAFT_LAYER,) if draft else ranks.LAYERS)
    ]
    assert out["ffn"] == (expected, None)
    assert out["attention"] == (True, len(expected))


def test_draft_layers_must_be_served_layers() -> None:
    from afd_core.errors import AFDModelError
    from afd_runtime.ffn_service import FFNService

    cfg = ranks.config("ffn", free_port())
    with pytest.raises(AFDModelError) as info:
        FFNService(cfg, 0, (1, 3), lambda *a: a[1], lambda: None, draft_layer_indices=(4,))
    assert info.value.field == "draft_layer_indices"


@pytest.mark.timeout(240)
def test_an_idle_ffn_stopped_first_ends_its_service_thread_and_exits_zero() -> None:
    """The FFN rank stops while its Attention rank stays up (P2P, separate processes): its
    service thread, blocked in ``recv_control``, ends inside ``stop()`` (the Attention rank
    closes after the FFN's goodbye) without an error, the Attention link reports the FFN rank
    gone, and the FFN process exits 0. Before, the thread stayed blocked and the transport
    woke it while the interpreter finalized: ``terminate called``, exit code -6, seen in CI."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=ranks.leaving_ffn_main, args=(port, q)),
        ctx.Process(target=ranks.staying_attention_main, args=(port, q)),
    ]
    out = {}
    try:
        for p in procs:
            p.start()
        for _ in range(2):
            name, *rest = q.get(timeout=200)
            out[name] = rest
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    steps, ended, failed, stopped_in = out["ffn"]
    assert (steps, ended, failed) == (len(ranks.LEAVE_STEPS), True, False)
    assert stopped_in < 6.0  # about two heartbeats, not FFN_LEAVE_JOIN_S
    down, reconnecting, supervising_after_close = out["attention"][:3]
    assert down is not None and "goodbye" in down, down
    assert reconnecting is True and supervising_after_close is False
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.timeout(60)
def test_stop_ends_an_ffn_service_waiting_for_its_attention_role() -> None:
    """No Attention role ever comes: the FFN service thread waits in its connector's startup
    (a real store wait, P2P, 60 s bound). ``stop()`` cancels that wait and returns with the
    thread ended, without an error (before, it returned at once and left the thread waiting
    inside the store client until the process exited)."""
    cfg = ranks.config("ffn", free_port(), startup_timeout_s=60.0, connector="p2p")
    thread: list[int] = []

    def factory() -> Any:
        thread.append(threading.get_ident())  # the service thread builds its connectors
        return ranks.connector(cfg, 0)

    def in_rendezvous() -> bool:
        """The service thread is inside its connector's rendezvous (the store wait)."""
        frame = sys._current_frames().get(thread[0]) if thread else None
        while frame is not None:
            if frame.f_code.co_name == "_rendezvous":
                return True
            frame = frame.f_back
        return False

    svc = FFNService(cfg, 0, ranks.LAYERS, lambda *a: a[1], factory)
    svc.start()
    deadline = time.monotonic() + 30.0
    while not in_rendezvous():
        assert time.monotonic() < deadline, "the service thread never reached the store wait"
        time.sleep(0.01)
    t0 = time.monotonic()
    svc.stop()
    assert svc.wait(0.0), "stop() returned with the service thread still waiting"
    assert time.monotonic() - t0 < 4.0
    assert not svc.failed and svc.deployments == 0
