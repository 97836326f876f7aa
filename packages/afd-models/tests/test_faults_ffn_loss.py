"""Faults: the FFN role dies while the Attention role serves, then comes back.

One AFD pair (tiny Qwen3-MoE, 1:1, float32, eager), started once with the default
``ffn_loss_grace_s`` (60 s): requests are held while the FFN role is away and resume when it is
back.

1. reference tokens (plain-run outputs of this same pair) for the demo prompts and a long one;
2. the FFN role's process session is SIGKILLed while the long request is being generated, and a
   second request arrives while it is down: ``/health`` answers 503, nothing fails; a new FFN
   server (same arguments) starts within the grace, the Attention role reconnects by itself and
   **both requests complete with HTTP 200 and the reference tokens** (recomputed after a
   preemption: the stall is printed);
3. the FFN role is SIGKILLed while the pair is idle: ``/health`` turns 503 within the heartbeat
   bound (no request needed to notice), and a restarted FFN serves the reference tokens;
4. the FFN role is SIGKILLed and stays down past the grace: a request sent once the loss is
   known fails with HTTP 500 naming the FFN role and ``ffn_loss_grace_s`` **at the grace, not
   before**; a request after that fails at once; a restarted FFN serves the reference tokens;
5. both roles stop on SIGTERM with exit code 0.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import complete, served_model_id
from afd_models.demo.servers import stop_all, wait_until_healthy
from afd_models.demo.tiny import DEMO_PROMPTS

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_ffn_loss import (
    GRACE_S,
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


@pytest.mark.timeout(1800)
def test_ffn_loss_holds_requests_resumes_them_and_fails_them_past_the_grace(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    attention, (ffn,) = tiny_qwen3_deployment(
        tmp_path_factory,
        prefix="ffn-loss",
        num_ffn_ranks=1,
        gate_on_attention=False,
        afd_extra={"timeout_s": TIMEOUT_S},
    )
    ffns = [ffn]
    ffn.start()
    attention.start()
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
        time.sleep(2.0)
        assert long_thread.is_alive() and late_thread.is_alive(), (long_out, late_out)
        assert attention.poll() is None, "the Attention server exited"
        # /metrics shows the hold: one episode, both requests held (nothing failed).
        assert hold_metric(attention, "afd_ffn_loss_holds_total") == 1
        assert hold_metric(attention, "afd_held_requests") == 2
        assert hold_metric(attention, "afd_ffn_loss_failed_requests_total") == 0
        ffn = restart(ffns[0], 1)
        ffns.append(ffn)
        wait_until_healthy([ffn])
        assert time.monotonic() - killed_at < GRACE_S, "the FFN restart took longer than the grace"
        wait_health(attention, 200, 120.0)
        long_thread.join(120)
        late_thread.join(120)
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
        wait_health(attention, 200, 120.0)
        assert tokens(attention, model) == reference
        assert "reconnected to its FFN role" in attention.log_text()

        # -- 4. the FFN stays down past the grace: 500 at the grace, not before ----------------
        ffn.kill()
        wait_health(attention, 503, IDLE_DETECT_BOUND_S)
        status, body, took = post(attention.base_url, model, DEMO_PROMPTS[2], 8)
        assert status == 500 and UNAVAILABLE in body and "ffn_loss_grace_s" in body, body
        assert GRACE_S - 1.0 <= took < GRACE_S + TIMEOUT_S, f"failed after {took:.1f}s"
        status, body, took = post(attention.base_url, model, DEMO_PROMPTS[1], 8)
        assert status == 500 and UNAVAILABLE in body, body
        assert took < 5.0, f"a request past the grace took {took:.1f}s"
        assert attention.poll() is None, "the Attention server exited"
        assert hold_metric(attention, "afd_ffn_loss_holds_total") == 2
        assert hold_metric(attention, "afd_ffn_loss_failed_requests_total") == 2
        ffn = restart(ffns[0], 3)
        ffns.append(ffn)
        wait_until_healthy([ffn])
        wait_health(attention, 200, 120.0)
        assert tokens(attention, model) == reference

        # -- 5. both roles stop cleanly ---------------------------------------------------
        results = stop_all([attention, ffn], timeout_s=30.0)
        for res in results:
            assert res.exit_code == 0 and not res.forced, res
    finally:
        stop_all([attention, *reversed(ffns)], timeout_s=30.0)
