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

Inputs of the model (one profile, one shape, nothing tuned per row):

* profile: the shipped ``ascend-910c-die`` (public package figures halved per die: 390 TFLOPS
  BF16, 780 TOPS INT8, 1.6 TB/s, 64 GiB, 200 GB/s link; assumed: efficiencies 0.6 compute /
  0.8 memory / 0.8 link, 10 us link latency, 0.1 us a peer message);
* shape: DeepSeek-V3.2's public config (hidden 7168, 61 layers, first 3 dense, 256 routed
  experts top-8, 1 shared expert, moe_intermediate 2048, MLA as V3: 128 heads, q_lora 1536,
  kv_lora 512, rope 64, nope 128, v 128; DSA indexer: 64 heads of 128, top-2048);
* workload: W8A8 for experts and every other linear weight, forced balance
  (``routing="balanced"``), decode at 16K / 32K input. Assumed: 1024 output tokens (decode is
  costed at the mean context, input + 512) and an INT8 KV cache (with a BF16 cache the AFD
  Attention role at 32K and batch 28 needs 87 GiB and is refused: see the test below);
* deployments: the physical ones, EP64 at batch 16, 64:16 and 48:16 at batch 28 with every
  FFN die holding 16 of the 256 experts; each at the stage count (1 or 2) the model rates best.

How DSA is modelled: per layer and decode token the lightning indexer reads the FP8 key
(128 B + a 4 B scale) of every cached token and spends ``2 * 64 * 128`` FLOPs on each; the main
MLA attention then reads the compressed latent (576 elements) of only ``min(context, 2048)``
tokens. So attention cost is nearly flat in context once past 2048 tokens.

What the model gets (tokens/s per die, best stages; ``python packages/afd-plan/benchmarks/
published_910c.py`` prints this and a sensitivity grid):

============  ==========  ================  ================
input         EP64        64:16             48:16
============  ==========  ================  ================
16K           578         374 (-35 %)       363 (-37 %)
32K           546         357 (-35 %)       346 (-37 %)
============  ==========  ================  ================

Reproduced: 48:16 below EP64 and below 64:16 at both lengths. Not reproduced: 64:16 above EP64
(the model says -35 %), so the full sign-and-order check is an expected failure (strict: it
flags the day the model reproduces it). Why, from the model's own terms:

1. With the physical placement, an FFN die streams 16 experts a layer (704 MB in INT8), four
   times an EP64 die's 4; the FFN die is the binding resource and a step costs ~2x EP64's on a
   roofline. Splitting into two stages re-reads those weights per micro-batch, so DBO does not
   rescue it. (Modelling the 256:64 / 192:64 the run stands in for, 4 experts per FFN die, the
   model gives +8.5 % / +7.2 % at 16K with two stages: the 64:16 sign right, the 48:16 one
   wrong.)
2. No model in which a step does not get slower when Attention ranks are removed can reproduce
   48:16 < EP64 < 64:16 with the published margins: per-die throughput is
   ``A * b / ((A + F) * TPOT)``, so ``X(48:16) / X(64:16) >= (48 / 64) / (64 / 80) = 0.9375``,
   while the published ratio is 220.3 / 258.9 = 0.851 (the measured 48:16 step was 10 % slower
   than 64:16's with less FFN work). The published order then needs the model's 64:16 gain over
   EP64 inside (0, +6.7 %), a narrow band no choice in the sensitivity grid hits.
3. The published 16K -> 32K loss (EP64 -28 %, AFD -29 %) is five times what a bandwidth
   roofline of DSA predicts (-5.6 %): the real indexer costs ~1.6 ns per cached token, layer and
   sequence, far from its memory roofline. Setting ``kv_efficiency = 0.055`` in the profile
   (fitted to EP64's two points only) brings EP64 to 254 / 184 and 48:16 to 223 / 154 (published
   232.6 / 168.2 and 220.3 / 151.4) but 64:16 to 238 / 165 (published 258.9 / 183.3): still
   below EP64.
"""

from __future__ import annotations

import sys
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


def predicted(hw: HardwareProfile | None = None) -> dict[int, dict[str, Prediction]]:
    shape = shape_from_config(DEEPSEEK_V32)
    hw = hw or load_profile("ascend-910c-die")
    return {n: {d: best(shape, hw, n, d) for d in DEPLOYMENTS} for n in LENGTHS}


def rates(preds: dict[int, dict[str, Prediction]]) -> dict[int, dict[str, float]]:
    return {n: {d: p.tokens_per_s_per_device for d, p in row.items()} for n, row in preds.items()}


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


@pytest.mark.parametrize("input_len", LENGTHS)
def test_reproduced_48_16_below_64_16_and_below_ep64(
    model: dict[int, dict[str, float]], input_len: int
) -> None:
    row = model[input_len]
    assert row["48:16"] < row["64:16"]
    assert row["48:16"] < row["EP64"]


@pytest.mark.xfail(
    strict=True,
    reason="the model rates the physical 64:16 below EP64 (its FFN dies stream 16 experts a "
    "layer); see the module docstring",
)
@pytest.mark.parametrize("input_len", LENGTHS)
def test_published_signs_and_order(model: dict[int, dict[str, float]], input_len: int) -> None:
    row = model[input_len]
    assert row["64:16"] > row["EP64"] > row["48:16"]


@pytest.mark.parametrize("input_len", LENGTHS)
def test_why_the_order_is_out_of_reach(input_len: int) -> None:
    preds = predicted()[input_len]
    # 1. the physical 64:16 is bound by its FFN dies' expert reads.
    assert preds["64:16"].binding.startswith("ffn")
    # 2. removing Attention ranks never slows a step, so 48:16 keeps >= 48/64 / (64/80) of
    #    64:16's per-die rate; the published runs kept 0.851.
    ratio = preds["48:16"].tokens_per_s_per_device / preds["64:16"].tokens_per_s_per_device
    assert ratio >= (48 / 64) / (64 / 80) - 1e-12
    published = PUBLISHED[input_len]
    assert published["48:16"] / published["64:16"] < (48 / 64) / (64 / 80)
