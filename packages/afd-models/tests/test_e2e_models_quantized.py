"""E2E: quantized experts on the FFN role (afd-compute-npu's Layered and Mega, reference backend).

Per family one scheme, served through the Attention role with ``ffn_compute: layered`` and (but
DeepSeek-V3, whose case is about routing: the correction bias on the quantized computes' router)
with ``ffn_compute: mega``. Each is checked on its own against an independent
float reference (the adapter's fp32 experts on the same routed rows, teacher-forced on the served
tokens: ``AFD_REPORT_QUANT_ERROR=1``): its worst relative layer error is within the documented
tolerance AND above a floor that only quantization explains, so a path that silently computed in
fp32 fails. (On CPU both run afd-compute-npu's reference backend: comparing Layered's tokens with
Mega's would compare the same math, so it is not asserted.) The FFN quantized its experts (expert
bytes against bf16 as the scheme implies) and Mega was bound to the communicator of the
connector's group of the FFN ranks. Exact parity with plain fp32 vLLM is not expected.

DeepSeek-V2 also serves Mega over two FFN ranks (``expert_dispatch: ffn``): the Attention rank
sends every token once, to FFN rank 0, and the two Megas dispatch and combine among themselves
(the reference's exchange over the FFN ranks' gloo group). Its tokens must equal the one-FFN-rank
Mega's (fp32: each rank's share is its slots' terms, their sum the one-rank sum), FFN rank 0's
error against the float reference (computed through the same exchange) must be within tolerance
and quantized, and FFN rank 1 must have received no tokens from the Attention role (its experts'
share went through the FFN ranks' group; afd-compute-npu's tests show the output differs without
it).

And: a Mega bind failure (injected with ``AFD_INJECT_FAULT=mega_bind``) makes the Attention role
exit non-zero at startup with the FFN's message (published in stage ``bind``), within its
startup timeout.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import complete_many
from afd_models.demo.run import QUANT_ERROR_TOLERANCE
from afd_models.demo.servers import (
    EngineOptions,
    ServerExitedError,
    afd_servers,
    parity_options,
    parse_ffn_stats,
    parse_quant_error,
    parse_quantized,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_TOKENS = 12
#: Far above fp32 rounding (~1e-7 relative), far below any 8-bit quantization error (~1e-3).
QUANTIZED_ERROR_FLOOR = 1e-5
OPTIONS = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512)
#: family -> (gate on Attention, FFN quantization, expert bytes / bf16 bytes, computes)
CASES = {
    "qwen3_moe": (False, {"expert_quant": "w8a8"}, 0.52, ("layered", "mega")),
    "deepseek_v2": (
        True,
        {"expert_quant": "w4a8", "expert_quant_group_size": 32},
        0.40,
        ("layered", "mega"),
    ),
    "deepseek_v3": (True, {"expert_quant": "w8a8"}, 0.52, ("layered",)),
}
#: The family whose case also serves Mega over two FFN ranks (gate on Attention: EP needs it).
MEGA_OVER_TWO = "deepseek_v2"


def _root(tmp_path_factory: pytest.TempPathFactory, env: str, name: str) -> Path:
    value = os.environ.get(env)
    return Path(value) if value else tmp_path_factory.getbasetemp() / name


def _serve(model: Path, family: str, compute: str, log_dir: Path, **kw: object) -> object:
    gate, quant, _, _ = CASES[family]
    attention, (ffn,) = afd_servers(
        model,
        log_dir=log_dir,
        options=parity_options(model, OPTIONS),
        num_attention_ranks=1,
        gate_on_attention=gate,
        ffn_extra={"ffn_compute": compute, **quant},
        prefix=f"quant-{family}-{compute}",
        progress=print,
        **kw,  # type: ignore[arg-type]
    )
    return attention, ffn


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("family", list(CASES))
def test_layered_and_mega_each_within_tolerance_of_the_float_reference_and_quantized(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model = ensure_tiny_checkpoint(
        TinySpec(family), _root(tmp_path_factory, "AFD_TINY_CACHE", "tiny")
    )
    log_dir = _root(tmp_path_factory, "AFD_E2E_LOG_DIR", "engine-logs")
    _gate, quant, ratio, computes = CASES[family]
    outputs = {}
    for compute in computes:
        attention, ffn = _serve(
            model, family, compute, log_dir, ffn_env={"AFD_REPORT_QUANT_ERROR": "1"}
        )
        ffn.start()  # type: ignore[attr-defined]
        attention.start()  # type: ignore[attr-defined]
        try:
            wait_until_healthy([ffn, attention])  # type: ignore[list-item]
            batch = complete_many(
                attention.base_url,
                DEMO_PROMPTS[:3],
                max_tokens=MAX_TOKENS,
                concurrency=1,  # type: ignore[attr-defined]
            )
            outputs[compute] = [c.token_ids for c in batch.completions]
            metrics = ffn.metrics_text()  # type: ignore[attr-defined]
        finally:
            print(stop_all([attention, ffn]))  # type: ignore[list-item]
        log = ffn.log_text()  # type: ignore[attr-defined]
        report = parse_quantized(metrics)[0]
        assert report.compute == compute
        assert abs(report.expert_bytes / report.bf16_bytes - ratio) < 0.02, report
        layer, calls, max_rel = parse_quant_error(metrics)[0]
        assert calls >= 1
        scheme = quant["expert_quant"]
        assert max_rel <= QUANT_ERROR_TOLERANCE[scheme], (compute, layer, max_rel)
        # 8- and 4-bit weights cannot reproduce fp32 experts: a zero (or fp32-rounding-sized)
        # error means this compute did not run quantized.
        assert max_rel > QUANTIZED_ERROR_FLOOR, (compute, layer, max_rel)
        if compute == "mega":
            assert re.search(r"Mega bound to \S+ \(group afd-p2p/\S+/ffn\)", log), log[-3000:]
    for compute in computes:
        assert all(len(t) == MAX_TOKENS for t in outputs[compute])
    if family == MEGA_OVER_TWO:
        _mega_over_two_ffn_ranks(model, log_dir, outputs["mega"])


def _mega_over_two_ffn_ranks(model: Path, log_dir: Path, one_rank: list[list[int]]) -> None:
    _gate, quant, _, _ = CASES[MEGA_OVER_TWO]
    attention, ffns = afd_servers(
        model,
        log_dir=log_dir,
        options=parity_options(model, OPTIONS),
        num_attention_ranks=1,
        num_ffn_ranks=2,
        gate_on_attention=True,
        afd_extra={"expert_dispatch": "ffn"},
        ffn_extra={"ffn_compute": "mega", **quant},
        ffn_env={"AFD_REPORT_QUANT_ERROR": "1"},
        prefix=f"quant-{MEGA_OVER_TWO}-mega-1a2f",
        progress=print,
    )
    servers = [*ffns, attention]
    for server in servers:
        server.start()
    try:
        wait_until_healthy(servers)
        batch = complete_many(
            attention.base_url, DEMO_PROMPTS[:3], max_tokens=MAX_TOKENS, concurrency=1
        )
        metrics = [f.metrics_text() for f in ffns]
        logs = [f.log_text() for f in ffns]
    finally:
        print(stop_all(servers))
    stats = [parse_ffn_stats(m)[rank] for rank, m in enumerate(metrics)]
    assert [c.token_ids for c in batch.completions] == one_rank
    # Its float reference goes through the same exchange: the whole output's error, quantized.
    _layer, calls, max_rel = parse_quant_error(metrics[0])[0]
    assert calls >= 1
    assert QUANTIZED_ERROR_FLOOR < max_rel <= QUANT_ERROR_TOLERANCE[quant["expert_quant"]], max_rel
    # Every token travelled once, to FFN rank 0; rank 1's share came through the FFN group.
    assert stats[0].tokens > 0 and stats[0].bytes > 0
    assert stats[1].tokens == 0 and stats[1].bytes == 0, stats[1]
    assert stats[1].steps == stats[0].steps > 0
    for rank, log in enumerate(logs):
        bound = rf"FFN rank {rank}: Mega bound to \S+/ffn \(group afd-p2p/\S+/ffn\)"
        assert re.search(bound, log), log[-3000:]


@pytest.mark.timeout(900)
def test_mega_bind_failure_fails_the_attention_role_at_startup(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = ensure_tiny_checkpoint(
        TinySpec("qwen3_moe"), _root(tmp_path_factory, "AFD_TINY_CACHE", "tiny")
    )
    startup_timeout_s = 120.0
    attention, ffn = _serve(
        model,
        "qwen3_moe",
        "mega",
        _root(tmp_path_factory, "AFD_E2E_LOG_DIR", "engine-logs"),
        ffn_env={"AFD_INJECT_FAULT": "mega_bind"},
        afd_extra={"startup_timeout_s": startup_timeout_s},
    )
    ffn.start()  # type: ignore[attr-defined]
    attention.start()  # type: ignore[attr-defined]
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerExitedError) as err:
            wait_until_healthy([attention])  # type: ignore[list-item]
        elapsed = time.monotonic() - t0
        assert err.value.name == attention.name  # type: ignore[attr-defined]
        assert attention.poll() not in (None, 0)  # type: ignore[attr-defined]
        # Engine start (~60 s here) plus at most the startup timeout, not vLLM's 600 s.
        assert elapsed < 90.0 + startup_timeout_s, elapsed
        text = attention.log_text()  # type: ignore[attr-defined]
        assert "'bind'" in text and "injected: AFD_INJECT_FAULT=mega_bind" in text
        # The bind failure is fatal on the FFN rank too: its engine core stops (vLLM's API server
        # then reports the engine dead: /health is no longer 200).
        ffn_log = ffn.log_text()  # type: ignore[attr-defined]
        assert "AFD FFN rank 0 service failed" in ffn_log and "AFDCommBindError" in ffn_log
        deadline = time.monotonic() + 60
        while ffn.healthy() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(1)
        assert not ffn.healthy()  # type: ignore[attr-defined]
    finally:
        print(stop_all([attention, ffn]))  # type: ignore[list-item]
