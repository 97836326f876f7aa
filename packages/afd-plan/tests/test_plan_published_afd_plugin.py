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

Inputs of the model (one profile, one shape, nothing tuned per deployment or to the answer):

* profile: the shipped ``ascend-910c-die`` (public package figures halved per die: 390 TFLOPS
  BF16, 780 TOPS INT8, 1.6 TB/s, 64 GiB, 200 GB/s link; assumed there: efficiencies 0.6
  compute / 0.8 memory / 0.8 link, 0.1 us a peer message, 10 us link latency) with:

  - **latency of one layer's exchange** (``link_latency``): the profile's own value, taken as
    shipped (:data:`EXCHANGE_LATENCY_S`), for each direction of every MoE layer's exchange, the
    EP64 all-to-all (dispatch, combine) and the AFD transfer alike. A second, published value
    is checked too: xDeepServe's per-primitive times of the AFD exchange on the same hardware
    (CloudMatrix384, 910C), A2E / E2A 172 / 193 us, their mean
    (:data:`PUBLISHED_EXCHANGE_LATENCY_S`, 182.5 us). Neither is chosen from the results.
  - **DSA's achieved bandwidth** (``kv_efficiency``): fitted to EP64's two published points
    alone (:func:`fit_kv_efficiency`, about 0.05 at 10 us), never to an AFD row. The published
    16K -> 32K loss (EP64 -28 %) is five times what a bandwidth roofline of DSA predicts
    (-5.6 %): the real indexer costs ~1.6 ns per cached token, layer and sequence. Because it
    is fitted to them, EP64's two rates are not asserted (that would restate the fit); the AFD
    rows are the out-of-sample check.

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

What the model gets at the profile's latency (tokens/s per die;
``python packages/afd-plan/benchmarks/published_910c.py`` prints this and the sensitivity):

============  ==========  ================  ================
input         EP64        64:16             48:16
============  ==========  ================  ================
16K           233.9       215.9 (-7.7 %)    202.4 (-13.5 %)
32K           166.9       147.5 (-11.6 %)   138.3 (-17.1 %)
============  ==========  ================  ================

The published order is not reproduced: 64:16 rates under EP64 at both lengths. The known
limitations, each a strict xfail asserting the published behaviour (a fix shows as XPASS):

1. **The order holds only in a narrow window of exchange latency.** With DSA refitted at each
   value, the order holds at both lengths for a latency of about 95-125 us only (the
   benchmark's sweep), a window neither independent value lies in. Below (the profile's
   10 us), 64:16 falls under EP64 (the latency EP64 pays in series is what AFD's two stages
   hide); above (the published 182.5 us), 48:16 rises over EP64 at 32K.
2. **With the profile as shipped** (10 us, DSA at its roofline) 64:16 rates -35 %: its FFN
   dies stream 16 experts a layer (704 MB in INT8), four times an EP64 die's, and bind.
3. **The AFD rows miss the published rates** by 8-20 % (DSA fitted to EP64 alone).
4. **48:16 against 64:16 is out of reach of a model of this kind.** In a model where removing
   Attention ranks never slows a step, per-die throughput is ``A * b / ((A + F) * TPOT)``, so
   ``X(48:16) / X(64:16) >= (48 / 64) / (64 / 80) = 0.9375``, while the published ratio is
   220.3 / 258.9 = 0.851 (the measured 48:16 step was 10 % slower than 64:16's with less FFN
   work).

Absolute levels at the profile's latency: the model's TPOT is 68 / 96 ms for EP64 (published
68.8 / 95.1 ms: 16 / throughput, the fitted points) and 104 / 152 ms for 64:16 (published
86.5 / 122.2 ms).
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
#: One direction of one MoE layer's exchange: the shipped profile's value, not chosen here.
EXCHANGE_LATENCY_S = load_profile("ascend-910c-die").link_latency
#: The same from a published figure: the mean of xDeepServe's A2E / E2A times on 910C.
PUBLISHED_EXCHANGE_LATENCY_S = (172e-6 + 193e-6) / 2
#: How close to a published rate a prediction must come (the bound this check held EP64 to
#: before EP64 became the fit's only data).
TOLERANCE = 0.05
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


# Not asserted: EP64's two rates against the published ones. kv_efficiency is fitted to exactly
# those two points, so the comparison would restate the fit; the AFD rows below are out of sample.

ORDER_AT_THE_PROFILE_LATENCY = pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="limitation: the model reproduces the published order only for an exchange latency "
    "of about 95-125 us; at the profile's 10 us (DSA fitted to EP64) 64:16 rates 8-12 % under "
    "EP64: the latency EP64 pays in series is too small for AFD's two stages to pay",
)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="limitation: with DSA fitted to EP64 alone, the model's AFD rows miss the published "
    "ones by 8-20 % at the profile's latency (64:16 16-20 % under, 48:16 8-9 % under)",
)
@pytest.mark.parametrize("name", ["64:16", "48:16"])
@pytest.mark.parametrize("input_len", LENGTHS)
def test_dsa_fitted_to_ep64_alone_predicts_the_afd_rows(
    model: dict[int, dict[str, float]], input_len: int, name: str
) -> None:
    assert model[input_len][name] == pytest.approx(PUBLISHED[input_len][name], rel=TOLERANCE)


@ORDER_AT_THE_PROFILE_LATENCY
@pytest.mark.parametrize("input_len", LENGTHS)
def test_published_signs_and_order(model: dict[int, dict[str, float]], input_len: int) -> None:
    row = model[input_len]
    assert row["64:16"] > row["EP64"] > row["48:16"]


def test_ep64_rates_best_at_one_stage_and_afd_at_two() -> None:
    for row in predicted().values():
        assert row["EP64"].candidate.stages == 1
        assert row["64:16"].candidate.stages == 2 and row["48:16"].candidate.stages == 2


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="limitation: the model reproduces the published order only for an exchange latency "
    "of about 95-125 us; at xDeepServe's published A2E/E2A latency (182.5 us, DSA fitted to "
    "EP64) 48:16 rates over EP64 at 32K: EP64's serial exchange costs too much",
)
def test_the_published_order_holds_at_the_published_exchange_latency() -> None:
    assert published_order(rates(predicted(run_profile(PUBLISHED_EXCHANGE_LATENCY_S))))


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="limitation: with the profile as shipped (10 us, DSA at its roofline) the physical "
    "64:16 is bound by its FFN dies (16 experts a layer, four times an EP64 die's) and rates "
    "~35 % under EP64",
)
@pytest.mark.parametrize("input_len", LENGTHS)
def test_the_published_order_holds_with_the_profile_as_shipped(input_len: int) -> None:
    shape = shape_from_config(DEEPSEEK_V32)
    hw = load_profile("ascend-910c-die")
    row = {d: best(shape, hw, input_len, d).tokens_per_s_per_device for d in DEPLOYMENTS}
    assert row["64:16"] > row["EP64"] > row["48:16"]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="limitation: in the model fewer Attention ranks never slow a step, so 48:16 keeps "
    ">= (48/64)/(64/80) = 0.9375 of 64:16's per-die rate; the published runs kept 0.851 (16K) "
    "and 0.826 (32K)",
)
@pytest.mark.parametrize("input_len", LENGTHS)
def test_48_16_against_64_16_matches_the_published_ratio(
    model: dict[int, dict[str, float]], input_len: int
) -> None:
    row, published = model[input_len], PUBLISHED[input_len]
    assert row["48:16"] / row["64:16"] == pytest.approx(
        published["48:16"] / published["64:16"], rel=TOLERANCE
    )
