"""Predictions on hand-computed cases: the serial step (S = 1), the ping-pong period for S = 2
(an exposed chain, a weight-bound FFN that splitting slows, compute-bound roles that splitting
overlaps), the colocated baseline, the memory refusal and the search's order and limits.

Inputs: the round device and tiny Qwen3-MoE of ``afd_plan_inputs`` (2 MoE layers, no dense
layer, no shared experts), balanced routing, input 10 / output 2 tokens -> mean context 11.
"""

from __future__ import annotations

import pytest
from afd_plan.errors import AFDPlanError, AFDPlanMemoryError
from afd_plan.hardware import HardwareProfile
from afd_plan.plan import Candidate, memory_per_role, predict, search
from afd_plan.shape import ModelShape
from afd_plan.workload import Workload

W = Workload(input_len=10, output_len=2, routing="balanced")


def test_serial_step(tiny: ModelShape, device: HardwareProfile) -> None:
    # t_a: 24576 B weights + 2 seqs * 11 * 128 B KV = 27392 B -> 273.92 ns (memory).
    # t_f: 2 tokens * k=2 -> 4 pairs -> 4 experts * 12288 B = 49152 B -> 491.52 ns.
    # t_c: F=1, 2 * 128 B = 256 B: 1 us + 10 us + 25.6 ns = 11.0256 us each way.
    # P = 0.27392 + 0.49152 + 2 * 11.0256 = 22.81664 us; head 12800 B -> 0.128 us.
    # TPOT = 2 layers * 22.81664 + 0.128 = 45.76128 us.
    p = predict(tiny, W, device, Candidate(1, 1, 1, 2))
    assert p.moe_layer.attention.seconds == pytest.approx(273.92e-9)
    assert p.moe_layer.experts.seconds == pytest.approx(491.52e-9)
    assert p.moe_layer.transfer.seconds == pytest.approx(11.0256e-6)
    assert p.tpot_s == pytest.approx(45.76128e-6)
    assert p.tokens_per_s == pytest.approx(2 / 45.76128e-6)
    assert p.tokens_per_s_per_device == pytest.approx(1 / 45.76128e-6)
    assert p.binding == "link"


def test_engine_software_is_paid_once_per_step(tiny: ModelShape, device: HardwareProfile) -> None:
    # The serial step above (45.76128 us) + step 1 ms + 2 sequences x 0.25 ms = 1545.76128 us;
    # with two stages the same 1.5 ms on top of 45.3184 us (once per step, not per stage).
    engine = device.with_overrides(step_overhead=1e-3, sequence_overhead=0.25e-3)
    assert predict(tiny, W, engine, Candidate(1, 1, 1, 2)).tpot_s == pytest.approx(1545.76128e-6)
    assert predict(tiny, W, engine, Candidate(1, 1, 2, 2)).tpot_s == pytest.approx(1545.3184e-6)


def test_two_stages_with_an_exposed_chain(tiny: ModelShape, device: HardwareProfile) -> None:
    # mb = 1: t_a 24576 + 1408 = 25984 B -> 259.84 ns; t_f 2 experts -> 245.76 ns;
    # t_c 1 us + 10 us + 12.8 ns = 11.0128 us, occupancy o = 1.0128 us.
    # P = max(2*0.25984, 2*0.24576, 2*1.0128, 0.25984 + 0.24576 + 2*11.0128 = 22.5312) us.
    # head 2 * 0.128 us. TPOT = 2 * 22.5312 + 0.256 = 45.3184 us.
    p = predict(tiny, W, device, Candidate(1, 1, 2, 2))
    assert p.moe_layer.period == pytest.approx(22.5312e-6)
    assert p.tpot_s == pytest.approx(45.3184e-6)
    assert p.binding == "chain: link"


def test_splitting_a_weight_bound_ffn_costs(tiny: ModelShape, device: HardwareProfile) -> None:
    free_link = device.with_overrides(link_latency=0, message_overhead=0, link_bandwidth=1e15)
    # A=4, F=1, b=8. S=1: t_a(8) = 24576 + 8*1408 = 35840 B -> 358.4 ns; t_f(32 tokens):
    # all 8 experts, 98304 B -> 983.04 ns; P ~ 1341.44 ns.
    one = predict(tiny, W, free_link, Candidate(4, 1, 1, 8))
    assert one.moe_layer.period == pytest.approx(1341.44e-9, rel=1e-4)
    # S=2: t_a(4) = 30208 B -> 302.08 ns; t_f(16 tokens) still reads all 8 experts: 983.04 ns;
    # P = max(604.16, 1966.08, ~0, 1285.12) = 1966.08 ns: the FFN re-reads its weights.
    two = predict(tiny, W, free_link, Candidate(4, 1, 2, 8))
    assert two.moe_layer.period == pytest.approx(1966.08e-9, rel=1e-4)
    assert two.binding == "ffn memory" and two.tpot_s > one.tpot_s


def test_two_stages_overlap_compute_bound_roles(tiny: ModelShape, device: HardwareProfile) -> None:
    free_link = device.with_overrides(link_latency=0, message_overhead=0, link_bandwidth=1e15)
    work = Workload(input_len=1, output_len=1, routing="balanced")  # context 1.5
    # b=2000, A=F=1. Per token: attention 2*12288 + 4*4*16*1.5 = 24960 FLOPs; experts
    # 2 pairs * 2 * 6144 = 24576 FLOPs. S=1: 2000 * (24960 + 24576) / 1e12 = 99.072 us.
    one = predict(tiny, work, free_link, Candidate(1, 1, 1, 2000))
    assert one.moe_layer.period == pytest.approx(99.072e-6, rel=1e-4)
    # S=2: P = max(2 * 24.96, 2 * 24.576, chain 24.96 + 24.576) us = 49.92 us: both roles busy.
    two = predict(tiny, work, free_link, Candidate(1, 1, 2, 2000))
    assert two.moe_layer.period == pytest.approx(49.92e-6, rel=1e-4)
    assert two.binding == "attention compute"


def test_messages_on_the_roles_compute_are_not_hidden_by_stages(
    tiny: ModelShape, device: HardwareProfile
) -> None:
    """``messages_use_compute`` (a CPU host): each role's busy time holds its own messages both
    ways; the link keeps only the wire."""
    work = Workload(input_len=1, output_len=1, routing="balanced")
    slow = device.with_overrides(link_latency=0, message_overhead=5e-6, link_bandwidth=1e15)
    host = slow.with_overrides(messages_use_compute=True)
    # b=2000, S=2: per micro-batch t_a 24.96 us, t_f 24.576 us (as above); one direction
    # t_c = 5 us + 1000 tokens * 128 B / 1e15 = 5.000128 us.
    # Device: P = max(49.92, 49.152, 2 * 5.000128, chain 24.96 + 24.576 + 2 * 5.000128)
    #           = 59.536256 us (the chain).
    dev = predict(tiny, work, slow, Candidate(1, 1, 2, 2000))
    assert dev.moe_layer.period == pytest.approx(59.536256e-6, rel=1e-6)
    # Host: attention 2 * (24.96 + 2 * 5) = 69.92 us, FFN 2 * (24.576 + 10) = 69.152 us, link
    # 2 * 0.000128 us: P = 69.92 us, the stages hide nothing of the messages.
    on_host = predict(tiny, work, host, Candidate(1, 1, 2, 2000))
    assert on_host.moe_layer.period == pytest.approx(69.92e-6, rel=1e-6)
    assert on_host.binding == "attention compute"
    # One stage, either profile: the chain 49.92 + 49.152 + 2 * 5.000256 = 109.072512 us.
    for profile in (slow, host):
        one = predict(tiny, work, profile, Candidate(1, 1, 1, 2000))
        assert one.moe_layer.period == pytest.approx(109.072512e-6, rel=1e-6)


def test_on_a_cpu_host_a_direction_pays_one_message_whatever_the_peers(
    tiny: ModelShape, device: HardwareProfile
) -> None:
    """``messages_use_compute``: the messages to (or from) every peer are in flight together, so
    one direction costs one ``message_overhead`` at each end; a device pays one per peer."""
    from afd_plan.cost import message_costs

    slow = device.with_overrides(link_latency=0, message_overhead=5e-6, link_bandwidth=1e15)
    host = slow.with_overrides(messages_use_compute=True)
    assert message_costs(slow, 2, 4) == (4 * 5e-6, 2 * 5e-6)
    assert message_costs(host, 2, 4) == (5e-6, 5e-6)
    work = Workload(input_len=1, output_len=1, routing="balanced")
    # 1 Attention : 2 FFN, b=2000, S=2 on the host: per micro-batch t_a 24.96 us; the busiest
    # FFN rank's experts serve 1000 tokens * 2 / 2 ranks = 1000 pairs: 12.288 us. Attention
    # 2 * (24.96 + 2 * 5) = 69.92 us, as at 1:1: the second FFN rank costs no message.
    two_ffn = predict(tiny, work, host, Candidate(1, 2, 2, 2000))
    assert two_ffn.moe_layer.period == pytest.approx(69.92e-6, rel=1e-6)
    # On the device the Attention end posts one message per FFN rank: its exchange is 2 * 5 us.
    dev = predict(tiny, work, slow, Candidate(1, 2, 2, 2000))
    assert dev.moe_layer.transfer.seconds == pytest.approx(10e-6, rel=1e-3)


def test_a_role_busy_with_its_messages_is_named(tiny: ModelShape, device: HardwareProfile) -> None:
    host = device.with_overrides(link_latency=0, messages_use_compute=True)
    # mb = 1 (b=2, S=2): t_a 0.25984 us, t_f 0.24576 us, m = 1 us, wire 12.8 ns.
    # attention 2 * (0.25984 + 2) = 4.51968 us > FFN 4.49152 > chain 2.5312 > link 0.0256.
    p = predict(tiny, W, host, Candidate(1, 1, 2, 2))
    assert p.moe_layer.period == pytest.approx(4.51968e-6)
    assert p.binding == "attention messages"


def test_more_engines_than_host_cores_stretch_the_step(
    tiny: ModelShape, device: HardwareProfile
) -> None:
    host = device.with_overrides(host_cores=2)
    for cand, stretch in (
        (Candidate(1, 1, 1, 4), 1.0),  # two engines on two cores
        (Candidate(1, 2, 1, 4), 1.5),
        (Candidate(2, 1, 1, 4), 1.5),
        (Candidate(2, 2, 1, 4), 2.0),
        (Candidate(1, 0, 1, 4), 1.0),  # plain: one engine
    ):
        alone = predict(tiny, W, device, cand)
        shared = predict(tiny, W, host, cand)
        assert shared.tpot_s == pytest.approx(stretch * alone.tpot_s)
        if stretch > 1:
            assert shared.binding == f"host cores ({cand.devices} engines on 2)"
        else:
            assert shared.binding == alone.binding


def test_colocated_baseline(tiny: ModelShape, device: HardwareProfile) -> None:
    # EP2, b=2: t_a 273.92 ns; experts for 4 tokens over 2 ranks: 4 pairs on the busiest ->
    # 4 experts, 49152 B -> 491.52 ns; all-to-all: fanout 1.5, remote 0.75 -> 192 B:
    # 1 us + 10 us + 19.2 ns = 11.0192 us, twice. P = 0.76544 + 22.0384 = 22.80384 us.
    p = predict(tiny, W, device, Candidate(2, 0, 1, 2))
    assert p.moe_layer.period == pytest.approx(22.80384e-6)
    assert p.tpot_s == pytest.approx(2 * 22.80384e-6 + 0.128e-6)
    assert p.tokens_per_s_per_device == pytest.approx(2 / p.tpot_s)
    assert set(p.memory) == {"colocated"}


def test_memory_per_role(tiny: ModelShape) -> None:
    m = memory_per_role(tiny, W, Candidate(1, 1, 1, 1))
    assert m["attention"]["embeddings"] == 2 * 100 * 64 * 2
    assert m["attention"]["attention_weights"] == 2 * 12288 * 2
    assert m["attention"]["kv_cache"] == 1 * 12 * 2 * 64 * 2  # b * (10 + 2) * L * elems * 2 B
    assert m["ffn"]["expert_weights"] == 8 * 2 * 6144 * 2
    assert memory_per_role(tiny, W, Candidate(1, 2, 1, 1, "w4a8"))["ffn"]["expert_weights"] == (
        4 * 2 * 6144 * 0.5
    )


def test_memory_refusal_names_role_and_bytes(tiny: ModelShape, device: HardwareProfile) -> None:
    small = device.with_overrides(memory_bytes=100_000)
    with pytest.raises(AFDPlanMemoryError) as err:
        predict(tiny, W, small, Candidate(1, 1, 1, 1))
    e = err.value
    needed = sum(memory_per_role(tiny, W, Candidate(1, 1, 1, 1))["ffn"].values())
    assert e.role == "ffn" and e.needed_bytes == needed and e.available_bytes == 100_000
    assert "the ffn role does not fit" in str(e) and f"needs {needed:.0f} bytes" in str(e)
    assert "holds 100000 bytes" in str(e) and "expert_weights" in str(e)


def test_kv_cache_refusal_names_the_attention_role(
    tiny: ModelShape, device: HardwareProfile
) -> None:
    long = Workload(input_len=1_000_000, output_len=1, routing="balanced")
    with pytest.raises(AFDPlanMemoryError, match="the attention role does not fit") as err:
        predict(tiny, long, device, Candidate(1, 1, 1, 64))
    assert err.value.breakdown["kv_cache"] > device.usable_memory


def test_search_order_budget_and_target(tiny: ModelShape, device: HardwareProfile) -> None:
    result = search(tiny, W, device, devices=6, tpot_target_s=60e-6, batches=(1, 4, 16))
    assert result.candidates
    rates = [p.tokens_per_s_per_device for p in result.candidates]
    assert rates == sorted(rates, reverse=True)
    assert all(p.candidate.devices <= 6 and p.tpot_s <= 60e-6 for p in result.candidates)
    assert all(not p.candidate.colocated for p in result.candidates)
    assert set(result.baselines) <= set(range(2, 7))
    assert all(b.candidate.colocated for b in result.baselines.values())
    assert result.over_tpot > 0


def test_search_counts_memory_refusals(tiny: ModelShape, device: HardwareProfile) -> None:
    small = device.with_overrides(memory_bytes=150_000)
    result = search(tiny, W, small, devices=4, batches=(1,), expert_quants=("none",))
    assert result.refused_memory and all(e.role for e in result.refused_memory)
    assert all(
        p.candidate.num_ffn >= 2 for p in result.candidates
    )  # one rank cannot hold 8 bf16 experts


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_attention": 0}, "num_attention"),
        ({"stages": 4}, "stages"),
        ({"batch": 0}, "batch"),
        ({"expert_quant": "fp4"}, "expert_quant"),
    ],
)
def test_bad_candidate(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"num_attention": 1, "num_ffn": 1, "stages": 1, "batch": 1}
    args.update(kwargs)
    with pytest.raises(AFDPlanError) as err:
        Candidate(**args)  # type: ignore[arg-type]
    assert err.value.field == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_len": 0}, "input_len"),
        ({"kv_dtype": "fp4"}, "kv_dtype"),
        ({"routing": "zipf"}, "routing"),
        ({"expert_skew": 0.5}, "expert_skew"),
        ({"dense_quant": "int3"}, "dense_quant"),
    ],
)
def test_bad_workload(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(AFDPlanError) as err:
        Workload(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
