"""E2E: greedy outputs through the AFD Attention role equal plain ``vllm serve`` token for token.

Engines are expensive (30-90 s each on a small CPU box), so servers are shared: one plain
baseline per model family and Attention TP size (its outputs computed once per session) and one
AFD deployment per case (module-scoped, parametrized): cases with one FFN rank (two servers
each), expert-parallel cases with two FFN ranks (three servers each), two-stage cases
(``num_stages=2``) and tensor-parallel Attention cases (``attention_tp_size=2``, against plain
vLLM at ``--tensor-parallel-size 2``). One deployment runs at a time.

Two stages (``num_stages=2``): the Attention role splits every step with two or more requests
at a request boundary and overlaps the stages; greedy tokens must equal plain vLLM (and so the
one-stage case of the same topology, which equals plain vLLM too). The 2:1 case runs with random
delays injected on both roles (``AFD_INJECT_DELAY_MS``: before every FFN (layer, stage) and every
stage turn). DeepSeek-V2 runs its two-stage case with ``--max-num-seqs 2``: every split stage
then holds one sequence, the batch plain vLLM's CPU MLA path is exact for (see below).
Each engine logs to ``$AFD_E2E_LOG_DIR`` (default: pytest's tmp dir).

Expert parallel (two FFN ranks): the combined routed output is ``partial_0 + partial_1`` where
plain vLLM's kernel sums a token's top-k in one pass, so a token served by both ranks may differ
by an ulp before the residual add; the tests still require identical greedy tokens (none has
differed on these checkpoints; if one ever does, report the logprob gap and set a tolerance here
rather than hide it).

Every family serves a published model's ``config.json`` with only its sizes scaled
(:mod:`afd_models.demo.published`; sources in ``afd_models/demo/published/SOURCES.md``):

* ``qwen3_moe``: Qwen3-30B-A3B (and so Qwen3-235B-A22B, the same checkpoint once scaled).
* ``deepseek_v2``: DeepSeek-V2-Lite-Chat as transformers 5 saves it (``q_lora_rank: null``,
  yarn with ``mscale``, greedy softmax top-6 routing, ``auto_map`` kept).
* ``deepseek_v3``: DeepSeek-V3 (yarn rope scaling, 16 experts in 8 groups: top-8 of the best 4
  groups), one MTP layer declared and none of its weights shipped (the 2:1 case with the gate on
  Attention is the one whose FFN role used to die at load on that layer's routing bias).

``test_e2e_models_published.py`` covers the other published configs (Kimi-K2, GLM, DeepSeek-V3
with its MTP weights) and the compiled mode.

DeepSeek-V2/V3 servers (plain and AFD alike) run with ``--max-num-seqs 1``: vLLM 0.32's CPU MLA path
is not batch invariant (plain vLLM against itself gives a request different greedy tokens when it
shares a batch with other requests), so token parity is only defined one sequence at a time. The
client still sends those requests concurrently; Qwen3-MoE is served with real batches.
"""

from __future__ import annotations

import os
import time
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
    split_every_step,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_TOKENS = 16
#: Each family's checkpoint (see the module docstring). DeepSeek-V3's FP8 ``quantization_config``
#: is dropped as its BF16 conversions ship it; it declares one MTP layer whose weights it does not
#: ship, as transformers and many derivatives save it.
CHECKPOINTS = {
    "qwen3_moe": PublishedSpec("qwen3-30b-a3b"),
    "deepseek_v2": PublishedSpec("deepseek-v2-lite-chat"),
    "deepseek_v3": PublishedSpec("deepseek-v3", dequantized=True, draft_weights=False),
}
OPTIONS = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512)


@dataclass(frozen=True)
class Case:
    family: str
    num_attention_ranks: int
    gate_on_attention: bool
    num_ffn_ranks: int = 1
    num_stages: int = 1
    max_num_seqs: int | None = None  # None: parity_options' choice
    delay_ms: int = 0  # AFD_INJECT_DELAY_MS on both roles
    tp: int = 1  # the Attention role's --tensor-parallel-size (plain vLLM runs with the same)

    @property
    def peers(self) -> int:
        """Attention peers of the FFN ranks: every TP worker of every data-parallel rank."""
        return self.num_attention_ranks * self.tp

    @property
    def id(self) -> str:
        gate = "gate_attn" if self.gate_on_attention else "gate_ffn"
        tp = f"TP{self.tp}" if self.tp > 1 else ""
        name = f"{self.family}-{self.num_attention_ranks}A{tp}{self.num_ffn_ranks}F-{gate}"
        if self.num_stages > 1:
            name += f"-{self.num_stages}stages"
        return name + ("-delayed" if self.delay_ms else "")


CASES = [
    Case("qwen3_moe", 1, False),
    Case("qwen3_moe", 2, False),
    Case("qwen3_moe", 1, True),
    Case("qwen3_moe", 2, True),
    Case("deepseek_v2", 1, True),
    Case("deepseek_v2", 2, False),
    # DeepSeek-V3 as published (its config.json, sizes scaled; see the module docstring): routing
    # noaux_tc grouped top-k, correction bias, sigmoid, scaling 2.5 (the bias loads where the
    # experts are selected: the FFN's FusedMoE with one FFN rank, the Attention role's router
    # with expert parallelism); one MTP layer declared, none of its weights shipped.
    Case("deepseek_v3", 1, False),
    Case("deepseek_v3", 1, True),
    Case("deepseek_v3", 2, True),
    Case("deepseek_v3", 1, True, 2),
    # Expert parallel: each FFN rank holds half of the routed experts (gate on Attention).
    Case("qwen3_moe", 1, True, 2),
    Case("qwen3_moe", 2, True, 2),
    Case("deepseek_v2", 1, True, 2),
    Case("deepseek_v2", 2, True, 2),
    # Tensor-parallel Attention: each TP worker sends its ceil(N/2) slice of the tokens (routed
    # TP padding) and the slices' outputs are all-gathered; the baseline is plain vLLM at TP 2.
    Case("qwen3_moe", 1, False, tp=2),
    Case("qwen3_moe", 1, True, 2, tp=2),
    # Two stages, overlapped (see the module docstring).
    Case("qwen3_moe", 1, False, num_stages=2),
    Case("qwen3_moe", 2, False, num_stages=2, delay_ms=4),
    Case("deepseek_v2", 1, True, num_stages=2, max_num_seqs=2),
]


def _afd_extra(case: Case) -> dict[str, int] | None:
    extra = {}
    if case.num_stages > 1:
        extra["num_stages"] = case.num_stages
    if case.tp > 1:
        extra["attention_tp_size"] = case.tp
    return extra or None


def _log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("AFD_E2E_LOG_DIR")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "engine-logs"


def _prompt_runs(server: VLLMServer) -> tuple[BatchResult, BatchResult]:
    """All prompts concurrently (3 in flight), then the first two one at a time."""
    together = complete_many(server.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3)
    alone = complete_many(server.base_url, DEMO_PROMPTS[:2], max_tokens=MAX_TOKENS, concurrency=1)
    return together, alone


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("published")
    return {family: ensure_published_checkpoint(spec, root) for family, spec in CHECKPOINTS.items()}


_BASELINES: dict[tuple[str, int], tuple[BatchResult, BatchResult]] = {}


@pytest.fixture(scope="session")
def baseline(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> object:
    """``baseline(family, tp)`` -> plain vLLM outputs at ``--tensor-parallel-size tp``; each
    (family, tp) engine runs once, then stops."""

    def get(family: str, tp: int = 1) -> tuple[BatchResult, BatchResult]:
        if (family, tp) not in _BASELINES:
            options = parity_options(checkpoints[family], OPTIONS)
            if tp > 1:
                options = replace(
                    options, extra_args=(*options.extra_args, "--tensor-parallel-size", str(tp))
                )
            server = plain_server(
                checkpoints[family],
                log_dir=_log_root(tmp_path_factory),
                options=options,
                name=f"plain-{family}" + (f"-tp{tp}" if tp > 1 else ""),
                progress=print,
            )
            server.start()
            try:
                wait_until_healthy([server])
                _BASELINES[(family, tp)] = _prompt_runs(server)
            finally:
                server.stop()
        return _BASELINES[(family, tp)]

    return get


@dataclass
class Deployment:
    case: Case
    attention: VLLMServer
    ffns: tuple[VLLMServer, ...]
    runs: tuple[BatchResult, BatchResult]


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def deployment(
    request: pytest.FixtureRequest,
    checkpoints: dict[str, Path],
    baseline: object,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    case: Case = request.param
    baseline(case.family, case.tp)  # type: ignore[operator]  # plain first, never beside the pair
    options = parity_options(checkpoints[case.family], OPTIONS)
    if case.max_num_seqs is not None:
        options = replace(options, max_num_seqs=case.max_num_seqs)
    if case.num_stages > 1:
        options = split_every_step(options)  # vLLM's DBO thresholds at 1: small steps split
    if case.delay_ms:
        options = replace(options, env={**options.env, "AFD_INJECT_DELAY_MS": str(case.delay_ms)})
    attention, ffns = afd_servers(
        checkpoints[case.family],
        log_dir=_log_root(tmp_path_factory),
        options=options,
        num_attention_ranks=case.num_attention_ranks,
        num_ffn_ranks=case.num_ffn_ranks,
        gate_on_attention=case.gate_on_attention,
        afd_extra=_afd_extra(case),
        prefix=case.id,
        progress=print,
    )
    for ffn in ffns:
        ffn.start()
    attention.start()
    try:
        wait_until_healthy([*ffns, attention])
        runs = _prompt_runs(attention)
        yield Deployment(case, attention, ffns, runs)
    finally:
        results = stop_all([attention, *ffns])
        print(results)


@pytest.mark.timeout(1800)
def test_concurrent_greedy_outputs_match_plain_vllm(
    deployment: Deployment, baseline: object
) -> None:
    expected, _ = baseline(deployment.case.family)  # type: ignore[operator]
    actual, _ = deployment.runs
    assert all(len(c.token_ids) == MAX_TOKENS for c in expected.completions)
    parity = compare_parity(expected.completions, actual.completions)
    assert parity.ok, parity.describe()


@pytest.mark.timeout(1800)
def test_sequential_greedy_outputs_match_plain_vllm(
    deployment: Deployment, baseline: object
) -> None:
    _, expected = baseline(deployment.case.family)  # type: ignore[operator]
    _, actual = deployment.runs
    parity = compare_parity(expected.completions, actual.completions)
    assert parity.ok, parity.describe()


def _routed_expert_bytes(checkpoint: Path, family: str) -> int:
    """Bytes of all routed experts in the float32 checkpoint (3 matrices per expert)."""
    import json
    from types import SimpleNamespace

    from afd_models.models import deepseek_v2, qwen3_moe

    cfg = SimpleNamespace(**json.loads((checkpoint / "config.json").read_text()))
    if family == "qwen3_moe":
        experts, rule = cfg.num_experts, qwen3_moe.is_moe_layer
    else:
        experts, rule = cfg.n_routed_experts, deepseek_v2.is_moe_layer
    layers = sum(rule(cfg, i) for i in range(cfg.num_hidden_layers))
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 * experts * layers


@pytest.mark.timeout(1800)
def test_roles_report_their_own_weights_and_stay_up(
    deployment: Deployment, checkpoints: dict[str, Path]
) -> None:
    from afd_models.demo.servers import parse_param_bytes

    case = deployment.case
    deployment.attention.check_alive()
    for ffn in deployment.ffns:
        ffn.check_alive()
    att = parse_param_bytes(deployment.attention.metrics_text()).get("attention")
    assert att is not None and len(att) == case.peers
    per_rank = [parse_param_bytes(f.metrics_text()).get("ffn") for f in deployment.ffns]
    assert all(b is not None and len(b) == 1 for b in per_rank), per_rank
    if case.num_ffn_ranks > 1:
        # Expert parallel, gate on Attention: an FFN rank holds exactly its share of the routed
        # experts (half each over 2 ranks), nothing else.
        total = _routed_expert_bytes(checkpoints[case.family], case.family)
        assert [b[0] for b in per_rank] == [total // case.num_ffn_ranks] * case.num_ffn_ranks  # type: ignore[index]


def _idle_metrics(deployment: Deployment) -> tuple[str, tuple[str, ...]]:
    """The Attention role's and each FFN rank's /metrics, read once the ``afd_*`` series of both
    roles stood still between two reads a second apart (10 tries).

    Both roles' series must be compared: an Attention rank counts a step when it announces it,
    the FFN when it has served it, so a trailing step (vLLM's data-parallel ranks run a few
    dummy steps after the last request) can show on one side and not yet on the other."""
    from afd_models.demo.servers import afd_samples

    last: object = None
    for _ in range(10):
        attention = deployment.attention.metrics_text()
        ffns = tuple(f.metrics_text() for f in deployment.ffns)
        snapshot = (afd_samples(attention), tuple(afd_samples(t) for t in ffns))
        if snapshot == last:
            return attention, ffns
        last = snapshot
        time.sleep(1.0)
    raise AssertionError("the deployment kept stepping while idle")


@pytest.mark.timeout(1800)
def test_the_ffn_batched_its_attention_ranks_per_metrics(deployment: Deployment) -> None:
    """From the afd_* metrics on both roles' /metrics: every FFN rank served every step of
    every Attention rank (lockstep: equal step counts), and computed once per MoE layer (and
    non-empty stage) per step over all of them: with one stage and one FFN rank,
    ``afd_ffn_compute_calls_total{layer}`` equals ``afd_steps_total`` for every layer, and the
    FFN computed exactly the tokens the Attention ranks announced, in every MoE layer."""
    from afd_models.demo.servers import parse_attention_stats, parse_ffn_stats

    case = deployment.case
    attention_text, ffn_texts = _idle_metrics(deployment)
    ranks = parse_attention_stats(attention_text)
    # One series per Attention peer: with TP each worker is a peer with its own link.
    assert sorted(ranks) == list(range(case.peers)), attention_text
    for a in ranks.values():
        assert a.link_up and a.steps > 0 and a.tokens > 0, a
        assert a.sent_bytes > 0 and a.received_bytes > 0, a
        assert a.waits > 0 and a.wait_s > 0, a  # per-layer waits for the FFN were observed
    for f, text in enumerate(ffn_texts):
        stats = parse_ffn_stats(text)
        assert set(stats) == {f}, text
        s = stats[f]
        assert s.peers == case.peers
        assert s.steps > 0 and s.tokens > 0
        # Lockstep: one FFN step per step of each Attention rank (both ranks in every step).
        assert all(a.steps == s.steps for a in ranks.values()), (s, ranks)
        per_layer = dict(s.layer_calls)
        if case.num_stages > 1:
            # One call per layer and non-empty stage: a split step makes two per layer, and
            # the prompts sent together made some steps split.
            assert s.steps * s.layers < s.compute_calls <= 2 * s.steps * s.layers, s
        elif case.num_ffn_ranks == 1:
            # Batching: calls per layer-step equal 1 whatever the number of Attention ranks.
            assert len(per_layer) == s.layers and set(per_layer.values()) == {s.steps}, s
            # Every announced token was computed once in every MoE layer.
            assert s.tokens == s.layers * sum(a.tokens for a in ranks.values()), (s, ranks)
        else:
            # A rank computes once per layer that routed it tokens: never more than batched.
            assert all(0 < n <= s.steps for n in per_layer.values()), s


@pytest.mark.timeout(1800)
@pytest.mark.applies_to(lambda case: case.tp > 1 and case.num_ffn_ranks == 1)
def test_every_real_token_reaches_the_ffn_once_under_tp(deployment: Deployment) -> None:
    """Tensor-parallel Attention, one FFN rank: one request whose prompt is not a multiple of
    the TP size (prefill N = 11 over T = 2) and whose decode steps hold fewer tokens than TP
    workers (N = 1 < 2). Counted on the FFN side from its metrics, the rows it computed in every
    MoE layer equal the tokens vLLM's own counters say the Attention role ran (prompt tokens plus
    generated tokens fed back): each real token once, no padding row."""
    from afd_models.demo.servers import parse_ffn_stats, sample_total

    case = deployment.case
    attention_text, (ffn_text,) = _idle_metrics(deployment)
    before = parse_ffn_stats(ffn_text)[0]
    prompt_before = sample_total(attention_text, "vllm:prompt_tokens_total")
    generated_before = sample_total(attention_text, "vllm:generation_tokens_total")
    result = complete_many(
        deployment.attention.base_url, ("Counting tokens once: seven",), max_tokens=5
    )
    attention_text, (ffn_text,) = _idle_metrics(deployment)
    after = parse_ffn_stats(ffn_text)[0]
    prompt = sample_total(attention_text, "vllm:prompt_tokens_total") - prompt_before
    generated = sample_total(attention_text, "vllm:generation_tokens_total") - generated_before
    assert prompt % case.tp == 1 and generated == len(result.completions[0].token_ids) > 1
    fed = prompt + generated - 1  # the last generated token is never fed back
    assert after.tokens - before.tokens == after.layers * fed, (before, after, prompt, generated)


#: SIGTERM must stop a role (its whole process session) within this many seconds.
STOP_BOUND_S = 30.0


@pytest.mark.timeout(1800)
def test_sigterm_stops_both_roles(deployment: Deployment) -> None:
    """Last test of each deployment: stop it. Both roles exit 0 within the bound without SIGKILL
    (the 2-rank Qwen3 case stops the FFN first, the others the Attention role first)."""
    case = deployment.case
    ffn_first = case.family == "qwen3_moe" and case.num_attention_ranks == 2
    order = [*deployment.ffns, deployment.attention]
    stopped = order if ffn_first else order[::-1]
    results = stop_all(stopped, timeout_s=2 * STOP_BOUND_S)
    for server, r in zip(stopped, results, strict=True):
        assert r.exit_code == 0 and not r.forced, (r, server.log_tail(60))
        assert r.elapsed_s <= STOP_BOUND_S, r
