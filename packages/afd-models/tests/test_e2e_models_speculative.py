"""E2E: speculative decoding through AFD, DeepSeek-V3 with one MTP layer (``deepseek_mtp``).

Plain ``vllm serve`` and the AFD Attention role run the same ``--speculative-config``
(``deepseek_mtp``, 2 speculative tokens); the FFN role runs none and serves the MTP layer's
routed experts beside the target's. Checked: greedy tokens identical to plain vLLM's with the
same speculative config, the speculative-decoding counters equal (drafts, draft tokens,
accepted tokens, from each server's ``/metrics``), the FFN computed the draft layer (its
``afd_ffn_compute_calls_total{layer=<MTP>}``) and holds the draft layer's routed experts (its
``afd_param_bytes``). The checkpoint's draft layer is built to be accepted
(``TinySpec(draft="accepting")``: the target is close to a bigram model, its layers scaled down
but not zeroed, and the MTP layer predicts that bigram), so the accepted-token counter is far
from zero (about a third of the draft tokens on the demo prompts, not all) and its equality
with plain vLLM's says the AFD pair accepted the same drafts; with random draft weights it
would be 0 on both sides.

DeepSeek servers run ``--max-num-seqs 1`` with ``CPU_MLA`` (``parity_options``: vLLM 0.32's CPU MLA
path is not batch invariant).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import BatchResult, complete_many
from afd_models.demo.parity import compare_parity
from afd_models.demo.servers import (
    EngineOptions,
    afd_samples,
    afd_servers,
    mtp_speculative_args,
    parity_options,
    parse_ffn_stats,
    parse_param_bytes,
    plain_server,
    sample_total,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_TOKENS = 16
SPECULATIVE_TOKENS = 2
#: The case as the README's support matrix names it (``speculative[<id>]``).
CASES = ("deepseek_v3-1A1F-gate_attn-mtp2",)
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


@dataclass(frozen=True)
class Run:
    batch: BatchResult
    spec_counters: dict[str, float]
    metrics_text: str
    ffn_metrics: tuple[str, ...] = ()


def _spec_counters(text: str) -> dict[str, float]:
    return {name: sample_total(text, name) for name in SPEC_COUNTERS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run, Run]:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    model = ensure_tiny_checkpoint(TinySpec("deepseek_v3", mtp_layers=1, draft="accepting"), root)
    env_logs = os.environ.get("AFD_E2E_LOG_DIR")
    logs = Path(env_logs) if env_logs else tmp_path_factory.getbasetemp() / "engine-logs"
    options = parity_options(model, EngineOptions(dtype="float32", max_model_len=512))
    spec = mtp_speculative_args(SPECULATIVE_TOKENS)

    plain = plain_server(
        model,
        log_dir=logs,
        options=replace(options, extra_args=(*options.extra_args, *spec)),
        name="plain-deepseek_v3-mtp",
        progress=print,
    )
    plain.start()
    try:
        wait_until_healthy([plain])
        batch = complete_many(plain.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3)
        text = plain.metrics_text()
        base = Run(batch, _spec_counters(text), text)
    finally:
        plain.stop()

    attention, ffns = afd_servers(
        model,
        log_dir=logs,
        options=options,
        num_attention_ranks=1,
        gate_on_attention=True,
        prefix=CASES[0],
        progress=print,
        attention_args=spec,
    )
    for ffn in ffns:
        ffn.start()
    attention.start()
    try:
        wait_until_healthy([*ffns, attention])
        batch = complete_many(
            attention.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3
        )
        text = attention.metrics_text()
        afd = Run(batch, _spec_counters(text), text, tuple(f.metrics_text() for f in ffns))
    finally:
        results = stop_all([attention, *ffns])
        print(results)
    assert all(r.exit_code == 0 and not r.forced for r in results), results
    return model, base, afd


@pytest.mark.timeout(1800)
def test_tokens_identical_to_plain_vllm_with_the_same_speculative_config(
    runs: tuple[Path, Run, Run],
) -> None:
    _, base, afd = runs
    parity = compare_parity(base.batch.completions, afd.batch.completions)
    assert parity.ok, parity.describe()


@pytest.mark.timeout(1800)
def test_speculative_counters_equal_plain_vllm(runs: tuple[Path, Run, Run]) -> None:
    _, base, afd = runs
    print({"plain": base.spec_counters, "afd": afd.spec_counters})
    assert base.spec_counters["vllm:spec_decode_num_drafts_total"] > 0, base.spec_counters
    # Drafts are accepted, and not all of them: the comparison is not 0 == 0 (nor all == all).
    accepted = base.spec_counters["vllm:spec_decode_num_accepted_tokens_total"]
    drafted = base.spec_counters["vllm:spec_decode_num_draft_tokens_total"]
    assert 0 < accepted < drafted, base.spec_counters
    assert afd.spec_counters == base.spec_counters


@pytest.mark.timeout(1800)
def test_the_ffn_served_the_draft_layer_and_holds_its_experts(
    runs: tuple[Path, Run, Run],
) -> None:
    model, _, afd = runs
    config = json.loads((model / "config.json").read_text())
    draft_layer = config["num_hidden_layers"]
    stats = parse_ffn_stats(afd.ffn_metrics[0])[0]
    calls = dict(stats.layer_calls)
    # The drafter ran the MTP layer's experts on the FFN role (2 speculative tokens: at least
    # two draft steps per target step), and the target layers as before.
    assert calls.get(draft_layer, 0) > 0, calls
    moe_layers = range(config["first_k_dense_replace"], draft_layer)
    assert all(calls.get(i, 0) > 0 for i in moe_layers), calls
    assert calls[draft_layer] >= SPECULATIVE_TOKENS * min(calls[i] for i in moe_layers) // 2
    # Weights: the routed experts of every MoE layer, the MTP layer's included, plus each
    # layer's routing bias (one FFN rank selects the experts), and nothing else.
    experts, hidden = config["n_routed_experts"], config["hidden_size"]
    per_layer = 3 * experts * hidden * config["moe_intermediate_size"] * 4 + experts * 4
    layers = len(moe_layers) + config["num_nextn_predict_layers"]
    assert parse_param_bytes(afd.ffn_metrics[0])["ffn"] == (per_layer * layers,)
    # The Attention role's steps include the drafter's (announced as steps of their own).
    steps = {k: v for k, v in afd_samples(afd.metrics_text).items() if k[0] == "afd_steps_total"}
    assert sum(steps.values()) >= stats.steps > 0
