"""The published-results check: afd-plugin's DeepSeek-V3.2 W8A8 decode on Ascend 910C.

Published (vllm-project/afd-plugin, ``recipe/npu/CAMP2pAFDConnector/deepseek_v3_2/README.md``
and its throughput figures, HEAD 2e4378f; the project's blog of July 2026), decode tokens/s per
die = aggregate output tokens/s / deployed dies:

============  ======  ===================  ===================
input         EP64    64 Attn : 16 FFN     48 Attn : 16 FFN
============  ======  ===================  ===================
16K           232.6   258.9 (+11.3 %)      220.3 (-5.3 %)
32K           168.2   183.3 (+9.0 %)       151.4 (-10.0 %)
============  ======  ===================  ===================

The run: Atlas 900 A3 SuperPoD (910C, 16 dies a node); per-rank batch 16 (EP64) and 28 (AFD);
forced expert balance; DBO (two micro-batches) and graph mode on the AFD roles; the physical
48:16 and 64:16 stand in for 192:64 and 256:64 (the FFN batch per die, ``A * 28 / F``, is the
same as the large deployment's).

Inputs of the model (one profile, one shape, nothing tuned per deployment):

* profile: the shipped ``ascend-910c-die`` (public package figures halved per die: 390 TFLOPS
  BF16, 780 TOPS INT8, 1.6 TB/s, 64 GiB, 200 GB/s link; assumed there: efficiencies 0.6
  compute / 0.8 memory / 0.8 link, 0.1 us a peer message) with two inputs of this run:

  - **latency of one layer's exchange** (``link_latency``): :data:`EXCHANGE_LATENCY_S` = 110 us
    for each direction of every MoE layer's exchange, the EP64 all-to-all (dispatch, combine)
    and the AFD transfer alike. Assumed from xDeepServe's published per-primitive times on the
    same hardware (CloudMatrix384, 910C): dispatch / combine 20-140 us at EP128, A2E / E2A
    172 / 193 us. The profile's 10 us is one small point-to-point message (XCCL P2P under
    20 us); a whole exchange among 64-80 dies, synchronised, costs an order more.
  - **DSA's achieved bandwidth** (``kv_efficiency``): fitted to EP64's two published points
    alone (:func:`fit_kv_efficiency`, about 0.06), never to an AFD row. The published
    16K -> 32K loss (EP64 -28 %) is five times what a bandwidth roofline of DSA predicts
    (-5.6 %): the real indexer costs ~1.6 ns per cached token, layer and sequence.

* shape: DeepSeek-V3.2's public config (hidden 7168, 61 layers, first 3 dense, 256 routed
  experts top-8, 1 shared expert, moe_intermediate 2048, MLA as V3: 128 heads, q_lora 1536,
  kv_lora 512, rope 64, nope 128, v 128; DSA indexer: 64 heads of 128, top-2048);
* workload: W8A8 for experts and every other linear weight, forced balance
  (``routing="balanced"``), decode at 16K / 32K input. Assumed: 1024 output tokens (decode is
  costed at the mean context, input + 512) and an INT8 KV cache (with a BF16 cache the AFD
  Attention role at 32K and batch 28 needs 87 GiB and is refused: see the test below);
* deployments: the physical ones, EP64 at batch 16, 64:16 and 48:16 at batch 28 with every
  FFN die holding 16 of the 256 experts; each at the stage count (1 or 2) the model rates best
  (EP64 rates best at one stage, AFD at two: the run's DBO).

How DSA is modelled: per layer and decode token the lightning indexer reads the FP8 key
(128 B + a 4 B scale) of every cached token and spends ``2 * 64 * 128`` FLOPs on each; the main
MLA attention then reads the compressed latent (576 elements) of only ``min(context, 2048)``
tokens, both at ``kv_efficiency`` of the memory bandwidth.

What the model gets (tokens/s per die; ``python packages/afd-plan/benchmarks/published_910c.py``
prints this and the sensitivity):

============  ==========  ================  ================
input         EP64        64:16             48:16
============  ==========  ================  ================
16K           225.2       229.6 (+2.0 %)    217.8 (-3.3 %)
32K           172.3       177.4 (+3.0 %)    166.4 (-3.5 %)
============  ==========  ================  ================

The signs and the order of the three deployments are reproduced at both lengths; the margins
are smaller than published (+2-3 % / -3.5 % against +9-11 % / -5-10 %). How sensitive:

1. **The exchange latency decides it, in a narrow window.** With DSA refitted at each value,
   the order holds at both lengths for a latency of 95-125 us only
   (:func:`test_the_order_holds_only_inside_a_narrow_latency_window`). Below, 64:16 falls
   under EP64 at 32K (the latency EP64 pays in series is what AFD's two stages hide); above,
   48:16 rises over EP64 at 32K. With the profile's own 10 us and DSA at its roofline, 64:16
   rates -35 %: its FFN dies stream 16 experts a layer (704 MB in INT8), four times an EP64
   die's, and bind.
2. **The window cannot be wide in any model of this kind.** In a model where removing
   Attention ranks never slows a step, per-die throughput is ``A * b / ((A + F) * TPOT)``, so
   ``X(48:16) / X(64:16) >= (48 / 64) / (64 / 80) = 0.9375``, while the published ratio is
   220.3 / 258.9 = 0.851 (the measured 48:16 step was 10 % slower than 64:16's with less FFN
   work). The published order then needs 64:16's gain over EP64 inside (0, +6.7 %).
3. **The other assumed inputs**, at 110 us: compute efficiency changes nothing (every role is
   memory bound); link efficiency 0.5 keeps the order; memory efficiency 0.5 (against 0.8)
   puts 64:16 7 % under EP64 at 16K; a per-peer message cost of 1-2 us (against 0.1 us) taxes
   EP64's 63-peer all-to-all and lifts 48:16 over EP64 at 32K.

Absolute levels: the model's TPOT is 71 / 93 ms for EP64 (published 68.8 / 95.1 ms: 16 /
throughput) and 98 / 126 ms for 64:16 (published 86.5 / 122.2 ms).
"""

from __future__ import annotations

import math
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_plan.errors import AFDPlanMemoryError
from afd_plan.hardware import HardwareProfile, load_profile
from afd_plan.plan import Candidate, Prediction, predict
from afd_plan.shape import ModelShape, shape_from_config
from afd_plan.workload import Workload
from afd_plan_inputs import DEEPSEEK_V32

PUBLISHED: dict[int, dict[str, float]] = {
    16384: {"EP64": 232.6, "64:16": 258.9, "48:16": 220.3},
    32768: {"EP64": 168.2, "64:16": 183.3, "48:16": 151.4},
}
DEPLOYMENTS: dict[str, tuple[int, int, int]] = {
    "EP64": (64, 0, 16),
    "64:16": (64, 16, 28),
    "48:16": (48, 16, 28),
}
OUTPUT_LEN = 1024  # assumed
LENGTHS = tuple(PUBLISHED)
#: Assumed: one direction of one MoE layer's exchange among the run's dies (module docstring).
EXCHANGE_LATENCY_S = 110e-6
#: Where the published order holds at both lengths (DSA refitted at each latency).
ORDER_WINDOW_S = (95e-6, 125e-6)
#: The grid :func:`fit_kv_efficiency` searches: 0.0005 steps in (0, 0.3].
KV_EFFICIENCY_STEP = 0.0005


def workload(input_len: int, kv_dtype: str = "int8") -> Workload:
    return Workload(
        input_len=input_len,
        output_len=OUTPUT_LEN,
        kv_dtype=kv_dtype,
        dense_quant="w8a8",
        routing="balanced",
    )


def best(shape: ModelShape, hw: HardwareProfile, input_len: int, name: str) -> Prediction:
    a, f, b = DEPLOYMENTS[name]
    preds = [predict(shape, workload(input_len), hw, Candidate(a, f, s, b, "w8a8")) for s in (1, 2)]
    return max(preds, key=lambda p: p.tokens_per_s_per_device)


def _ep64_log_error(shape: ModelShape, hw: HardwareProfile) -> float:
    return sum(
        math.log(best(shape, hw, n, "EP64").tokens_per_s_per_device / PUBLISHED[n]["EP64"]) ** 2
        for n in LENGTHS
    )


@cache
def fit_kv_efficiency(link_latency: float) -> float:
    """DSA's achieved bandwidth fraction that puts EP64 closest (least squares on the log) to
    its two published points, on the shipped profile with ``link_latency``; the AFD rows play
    no part. A coarse then a fine pass over a 0.0005 grid."""
    shape = shape_from_config(DEEPSEEK_V32)
    base = load_profile("ascend-910c-die").with_overrides(link_latency=link_latency)

    def err(kv: float) -> float:
        return _ep64_log_error(shape, base.with_overrides(kv_efficiency=kv))

    coarse = min((i * 20 * KV_EFFICIENCY_STEP for i in range(1, 31)), key=err)
    steps = range(-20, 21)
    fine = [coarse + i * KV_EFFICIENCY_STEP for i in steps if coarse + i * KV_EFFICIENCY_STEP > 0]
    return round(min(fine, key=err), 6)


def run_profile(link_latency: float = EXCHANGE_LATENCY_S) -> HardwareProfile:
    """The shipped ``ascend-910c-die`` with this run's two inputs (module docstring)."""
    return load_profile("ascend-910c-die").with_overrides(
        link_latency=link_latency, kv_efficiency=fit_kv_efficiency(link_latency)
    )


def predicted(hw: HardwareProfile | None = None) -> dict[int, dict[str, Prediction]]:
    shape = shape_from_config(DEEPSEEK_V32)
    hw = hw or run_profile()
    return {n: {d: best(shape, hw, n, d) for d in DEPLOYMENTS} for n in LENGTHS}


def rates(preds: dict[int, dict[str, Prediction]]) -> dict[int, dict[str, float]]:
    return {n: {d: p.tokens_per_s_per_device for d, p in row.items()} for n, row in preds.items()}


def published_order(got: dict[int, dict[str, float]]) -> bool:
    return all(r["64:16"] > r["EP64"] > r["48:16"] for r in got.values())


@pytest.fixture(scope="module")
def model() -> dict[int, dict[str, float]]:
    return rates(predicted())


def test_every_published_deployment_fits_a_die_with_an_int8_kv_cache() -> None:
    preds = predicted()
    for row in preds.values():
        for p in row.values():
            assert all(sum(parts.values()) < 64 * 2**30 * 0.9 for parts in p.memory.values())


def test_a_bf16_kv_cache_at_32k_is_refused_for_the_attention_role() -> None:
    shape = shape_from_config(DEEPSEEK_V32)
    hw = load_profile("ascend-910c-die")
    with pytest.raises(AFDPlanMemoryError) as err:
        predict(shape, workload(32768, "model"), hw, Candidate(64, 16, 2, 28, "w8a8"))
    assert err.value.role == "attention" and err.value.needed_bytes > hw.usable_memory


def test_dsa_efficiency_fitted_to_ep64_alone_gives_ep64_within_5_percent(
    model: dict[int, dict[str, float]],
) -> None:
    kv = fit_kv_efficiency(EXCHANGE_LATENCY_S)
    assert 0.03 < kv < 0.1  # far below the 0.8 of a streaming read: DSA's indexer
    for n in LENGTHS:
        assert model[n]["EP64"] == pytest.approx(PUBLISHED[n]["EP64"], rel=0.05)


@pytest.mark.parametrize("input_len", LENGTHS)
def test_published_signs_and_order(model: dict[int, dict[str, float]], input_len: int) -> None:
    row = model[input_len]
    assert row["64:16"] > row["EP64"] > row["48:16"]


def test_ep64_rates_best_at_one_stage_and_afd_at_two() -> None:
    for row in predicted().values():
        assert row["EP64"].candidate.stages == 1
        assert row["64:16"].candidate.stages == 2 and row["48:16"].candidate.stages == 2


def test_the_order_holds_only_inside_a_narrow_latency_window() -> None:
    lo, hi = ORDER_WINDOW_S
    for latency in (lo, EXCHANGE_LATENCY_S, hi):
        assert published_order(rates(predicted(run_profile(latency)))), latency
    below = rates(predicted(run_profile(lo - 10e-6)))
    assert below[32768]["64:16"] < below[32768]["EP64"]  # AFD's hiding no longer pays
    above = rates(predicted(run_profile(hi + 10e-6)))
    assert above[32768]["48:16"] > above[32768]["EP64"]  # EP64's serial exchange costs more


def test_with_the_profile_as_shipped_the_physical_64_16_is_bound_by_its_ffn_dies() -> None:
    preds = predicted(load_profile("ascend-910c-die"))
    for row in preds.values():
        assert row["64:16"].binding.startswith("ffn")
        assert row["64:16"].tokens_per_s_per_device < 0.7 * row["EP64"].tokens_per_s_per_device


@pytest.mark.parametrize("input_len", LENGTHS)
def test_the_margins_are_out_of_reach_of_a_model_where_fewer_attention_ranks_never_slow_a_step(
    model: dict[int, dict[str, float]], input_len: int
) -> None:
    # Removing Attention ranks never slows a step, so 48:16 keeps >= 48/64 / (64/80) of
    # 64:16's per-die rate; the published runs kept 0.851.
    row = model[input_len]
    assert row["48:16"] / row["64:16"] >= (48 / 64) / (64 / 80) - 1e-12
    published = PUBLISHED[input_len]
    assert published["48:16"] / published["64:16"] < (48 / 64) / (64 / 80)
