"""E2E: checkpoints as published — AFD serves what plain vLLM serves, token for token.

Each checkpoint is a published model's ``config.json`` with only its sizes scaled down and
seeded random weights under the published tensor names (:mod:`afd_models.demo.published`; where
each config came from: ``afd_models/demo/published/SOURCES.md``). Per case one plain ``vllm
serve`` baseline (one per checkpoint and engine mode, computed once) and one AFD deployment
(module-scoped, one at a time); greedy tokens of every demo prompt must equal plain vLLM's, and
every role must stop cleanly on SIGTERM.

* DeepSeek-V3 with its MTP layer's weights (the FFN role serves the MTP layer's experts beside
  the target's; the Attention role, not drafting, never sends them). Without them:
  ``test_e2e_models_parity.py``'s ``deepseek_v3`` cases.
* DeepSeek-V3 and Kimi-K2 are published in FP8; their published BF16 conversions drop the
  ``quantization_config`` (``dequantized``); the FP8 configs themselves are refused before any
  engine starts (``test_models_checkpoint_support.py``).
* Qwen3-30B-A3B (and Qwen3-235B-A22B, the same checkpoint once scaled) and DeepSeek-V2-Lite-Chat
  are the ``qwen3_moe`` and ``deepseek_v2`` checkpoints of ``test_e2e_models_parity.py``, which
  serves them in every topology; here only Qwen3-30B-A3B's compiled case.
* GLM-4.5's architecture (``Glm4MoeForCausalLM``; the config is GLM-4.7's, the same
  architecture and sizes): both gate placements and expert parallel.
* Compiled mode: the Qwen3-30B-A3B 1:1 case also runs without ``--enforce-eager`` (vLLM's
  default), against plain vLLM compiled.

DeepSeek-architecture servers run one sequence at a time with the ``CPU_MLA`` backend
(:func:`afd_models.demo.servers.parity_options`: vLLM 0.32's CPU MLA path is not batch
invariant). Engines log to ``$AFD_E2E_LOG_DIR`` (default: pytest's tmp dir).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import BatchResult, complete_many
from afd_models.demo.parity import compare_parity
from afd_models.demo.published import PublishedSpec, ensure_published_checkpoint
from afd_models.demo.servers import (
    EngineOptions,
    VLLMServer,
    afd_servers,
    parity_options,
    plain_server,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_TOKENS = 12
EAGER = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512)
COMPILED = replace(EAGER, enforce_eager=False)

V3 = PublishedSpec("deepseek-v3", dequantized=True)
KIMI_K2 = PublishedSpec("kimi-k2-instruct", dequantized=True)
QWEN3_30B = PublishedSpec("qwen3-30b-a3b")
GLM = PublishedSpec("glm-4.7")


@dataclass(frozen=True)
class Case:
    spec: PublishedSpec
    num_attention_ranks: int
    gate_on_attention: bool
    num_ffn_ranks: int = 1
    compiled: bool = False

    @property
    def id(self) -> str:
        gate = "gate_attn" if self.gate_on_attention else "gate_ffn"
        mode = "-compiled" if self.compiled else ""
        return f"{self.spec.name}-{self.num_attention_ranks}A{self.num_ffn_ranks}F-{gate}{mode}"


#: Per checkpoint: 1:1 and expert parallel 1:2 (which needs the gate on Attention); GLM both
#: gate placements at 1:1. DeepSeek-V3 without its MTP weights, DeepSeek-V2-Lite-Chat and
#: Qwen3-30B-A3B in every topology: test_e2e_models_parity.py.
CASES = [
    Case(V3, 1, True),
    Case(V3, 1, True, 2),
    Case(KIMI_K2, 1, False),
    Case(KIMI_K2, 1, True, 2),
    Case(QWEN3_30B, 1, False, compiled=True),
    Case(GLM, 1, False),
    Case(GLM, 1, True),
    Case(GLM, 1, True, 2),
]


def _log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("AFD_E2E_LOG_DIR")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "engine-logs"


def _checkpoint(spec: PublishedSpec, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.getbasetemp() / "published"
    return ensure_published_checkpoint(spec, root)


def _options(checkpoint: Path, compiled: bool) -> EngineOptions:
    return parity_options(checkpoint, COMPILED if compiled else EAGER)


def _run(server: VLLMServer) -> BatchResult:
    return complete_many(server.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3)


_BASELINES: dict[tuple[str, bool], BatchResult] = {}


def _baseline(case: Case, checkpoint: Path, log_dir: Path) -> BatchResult:
    key = (case.spec.name, case.compiled)
    if key not in _BASELINES:
        mode = "-compiled" if case.compiled else ""
        server = plain_server(
            checkpoint,
            log_dir=log_dir,
            options=_options(checkpoint, case.compiled),
            name=f"plain-{case.spec.name}{mode}",
            progress=print,
        )
        server.start()
        try:
            wait_until_healthy([server])
            _BASELINES[key] = _run(server)
        finally:
            server.stop()
    return _BASELINES[key]


@dataclass
class Deployment:
    case: Case
    attention: VLLMServer
    ffns: tuple[VLLMServer, ...]
    expected: BatchResult
    actual: BatchResult


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    case: Case = request.param
    checkpoint = _checkpoint(case.spec, tmp_path_factory)
    log_dir = _log_root(tmp_path_factory)
    expected = _baseline(case, checkpoint, log_dir)  # plain first, never beside the pair
    attention, ffns = afd_servers(
        checkpoint,
        log_dir=log_dir,
        options=_options(checkpoint, case.compiled),
        num_attention_ranks=case.num_attention_ranks,
        num_ffn_ranks=case.num_ffn_ranks,
        gate_on_attention=case.gate_on_attention,
        prefix=case.id,
        progress=print,
    )
    for ffn in ffns:
        ffn.start()
    attention.start()
    try:
        wait_until_healthy([*ffns, attention])
        yield Deployment(case, attention, ffns, expected, _run(attention))
    finally:
        stop_all([attention, *ffns])


@pytest.mark.timeout(1800)
def test_greedy_tokens_equal_plain_vllm_and_roles_stop_cleanly(deployment: Deployment) -> None:
    assert all(len(c.token_ids) == MAX_TOKENS for c in deployment.expected.completions)
    parity = compare_parity(deployment.expected.completions, deployment.actual.completions)
    assert parity.ok, parity.describe()
    servers = [deployment.attention, *deployment.ffns]
    for server, result in zip(servers, stop_all(servers, timeout_s=60.0), strict=True):
        assert result.exit_code == 0 and not result.forced, (result, server.log_tail(60))
