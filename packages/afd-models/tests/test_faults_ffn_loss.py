"""Faults: the FFN role dies while the Attention role serves, then comes back.

Two AFD pairs (tiny Qwen3-MoE, 1:1, float32, eager). No test assumes how fast an engine
restarts: the first pair's ``ffn_loss_grace_s`` (:data:`HOLD_GRACE_S`) bounds the restart
generously (held requests resume as soon as the FFN is back), and the second pair's short grace
(:data:`SHORT_GRACE_S`) is the one a test waits out.

First pair, requests held while the FFN role is away and resumed when it is back:

1. reference tokens (plain-run outputs of this same pair) for the demo prompts and a long one;
2. the FFN role's process session is SIGKILLed while the long request is being generated (its
   first token streamed), and a second request arrives while it is down: ``/health`` answers
   503, ``/metrics`` shows both requests held, nothing fails; a new FFN server (same arguments)
   starts, the Attention role reconnects by itself and **both requests complete with HTTP 200 and
   the reference tokens** (recomputed after a preemption: the stall is printed);
3. the FFN role is SIGKILLed while the pair is idle: ``/health`` turns 503 within the heartbeat
   bound (no request needed to notice), and a restarted FFN serves the reference tokens;
4. both roles stop on SIGTERM with exit code 0.

Second pair, the FFN role SIGKILLed and kept down past the grace: a request sent once the loss
is known fails with HTTP 500 naming the FFN role and ``ffn_loss_grace_s`` **at the grace, not
before**; a request after that fails at once; a restarted FFN serves the reference tokens.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import complete, served_model_id
from afd_models.demo.servers import VLLMServer, stop_all, wait_until_healthy
from afd_models.demo.tiny import DEMO_PROMPTS

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_ffn_loss import (
    IDLE_DETECT_BOUND_S,
    TIMEOUT_S,
    UNAVAILABLE,
    hold_metric,
    in_thread,
    post,
    references,
    restart,
    start_long_request,
    tiny_qwen3_deployment,
    tokens,
    wait_health,
)

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

#: The first pair's grace: a bound on an FFN restart (engine starts took up to 194 s on a loaded
#: host), not an expectation: held requests resume as soon as the restarted FFN is back.
HOLD_GRACE_S = 600.0
#: The second pair's grace, waited out by its test.
SHORT_GRACE_S = 20.0
#: Bound on an FFN restart (see HOLD_GRACE_S) and on the Attention role's reconnection.
RESTART_BOUND_S = HOLD_GRACE_S


def _wait_held(attention: VLLMServer, count: int) -> None:
    """Poll the Attention role's ``afd_held_requests`` until it reads ``count``."""
    deadline = time.monotonic() + 60.0
    while hold_metric(attention, "afd_held_requests") != count:
        if time.monotonic() > deadline:
            raise AssertionError(f"afd_held_requests never read {count} within 60s")
        time.sleep(0.2)


def _start_pair(
    tmp_path_factory: pytest.TempPathFactory, prefix: str, grace_s: float
) -> tuple[VLLMServer, VLLMServer]:
    """A 1:1 pair (gate on FFN) whose Attention role holds requests for ``grace_s``; both roles
    started, not yet healthy."""
    attention, (ffn,) = tiny_qwen3_deployment(
        tmp_path_factory,
        prefix=prefix,
        num_ffn_ranks=1,
        gate_on_attention=False,
        afd_extra={"timeout_s": TIMEOUT_S, "ffn_loss_grace_s": grace_s},
    )
    ffn.start()
    attention.start()
    return attention, ffn


@pytest.mark.timeout(1800)
def test_ffn_loss_holds_requests_and_resumes_them(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    attention, ffn = _start_pair(tmp_path_factory, "ffn-loss", HOLD_GRACE_S)
    ffns = [ffn]
    try:
        wait_until_healthy([ffn, attention])
        model = served_model_id(attention.base_url)
        reference, long_reference = references(attention, model)

        # -- 2. the FFN dies mid-request: held, then resumed with the same tokens -------------
        long_thread, long_out = start_long_request(attention, model)
        ffn.kill()
        killed_at = time.monotonic()
        wait_health(attention, 503, TIMEOUT_S + 15.0)
        late_thread, late_out = in_thread(
            lambda: complete(attention.base_url, DEMO_PROMPTS[1], model=model, max_tokens=16)
        )
        # /metrics shows the hold: one episode, both requests held (nothing failed).
        _wait_held(attention, 2)
        assert long_thread.is_alive() and late_thread.is_alive(), (long_out, late_out)
        assert attention.poll() is None, "the Attention server exited"
        assert hold_metric(attention, "afd_ffn_loss_holds_total") == 1
        assert hold_metric(attention, "afd_ffn_loss_failed_requests_total") == 0
        ffn = restart(ffns[0], 1)
        ffns.append(ffn)
        wait_until_healthy([ffn])
        wait_health(attention, 200, RESTART_BOUND_S)
        long_thread.join(120)
        late_thread.join(120)
        assert not long_thread.is_alive() and not late_thread.is_alive(), (long_out, late_out)
        assert "error" not in long_out and "error" not in late_out, (long_out, late_out)
        assert long_out["value"].token_ids == long_reference
        assert late_out["value"].token_ids == reference[1]
        print(
            f"held across an FFN restart: resumed {long_out['done_at'] - killed_at:.1f}s after the kill"
        )
        assert tokens(attention, model) == reference

        # -- 3. the FFN dies while the pair is idle ---------------------------------------
        ffn.kill()
        took = wait_health(attention, 503, IDLE_DETECT_BOUND_S)
        print(f"idle FFN loss reported unhealthy after {took:.1f}s")
        ffn = restart(ffns[0], 2)
        ffns.append(ffn)
        wait_until_healthy([ffn])
        wait_health(attention, 200, RESTART_BOUND_S)
        assert tokens(attention, model) == reference
        assert "reconnected to its FFN role" in attention.log_text()

        # -- 4. both roles stop cleanly ---------------------------------------------------
        results = stop_all([attention, ffn], timeout_s=30.0)
        for res in results:
            assert res.exit_code == 0 and not res.forced, res
    finally:
        stop_all([attention, *reversed(ffns)], timeout_s=30.0)


@pytest.mark.timeout(1200)
def test_ffn_loss_past_the_grace_fails_held_requests_at_the_grace(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    attention, ffn = _start_pair(tmp_path_factory, "ffn-loss-grace", SHORT_GRACE_S)
    ffns = [ffn]
    try:
        wait_until_healthy([ffn, attention])
        model = served_model_id(attention.base_url)
        reference = tokens(attention, model)
        ffn.kill()
        wait_health(attention, 503, IDLE_DETECT_BOUND_S)
        status, body, took = post(attention.base_url, model, DEMO_PROMPTS[2], 8)
        assert status == 500 and UNAVAILABLE in body and "ffn_loss_grace_s" in body, body
        assert SHORT_GRACE_S - 1.0 <= took < SHORT_GRACE_S + TIMEOUT_S, f"failed after {took:.1f}s"
        status, body, took = post(attention.base_url, model, DEMO_PROMPTS[1], 8)
        assert status == 500 and UNAVAILABLE in body, body
        assert took < 5.0, f"a request past the grace took {took:.1f}s"
        assert attention.poll() is None, "the Attention server exited"
        assert hold_metric(attention, "afd_ffn_loss_holds_total") == 1
        assert hold_metric(attention, "afd_ffn_loss_failed_requests_total") == 2
        ffn = restart(ffns[0], 1)
        ffns.append(ffn)
        wait_until_healthy([ffn])
        wait_health(attention, 200, RESTART_BOUND_S)
        assert tokens(attention, model) == reference
    finally:
        stop_all([attention, *reversed(ffns)], timeout_s=30.0)
