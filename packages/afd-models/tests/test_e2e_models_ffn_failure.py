"""E2E: when the FFN role dies, the Attention role fails requests instead of hanging.

One AFD pair (tiny Qwen3-MoE, 1:1): a request succeeds, the FFN role's whole process session is
SIGKILLed, then the next request must end with an error (an HTTP error, or the Attention server
going away) well before the request timeout; a request timeout counts as a hang and fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import (
    CompletionError,
    CompletionTimeoutError,
    complete,
    served_model_id,
)
from afd_models.demo.servers import EngineOptions, afd_servers, stop_all, wait_until_healthy
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

HANG_TIMEOUT_S = 240.0


@pytest.mark.timeout(1200)
def test_killed_ffn_role_fails_attention_requests(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    model = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root)
    log_env = os.environ.get("AFD_E2E_LOG_DIR")
    log_dir = Path(log_env) if log_env else tmp_path_factory.getbasetemp() / "engine-logs"
    attention, (ffn,) = afd_servers(
        model,
        log_dir=log_dir,
        options=EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512),
        num_attention_ranks=1,
        gate_on_attention=False,
        prefix="ffn-failure",
        progress=print,
    )
    ffn.start()
    attention.start()
    try:
        wait_until_healthy([ffn, attention])
        model_id = served_model_id(attention.base_url)
        ok = complete(attention.base_url, DEMO_PROMPTS[0], model=model_id, max_tokens=16)
        assert len(ok.token_ids) == 16

        ffn.kill()
        assert ffn.poll() is not None

        with pytest.raises(CompletionError) as err:
            complete(
                attention.base_url,
                DEMO_PROMPTS[1],
                model=model_id,
                max_tokens=16,
                timeout_s=HANG_TIMEOUT_S,
            )
        assert not isinstance(err.value, CompletionTimeoutError), "Attention role hung"
        print("attention error:", err.value)
    finally:
        print(stop_all([attention, ffn]))
