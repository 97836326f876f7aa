"""The ``vllm bench serve`` command the load and fault tests run (vLLM's own client)."""

from __future__ import annotations

import sys
from pathlib import Path


def bench_serve_command(
    base_url: str,
    model_id: str,
    tokenizer: Path,
    result_dir: Path,
    result_file: str,
    *,
    num_prompts: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    percentiles: str = "50,90,99",
) -> list[str]:
    """``vllm bench serve`` (through :mod:`afd_models.vllm_cli`): random dataset, greedy, EOS
    ignored, ``num_prompts`` requests with ``concurrency`` in flight; the result JSON (with each
    request's details) goes to ``result_dir / result_file``."""
    return [
        sys.executable,
        "-m",
        "afd_models.vllm_cli",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model_id,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        percentiles,
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_file,
    ]
