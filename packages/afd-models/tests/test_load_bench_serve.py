"""Load: vLLM's own benchmark client (``vllm bench serve``) against a 2:1 AFD pair.

One tiny Qwen3-MoE checkpoint, served three ways in turn (never two deployments at once):

1. plain ``vllm serve``: greedy outputs of :data:`PARITY_PROMPTS` (one request at a time), then
   stopped;
2. the AFD pair, two Attention ranks (``--data-parallel-size 2``) and one FFN rank:
   ``vllm bench serve`` (random dataset, :data:`NUM_PROMPTS` requests, :data:`CONCURRENCY` in
   flight, EOS ignored) must report zero failed requests; then the same parity prompts on the
   same pair must give exactly the plain tokens, and both roles must still be running.

Every engine gets the placement ``afd bench`` uses on a small shared host (one OpenMP thread,
passive waits), plain and AFD alike. The benchmark's throughput and TTFT/TPOT/ITL percentiles
and the test's wall times go to ``packages/afd-models/benchmarks/results/load.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.bench import PLACEMENT_ENV
from afd_models.demo.client import complete_many, served_model_id
from afd_models.demo.parity import compare_parity
from afd_models.demo.servers import (
    EngineOptions,
    afd_servers,
    plain_server,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import TinySpec, ensure_tiny_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_bench_serve import bench_serve_command

pytestmark = [pytest.mark.load, pytest.mark.vllm_runtime, pytest.mark.slow]

NUM_PROMPTS: Final[int] = 256
CONCURRENCY: Final[int] = 32
INPUT_LEN: Final[int] = 32
OUTPUT_LEN: Final[int] = 16
PARITY_MAX_TOKENS: Final[int] = 16
#: Generous bound on the benchmark client's run (client start-up included).
BENCH_TIMEOUT_S: Final[float] = 1800.0
PARITY_PROMPTS: Final[tuple[str, ...]] = (
    "The attention side keeps",
    "A mixture of experts",
    "Hello world! How are",
    "def add(a, b):",
    "Rivers, mountains and",
    "Numbers like 42 and",
    "Once upon a time",
    "The quick brown fox",
    "In the beginning the",
    "SELECT name FROM",
    "Weather today is",
    "import torch as",
    "Three plus four equals",
    "My favourite colour",
    "The capital city of",
    "for i in range(",
)
OPTIONS: Final[EngineOptions] = EngineOptions(
    dtype="float32", enforce_eager=True, max_model_len=512, env=dict(PLACEMENT_ENV)
)
RESULT_PATH: Final[Path] = Path(__file__).parents[1] / "benchmarks" / "results" / "load.json"
#: Keys of the benchmark's result JSON copied into ``load.json``.
REPORTED_KEYS: Final[tuple[str, ...]] = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p50", "p90", "p99")
    ),
)


def _log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("AFD_E2E_LOG_DIR")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "engine-logs"


@pytest.mark.timeout(3600)
def test_bench_serve_load_on_2to1_pair(tmp_path_factory: pytest.TempPathFactory) -> None:
    began = time.monotonic()
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    model = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root)
    log_dir = _log_dir(tmp_path_factory)

    plain = plain_server(model, log_dir=log_dir, options=OPTIONS, name="load-plain", progress=print)
    plain.start()
    try:
        wait_until_healthy([plain])
        expected = complete_many(
            plain.base_url, PARITY_PROMPTS, max_tokens=PARITY_MAX_TOKENS, concurrency=1
        )
    finally:
        plain.stop()

    attention, ffns = afd_servers(
        model,
        log_dir=log_dir,
        options=OPTIONS,
        num_attention_ranks=2,
        gate_on_attention=False,
        prefix="load",
        progress=print,
    )
    servers = [attention, *ffns]
    for server in reversed(servers):
        server.start()
    try:
        wait_until_healthy(servers)
        model_id = served_model_id(attention.base_url)
        result_dir = tmp_path_factory.mktemp("bench")
        bench_log = log_dir / "load-bench-serve.log"
        bench_began = time.monotonic()
        with open(bench_log, "wb") as log:
            proc = subprocess.run(
                bench_serve_command(
                    attention.base_url,
                    model_id,
                    model,
                    result_dir,
                    "load.json",
                    num_prompts=NUM_PROMPTS,
                    concurrency=CONCURRENCY,
                    input_len=INPUT_LEN,
                    output_len=OUTPUT_LEN,
                ),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **PLACEMENT_ENV},
                timeout=BENCH_TIMEOUT_S,
                check=False,
            )
        bench_wall_s = time.monotonic() - bench_began
        tail = "\n".join(bench_log.read_text(errors="replace").splitlines()[-40:])
        assert proc.returncode == 0, f"vllm bench serve exited {proc.returncode}:\n{tail}"
        result: dict[str, Any] = json.loads((result_dir / "load.json").read_text())
        errors = [e for e in result.get("errors", []) if e]
        assert result["failed"] == 0, f"{result['failed']} failed requests: {errors[:3]}"
        assert result["completed"] == NUM_PROMPTS
        assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN

        got = complete_many(
            attention.base_url, PARITY_PROMPTS, max_tokens=PARITY_MAX_TOKENS, concurrency=1
        )
        for server in servers:
            server.check_alive()
    finally:
        stops = stop_all(servers)
        print(stops)

    parity = compare_parity(expected.completions, got.completions)
    assert len(parity.prompts) == len(PARITY_PROMPTS)
    assert parity.ok, f"AFD 2:1 after load differs from plain vLLM:\n{parity.describe()}"

    record = {
        "setup": {
            "model": "tiny qwen3_moe (afd_models.demo.tiny, seed 0, float32)",
            "deployment": "AFD 2:1 (2 Attention ranks, --data-parallel-size 2; 1 FFN rank)",
            "client": "vllm bench serve --backend vllm --dataset-name random --ignore-eos",
            "num_prompts": NUM_PROMPTS,
            "max_concurrency": CONCURRENCY,
            "random_input_len": INPUT_LEN,
            "random_output_len": OUTPUT_LEN,
            "engine_env": dict(PLACEMENT_ENV),
            "host_cpus": os.cpu_count(),
        },
        "bench": {k: result[k] for k in REPORTED_KEYS if k in result},
        "bench_wall_s": round(bench_wall_s, 1),
        "test_wall_s": round(time.monotonic() - began, 1),
        "parity_prompts": len(PARITY_PROMPTS),
        "parity_identical": len(PARITY_PROMPTS) - len(parity.mismatches),
    }
    RESULT_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULT_PATH.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(json.dumps(record, indent=2))
