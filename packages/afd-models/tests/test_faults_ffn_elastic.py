"""Faults: elastic FFN ranks with replicated experts (``expert_replicas: 2`` over two FFN slots).

One Attention rank and two FFN slots on the tiny Qwen3-MoE, gate on Attention, every other
setting a user's default. With two replicas over two slots each FFN rank holds every routed
expert, so any one of them can serve alone, and with both up each computes half of the experts
(the contiguous routing of a plain 1:2). Under load (a streamed 400-token request each time),
without restarting the Attention role:

1. only FFN slot 0 runs (1:1); slot 1 starts and **joins** (1:2): its compute counters grow;
2. slot 1 is **SIGKILLed** mid-request and not restarted: the Attention role re-forms the
   round with slot 0 alone;
3. slot 1 is restarted and **rejoins**, and takes load again;
4. slot 0 is **removed** (SIGTERM): slot 1 serves alone (1:1).

Every request of every phase completes with HTTP 200 and the tokens of plain vLLM's greedy run
of the same prompt (plain runs first, alone; the uninterrupted 1:1 run is asserted equal to it;
the 1:2 routing adds two partial sums where one rank sums all experts, and on this model and
prompt set the greedy tokens are the same, asserted); the longest stall of each stream is
printed; every process exits 0 at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import served_model_id
from afd_models.demo.servers import stop_all, wait_until_healthy

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_bench_serve import bench_serve_command
from afd_models_ffn_loss import (
    FIRST_TOKEN_BOUND_S,
    GRACE_S,
    LONG_TOKENS,
    afd_series,
    ffn_compute_calls,
    hold_metric,
    references,
    restart,
    stream_complete,
    tiny_qwen3_deployment,
    tiny_qwen3_plain,
    tokens,
    wait_health,
)

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

BENCH_PROMPTS = 32
#: Bound on vLLM's bench client reaching its main run (it imports vLLM and sends a test prompt).
BENCH_START_BOUND_S = 180.0
RESULT_PATH = Path(__file__).parents[1] / "benchmarks" / "results" / "elastic.json"


def _member(attention: object, slot: int) -> float:
    return afd_series(attention, "afd_ffn_member", role="attention", rank="0", ffn_rank=str(slot))


def _wait_members(attention: object, want: tuple[int, ...], bound_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        attention.check_alive()  # type: ignore[attr-defined]
        if [_member(attention, s) for s in (0, 1)] == [float(s in want) for s in (0, 1)]:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise AssertionError(f"the Attention role's FFN slots never became {want} in {bound_s:.0f}s")


@pytest.mark.timeout(2400)
def test_ffn_ranks_join_die_rejoin_and_leave_under_load_and_nothing_fails(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Plain vLLM's greedy tokens first (alone on the host), the reference of every phase.
    plain = tiny_qwen3_plain(tmp_path_factory, name="ffn-elastic-plain")
    plain.start()
    try:
        wait_until_healthy([plain])
        plain_reference, plain_long = references(plain, served_model_id(plain.base_url))
    finally:
        stop_all([plain], timeout_s=30.0)
    attention, (slot0, slot1) = tiny_qwen3_deployment(
        tmp_path_factory,
        prefix="ffn-elastic",
        num_ffn_ranks=2,
        gate_on_attention=True,
        afd_extra={"expert_replicas": 2},
    )
    started = [slot0, attention]
    slot0.start()
    attention.start()
    phases: dict[str, dict[str, object]] = {}
    try:
        wait_until_healthy([slot0, attention])
        _wait_members(attention, (0,), 30.0)
        model = served_model_id(attention.base_url)
        reference, long_reference = references(attention, model)
        assert (reference, long_reference) == (plain_reference, plain_long)

        from afd_models.demo.tiny import DEMO_PROMPTS

        bench_dir = tmp_path_factory.mktemp("elastic-bench")

        def _start_bench(name: str) -> tuple[subprocess.Popen[bytes], Path]:
            result = bench_dir / f"{name}.json"
            log = open(bench_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
            cmd = bench_serve_command(
                attention.base_url,
                model,
                Path(model),
                bench_dir,
                result.name,
                num_prompts=BENCH_PROMPTS,
                concurrency=2,
                input_len=32,
                output_len=128,
                percentiles="50,99,100",
            )
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            # The client imports vLLM and sends one test prompt before its run: wait for the run.
            deadline = time.monotonic() + BENCH_START_BOUND_S
            text = ""
            while "Starting main benchmark run" not in text:
                assert proc.poll() is None, text[-3000:]
                assert time.monotonic() < deadline, f"{name}: bench serve never started\n{text}"
                time.sleep(0.2)
                text = (bench_dir / f"{name}.log").read_text(errors="replace")
            return proc, result

        def _finish_bench(name: str, proc: subprocess.Popen[bytes], path: Path) -> dict:
            assert proc.wait(600) == 0, (bench_dir / f"{name}.log").read_text()[-3000:]
            res = json.loads(path.read_text())
            assert res["failed"] == 0 and res["completed"] == BENCH_PROMPTS, res.get("errors")
            return {
                "completed": res["completed"],
                "failed": res["failed"],
                "max_itl_ms": round(res.get("p100_itl_ms", 0.0), 1),
                "median_tpot_ms": round(res.get("median_tpot_ms", 0.0), 1),
            }

        def run_phase(
            name: str, fault: object, want: tuple[int, ...], bound_s: float, bench: bool = False
        ) -> None:
            """Streamed long requests back to back (load); ``fault()`` while the first
            generates; the load goes on until the Attention role serves with the FFN slots
            ``want`` and one more request completed; every request must complete with the
            reference tokens. ``bench``: vLLM's ``bench serve`` runs beside it from before the
            fault and must report no failed request."""
            stop = threading.Event()
            results: list[dict[str, object]] = []

            first = threading.Event()

            def load() -> None:
                while True:
                    t0 = time.monotonic()
                    try:
                        got = stream_complete(
                            attention.base_url,
                            DEMO_PROMPTS[0],
                            model=model,
                            max_tokens=LONG_TOKENS,
                            first=first,
                        )
                    except Exception as err:  # counted as failed below
                        got = {"status": -1, "errors": [repr(err)], "token_ids": ()}
                    got["took_s"] = time.monotonic() - t0
                    results.append(got)
                    if stop.is_set():
                        return

            client = _start_bench(name) if bench else None
            thread = threading.Thread(target=load)
            thread.start()
            assert first.wait(FIRST_TOKEN_BOUND_S), f"{name}: no token of the first request"
            assert not results, f"{name}: the first request ended before the fault: {results}"
            fault()  # type: ignore[operator]
            _wait_members(attention, want, bound_s)
            stop.set()
            thread.join(GRACE_S + 180)
            assert not thread.is_alive(), f"{name}: the load did not end"
            bench_result = None if client is None else _finish_bench(name, *client)
            failed = [r for r in results if r["status"] != 200 or r["errors"]]
            assert not failed, (name, failed)
            assert all(r["token_ids"] == long_reference for r in results), name
            phases[name] = {
                "sent": len(results),
                "completed": len(results) - len(failed),
                "failed": len(failed),
                "longest_stall_s": round(max(float(r["max_gap_s"]) for r in results), 2),
            }
            if bench_result is not None:
                phases[name]["vllm_bench_serve"] = bench_result
            print(f"{name}: {phases[name]}")

        # 1. Slot 1 joins a running 1:1 pair (1:1 -> 1:2).
        run_phase("join", lambda: (slot1.start(), started.append(slot1)), (0, 1), 240.0)
        wait_until_healthy([slot1])
        before = ffn_compute_calls(slot1, 1)
        assert tokens(attention, model) == reference
        assert ffn_compute_calls(slot1, 1) > before, "the joined FFN slot computed nothing"

        # 2. Slot 1 dies mid-request and stays down: slot 0 serves alone (1:2 -> 1:1).
        run_phase("loss", slot1.kill, (0,), 60.0, bench=True)
        assert tokens(attention, model) == reference

        # 3. Slot 1 comes back and rejoins (1:1 -> 1:2), and takes load again.
        again: list[object] = []
        run_phase("rejoin", lambda: again.append(restart(slot1, 1)), (0, 1), 240.0)
        restarted = again[0]
        started.append(restarted)  # type: ignore[arg-type]
        wait_until_healthy([restarted])  # type: ignore[list-item]
        assert tokens(attention, model) == reference
        assert ffn_compute_calls(restarted, 1) > 0, "the rejoined FFN slot computed nothing"

        # 4. Slot 0 leaves (SIGTERM): the restarted slot 1 serves alone (1:2 -> 1:1).
        def remove_slot0() -> None:
            (res,) = stop_all([slot0], timeout_s=30.0)
            assert res.exit_code == 0 and not res.forced, res

        run_phase("leave", remove_slot0, (1,), 60.0)
        assert tokens(attention, model) == reference
        wait_health(attention, 200, 30.0)
        assert hold_metric(attention, "afd_ffn_loss_failed_requests_total") == 0
        print(f"elastic FFN phases: {phases}")
        RESULT_PATH.write_text(
            json.dumps(
                {
                    "setup": "tiny qwen3_moe float32, 1 Attention : 2 FFN slots, "
                    "expert_replicas 2, gate on Attention, defaults otherwise; 2-core host",
                    "load": f"streamed {LONG_TOKENS}-token greedy requests back to back; "
                    f"loss phase: also vllm bench serve ({BENCH_PROMPTS} prompts, concurrency 2)",
                    "phases": phases,
                },
                indent=2,
            )
            + "\n"
        )

        results = stop_all([attention, restarted], timeout_s=30.0)
        for res in results:
            assert res.exit_code == 0 and not res.forced, res
    finally:
        stop_all([*reversed(started)], timeout_s=30.0)
