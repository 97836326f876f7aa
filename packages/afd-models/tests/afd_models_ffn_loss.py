"""Helpers of the FFN-loss fault tests (``test_faults_ffn_loss*.py``): requests, health polls,
a restarted FFN server, the Attention role's hold metrics."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import requests
from afd_models.demo.client import complete
from afd_models.demo.servers import EngineOptions, VLLMServer, afd_servers
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

TIMEOUT_S = 30.0  # the AFD config's timeout_s (every wait inside a step)
GRACE_S = 60.0  # AFDConfig.ffn_loss_grace_s's default (the deployment does not set it)
LONG_TOKENS = 400  # long enough to still be generating when the FFN dies
UNAVAILABLE = "AFD FFN role unavailable"
#: The Attention role notices an idle FFN's death by its heartbeat: 10 s without a beat
#: (afd_core.session.liveness.LIVENESS_TIMEOUT_S) plus a poll; generous for a loaded 2-core host.
IDLE_DETECT_BOUND_S = 40.0


def greedy(model: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body (EOS ignored: exactly ``max_tokens`` come)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }


def post(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, str, float]:
    payload = greedy(model, prompt, max_tokens)
    t0 = time.monotonic()
    resp = requests.post(f"{base_url}/v1/completions", json=payload, timeout=600)
    return resp.status_code, resp.text, time.monotonic() - t0


def health(server: VLLMServer) -> int:
    try:
        return int(requests.get(f"{server.base_url}/health", timeout=10).status_code)
    except requests.RequestException:
        return -1


def wait_health(server: VLLMServer, status: int, bound_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        server.check_alive()
        if health(server) == status:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise AssertionError(f"{server.name} /health never answered {status} within {bound_s:.0f}s")


def tokens(server: VLLMServer, model: str) -> list[tuple[int, ...]]:
    return [
        complete(server.base_url, p, model=model, max_tokens=16).token_ids for p in DEMO_PROMPTS
    ]


def restart(first: VLLMServer, n: int) -> VLLMServer:
    """A new server with ``first``'s command (the same FFN rank), logging to its own file."""
    log = first.config.log_path.with_name(f"{first.config.log_path.stem}-restart{n}.log")
    again = VLLMServer(dataclasses.replace(first.config, log_path=log), first._progress)
    again.start()
    return again


def hold_metric(server: VLLMServer, name: str) -> float:
    """An Attention rank 0 ``afd_*`` hold series from the server's ``/metrics`` (0 if absent)."""
    from afd_models.demo.servers import afd_samples

    key = (name, frozenset({("role", "attention"), ("rank", "0")}))
    return afd_samples(server.metrics_text()).get(key, 0.0)


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` on a thread; its result (or error) lands in the returned dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except Exception as err:
            out["error"] = err
        out["done_at"], out["took"] = time.monotonic(), time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def references(server: VLLMServer, model: str) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """What an uninterrupted run answers: the demo prompts' 16 tokens each, and the long
    prompt's :data:`LONG_TOKENS` (the request a fault interrupts)."""
    long_tokens = complete(
        server.base_url, DEMO_PROMPTS[0], model=model, max_tokens=LONG_TOKENS
    ).token_ids
    return tokens(server, model), long_tokens


#: Bound on the first streamed token of a request on an idle pair (a prefill and one step).
FIRST_TOKEN_BOUND_S = 60.0


def start_long_request(server: VLLMServer, model: str) -> tuple[threading.Thread, dict[str, Any]]:
    """The long prompt's request, streamed on a thread (see :func:`in_thread`; ``out["value"]``
    has ``token_ids``), returned once its first token arrived and it is still generating: a fault
    injected now lands mid-request, however fast decoding is."""
    first = threading.Event()

    def run() -> Any:
        got = stream_complete(
            server.base_url, DEMO_PROMPTS[0], model=model, max_tokens=LONG_TOKENS, first=first
        )
        assert got["status"] == 200 and not got["errors"], got
        return types.SimpleNamespace(**got)

    thread, out = in_thread(run)
    if not first.wait(FIRST_TOKEN_BOUND_S):
        raise AssertionError(f"no token of the long request within {FIRST_TOKEN_BOUND_S}s: {out}")
    assert thread.is_alive(), f"the long request ended before the fault: {out}"
    return thread, out


TINY_OPTIONS = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=1024)


def _tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny Qwen3-MoE checkpoint (from ``$AFD_TINY_CACHE``) and the engine log folder
    (``$AFD_E2E_LOG_DIR``; default: pytest's tmp dirs)."""
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    log_env = os.environ.get("AFD_E2E_LOG_DIR")
    log_dir = Path(log_env) if log_env else tmp_path_factory.getbasetemp() / "engine-logs"
    return ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root), log_dir


def tiny_qwen3_plain(tmp_path_factory: pytest.TempPathFactory, *, name: str) -> VLLMServer:
    """Plain ``vllm serve`` of the same checkpoint with the same options, not started."""
    from afd_models.demo.servers import plain_server

    checkpoint, log_dir = _tiny_qwen3(tmp_path_factory)
    return plain_server(checkpoint, log_dir=log_dir, options=TINY_OPTIONS, name=name)


def tiny_qwen3_deployment(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    prefix: str,
    num_ffn_ranks: int,
    gate_on_attention: bool,
    afd_extra: Mapping[str, Any] | None = None,
) -> tuple[VLLMServer, tuple[VLLMServer, ...]]:
    """One Attention rank and ``num_ffn_ranks`` FFN ranks on the tiny Qwen3-MoE (float32, eager),
    not started; checkpoint from ``$AFD_TINY_CACHE``, logs in ``$AFD_E2E_LOG_DIR`` (default:
    pytest's tmp dirs)."""
    checkpoint, log_dir = _tiny_qwen3(tmp_path_factory)
    return afd_servers(
        checkpoint,
        log_dir=log_dir,
        options=TINY_OPTIONS,
        num_attention_ranks=1,
        num_ffn_ranks=num_ffn_ranks,
        gate_on_attention=gate_on_attention,
        afd_extra=afd_extra,
        prefix=prefix,
        progress=print,
    )


def stream_complete(
    base_url: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int,
    first: threading.Event | None = None,
) -> dict[str, Any]:
    """A greedy streamed ``/v1/completions``: ``token_ids`` (all chunks'), ``status`` and
    ``max_gap_s``, the longest wait between two chunks (what a streaming client sees as a
    stall). ``first`` is set when the first token arrived."""
    import json

    payload = greedy(model, prompt, max_tokens, return_token_ids=True, stream=True)
    ids: list[int] = []
    errors: list[str] = []
    last = time.monotonic()
    max_gap = 0.0
    with requests.post(
        f"{base_url}/v1/completions", json=payload, stream=True, timeout=600
    ) as resp:
        status = resp.status_code
        for line in resp.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            max_gap, last = max(max_gap, now - last), now
            body = line[len(b"data: ") :]
            if body == b"[DONE]":
                break
            chunk = json.loads(body)
            if "error" in chunk:
                errors.append(str(chunk["error"]))
                continue
            for choice in chunk.get("choices", ()):
                ids.extend(int(i) for i in choice.get("token_ids") or ())
            if ids and first is not None:
                first.set()
    return {"status": status, "token_ids": tuple(ids), "max_gap_s": max_gap, "errors": errors}


def afd_series(server: VLLMServer, name: str, **labels: str) -> float:
    """One ``afd_*`` series of ``server``'s ``/metrics`` with exactly ``labels`` (0 if absent)."""
    from afd_models.demo.servers import afd_samples

    key = (name, frozenset(labels.items()))
    return afd_samples(server.metrics_text()).get(key, 0.0)


def ffn_compute_calls(server: VLLMServer, ffn_rank: int) -> float:
    """Compute calls an FFN server made, over its layers (``afd_ffn_compute_calls_total``)."""
    from afd_models.demo.servers import afd_samples

    want = {("role", "ffn"), ("rank", str(ffn_rank))}
    return sum(
        v
        for (name, labels), v in afd_samples(server.metrics_text()).items()
        if name == "afd_ffn_compute_calls_total" and want <= set(labels)
    )
