"""Each cost term on hand-computed cases (the round device of ``afd_plan_inputs``: 1e12 FLOP/s
bf16, 2e12 int8, 1e11 B/s memory, 1e10 B/s link, 10 us latency, 1 us a message; the tiny
Qwen3-MoE: H=64, 4 heads / 2 KV heads of 16, E=8, k=2, I=32, bf16)."""

from __future__ import annotations

import pytest
from afd_plan.cost import (
    all_to_all_time,
    attention_time,
    expert_time,
    experts_hit,
    fanout,
    lm_head_time,
    mlp_time,
    transfer_time,
)
from afd_plan.hardware import HardwareProfile
from afd_plan.shape import ModelShape
from afd_plan.workload import Workload

W = Workload()
BALANCED = Workload(routing="balanced")


def test_attention_memory_bound(tiny: ModelShape, device: HardwareProfile) -> None:
    # weights: q,o 2*64*4*16 = 8192 + k,v 2*64*2*16 = 4096 -> 12288 params * 2 B = 24576 B
    # KV: 2 seqs * 10 tokens * (2*2*16 = 64 elems) * 2 B = 2560 B  -> 27136 B / 1e11 = 271.36 ns
    # FLOPs: 2 * (2*12288 + 4*4*16*10) = 54272 -> 54.272 ns: memory binds.
    t = attention_time(tiny, W, device, batch=2, context=10)
    assert t.bytes == 27136 and t.flops == 54272 and t.bound == "memory"
    assert t.seconds == pytest.approx(271.36e-9)


def test_attention_compute_bound(tiny: ModelShape, device: HardwareProfile) -> None:
    # 1000 seqs at context 1: bytes 24576 + 1000*1*64*2 = 152576 -> 1.52576 us;
    # FLOPs 1000 * 2*(24576/2*2 ... ) = 1000 * (2*12288 + 4*64*1) = 24,832,000 -> 24.832 us.
    t = attention_time(tiny, W, device, batch=1000, context=1)
    assert t.flops == 1000 * (2 * 12288 + 4 * 4 * 16 * 1) and t.bound == "compute"
    assert t.seconds == pytest.approx(24.832e-6)


def test_kv_efficiency_slows_only_the_kv_reads(tiny: ModelShape, device: HardwareProfile) -> None:
    # KV 2560 B at 0.5 * 1e11 -> 51.2 ns instead of 25.6 ns; weights unchanged (245.76 ns).
    t = attention_time(tiny, W, device.with_overrides(kv_efficiency=0.5), batch=2, context=10)
    assert t.seconds == pytest.approx(245.76e-9 + 51.2e-9)


def test_layer_overhead_adds(tiny: ModelShape, device: HardwareProfile) -> None:
    t = attention_time(tiny, W, device.with_overrides(layer_overhead=1e-6), batch=2, context=10)
    assert t.seconds == pytest.approx(271.36e-9 + 1e-6)


def test_mlp(tiny: ModelShape, device: HardwareProfile) -> None:
    # 3*64*128 = 24576 params: 49152 B -> 491.52 ns; FLOPs 4 * 2 * 24576 = 196608 -> 196.6 ns.
    t = mlp_time(tiny, W, device, tokens=4, intermediate=128)
    assert t.seconds == pytest.approx(491.52e-9) and t.flops == 196608
    assert mlp_time(tiny, W, device, tokens=4, intermediate=0).seconds == 0


def test_without_overlap_a_term_adds_its_memory_and_compute_time(
    tiny: ModelShape, device: HardwareProfile
) -> None:
    # As test_expert_time_weight_bound: 336 ns of weights and 49.152 ns of FLOPs; one CPU core
    # (compute_overlaps_memory false) pays both: 385.152 ns, still named by the larger side.
    serial = device.with_overrides(compute_overlaps_memory=False)
    t = expert_time(tiny, W, serial, tokens=4, ranks=2, expert_quant="none")
    assert t.seconds == pytest.approx(385.152e-9) and t.bound == "memory"


def test_experts_hit_uniform_and_balanced(tiny: ModelShape) -> None:
    # 4 tokens over 2 ranks: E_loc = 4; uniform 4 * (1 - (1 - 2/8)^4) = 4 * 0.68359375.
    assert experts_hit(tiny, W, 4, 2) == pytest.approx(2.734375)
    # balanced: pairs on the rank 4*2/2 = 4 -> all 4 local experts.
    assert experts_hit(tiny, BALANCED, 4, 2) == 4
    assert experts_hit(tiny, BALANCED, 1, 2) == 1  # 1*2/2 = 1 pair, 1 expert
    assert experts_hit(tiny, W, 10_000, 2) == pytest.approx(4)


def test_expert_time_weight_bound(tiny: ModelShape, device: HardwareProfile) -> None:
    # expert 3*64*32 = 6144 params; 2.734375 hit * 6144 * 2 B = 33600 B -> 336 ns;
    # pairs 4 * 2 / 2 = 4 -> 4 * 2 * 6144 = 49152 FLOPs -> 49.152 ns.
    t = expert_time(tiny, W, device, tokens=4, ranks=2, expert_quant="none")
    assert t.bytes == pytest.approx(33600) and t.flops == 49152
    assert t.seconds == pytest.approx(336e-9) and t.bound == "memory"


def test_expert_quantization(tiny: ModelShape, device: HardwareProfile) -> None:
    # W8A8 halves the bytes of bf16; W4A8 quarters them; both compute at the int8 rate.
    bf16 = expert_time(tiny, BALANCED, device, 4, 2, "none").bytes
    assert expert_time(tiny, BALANCED, device, 4, 2, "w8a8").bytes == bf16 / 2
    assert expert_time(tiny, BALANCED, device, 4, 2, "w4a8").bytes == bf16 / 4
    # compute bound at 10^6 tokens: pairs 10^6 -> 1.2288e10 FLOPs at 2e12 int8 = 6.144 ms.
    t = expert_time(tiny, BALANCED, device, 1e6, 2, "w8a8")
    assert t.bound == "compute" and t.seconds == pytest.approx(6.144e-3)


def test_expert_skew_loads_the_hottest_rank(tiny: ModelShape, device: HardwareProfile) -> None:
    skewed = Workload(routing="balanced", expert_skew=1.5)
    t = expert_time(tiny, skewed, device, tokens=1e6, ranks=2, expert_quant="none")
    assert t.flops == pytest.approx(1.5 * 1e6 * 2 / 2 * 2 * 6144)


def test_fanout() -> None:
    from afd_plan.shape import shape_from_config

    assert fanout(shape_from_config(_cfg(k=2)), 2) == pytest.approx(1.5)  # 2 * (1 - 1/4)
    assert fanout(shape_from_config(_cfg(k=2)), 1) == 1
    assert fanout(shape_from_config(_cfg(k=8)), 16) == pytest.approx(16 * (1 - (15 / 16) ** 8))


def _cfg(k: int) -> dict[str, object]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from afd_plan_inputs import TINY_QWEN3

    return {**TINY_QWEN3, "num_experts": 256, "num_experts_per_tok": k}


def test_transfer_slower_end(tiny: ModelShape, device: HardwareProfile) -> None:
    # b=2, A=3, F=2: fanout 1.5 -> 1.5 * 64 * 2 B = 192 B a token.
    # Attention end: 2 msgs * 1 us + 10 us + 384 B / 1e10 = 12.0384 us.
    # FFN end: 3 msgs * 1 us + 10 us + (3 * 2 * 192 / 2 = 576 B) / 1e10 = 13.0576 us.
    t = transfer_time(tiny, device, batch=2, num_attention=3, num_ffn=2)
    assert t.seconds == pytest.approx(13.0576e-6) and t.bytes == 384


def test_all_to_all(tiny: ModelShape, device: HardwareProfile) -> None:
    # N=4, b=2: fanout 4 * (1 - (3/4)^2) = 1.75, remote 1.75 * 3/4 = 1.3125;
    # 2 * 1.3125 * 64 * 2 = 336 B; 3 msgs * 1 us + 10 us + 336 / 1e10 = 13.0336 us.
    t = all_to_all_time(tiny, device, batch=2, ranks=4)
    assert t.bytes == pytest.approx(336) and t.seconds == pytest.approx(13.0336e-6)
    assert all_to_all_time(tiny, device, batch=2, ranks=1).seconds == 0


def test_lm_head(tiny: ModelShape, device: HardwareProfile) -> None:
    # 100 * 64 = 6400 params * 2 B = 12800 B -> 128 ns.
    assert lm_head_time(tiny, device, batch=1).seconds == pytest.approx(128e-9)


def test_linear_attention_reads_its_state_not_the_context(device: HardwareProfile) -> None:
    from afd_plan.shape import AttentionShape

    att = AttentionShape(
        kind="linear",
        num_heads=4,
        linear_k_heads=2,
        linear_v_heads=2,
        linear_k_dim=8,
        linear_v_dim=8,
        conv_kernel=4,
    )
    shape = _tiny_shape()
    # params (H=64, Dk=16, Dv=16): 64*48 + 64*16 + 2*64*2 + 48*4 + 16*64
    # = 3072 + 1024 + 256 + 192 + 1024 = 5568 -> 11136 B.
    assert att.weight_params(64) == 5568
    # state: 2*8*8*4 = 512 B recurrent + 48 * 3 * 2 = 288 B conv = 800 B, read and written:
    # 2 seqs * 1600 B = 3200 B; total 14336 B -> 143.36 ns at any context.
    short = attention_time(shape, W, device, batch=2, context=10, att=att)
    long = attention_time(shape, W, device, batch=2, context=100_000, att=att)
    assert short.seconds == long.seconds == pytest.approx(143.36e-9)
    assert short.flops == 2 * (2 * 5568 + 6 * 2 * 8 * 8)


def _tiny_shape() -> ModelShape:
    import sys
    from pathlib import Path

    from afd_plan.shape import shape_from_config

    sys.path.insert(0, str(Path(__file__).parent))
    from afd_plan_inputs import TINY_QWEN3

    return shape_from_config(TINY_QWEN3)
