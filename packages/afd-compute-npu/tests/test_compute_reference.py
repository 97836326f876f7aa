"""Reference backend numerics: Layered == Mega bit for bit, fp32 tolerance, step-level rounding."""

import pytest
import torch
from afd_compute_npu import (
    FP32_TOLERANCE,
    ComputeConfig,
    LayeredCompute,
    MegaCommParams,
    MegaCompute,
    ReferenceBackend,
    fp32_dequantized_moe,
)
from afd_compute_npu.reference import combine, dynamic_quant_int8, route, swiglu
from afd_weights import QuantizedExpertWeights, QuantScheme, export_quantized_expert_weights

E, H, INTER, K, MAX_T = 8, 64, 32, 2, 40
SCHEMES = [
    (QuantScheme.W8A8, 0),
    (QuantScheme.W4A8_PER_CHANNEL, 0),
    (QuantScheme.W4A8_PER_GROUP, 16),
]


def make_weights(
    scheme: QuantScheme, group: int, clamp: float, rsf: float = 1.0, ids: tuple[int, ...] = (5, 2)
) -> QuantizedExpertWeights:
    g = torch.Generator().manual_seed(11)
    src = {
        i: (torch.randn(E, 2 * INTER, H, generator=g) * 0.3, torch.randn(E, H, INTER, generator=g))
        for i in ids
    }
    return export_quantized_expert_weights(
        src, scheme=scheme, group_size=group, swiglu_limit=clamp, routed_scaling_factor=rsf
    )


def make_inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(t)]
    ids = (torch.stack(rows) if rows else torch.zeros(0, K)).to(torch.int32)
    w = torch.softmax(torch.randn(t, K, generator=g), -1).to(torch.bfloat16)
    return x, ids, w


def build(weights: QuantizedExpertWeights) -> tuple[LayeredCompute, MegaCompute]:
    cfg = ComputeConfig(
        max_tokens=MAX_T,
        top_k=K,
        swiglu_limit=weights.swiglu_limit,
        routed_scaling_factor=weights.routed_scaling_factor,
    )
    layered = LayeredCompute(weights, cfg, ReferenceBackend())
    mega = MegaCompute(weights, cfg, ReferenceBackend())
    mega.bind(MegaCommParams(group_name="ffn", world_size=2, rank=0, peer_ranks=(1,)))
    return layered, mega


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
@pytest.mark.parametrize("clamp", [0.0, 10.0])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_layered_and_mega_bit_identical_and_within_fp32_tolerance(
    scheme: QuantScheme, group: int, clamp: float, tokens: int
) -> None:
    weights = make_weights(scheme, group, clamp, rsf=1.5)
    layered, mega = build(weights)
    x, ids, w = make_inputs(tokens)
    for layer_id in weights.layer_ids:
        a = layered(layer_id, x, ids, w).clone()
        b = mega(layer_id, x, ids, w).clone()
        assert a.shape == (tokens, H) and a.dtype == torch.bfloat16
        assert torch.equal(a, b)
        if tokens:
            ref = fp32_dequantized_moe(weights, layer_id, x, ids, w)
            err = (a.float() - ref).abs().max() / ref.abs().max()
            assert err <= FP32_TOLERANCE, float(err)


def test_clamp_changes_the_result_and_layers_differ() -> None:
    x, ids, w = make_inputs(16, seed=3)
    x = x * 4
    off, _ = build(make_weights(QuantScheme.W8A8, 0, 0.0))
    on, _ = build(make_weights(QuantScheme.W8A8, 0, 10.0))
    a = off(5, x, ids, w).clone()
    assert not torch.equal(a, on(5, x, ids, w))
    assert not torch.equal(a, off(2, x, ids, w))


def test_routed_scaling_is_a_final_out_dtype_multiply() -> None:
    x, ids, w = make_inputs(9, seed=4)
    one, _ = build(make_weights(QuantScheme.W4A8_PER_CHANNEL, 0, 0.0, rsf=1.0))
    scaled, _ = build(make_weights(QuantScheme.W4A8_PER_CHANNEL, 0, 0.0, rsf=2.5))
    base = one(5, x, ids, w).clone()
    assert torch.equal(scaled(5, x, ids, w), base * 2.5)


def test_dynamic_quant_rounding() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, -1.0, 1.0 / 254]])
    q, s = dynamic_quant_int8(x)
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [127, 64, -64, 0]]
    # 63.5 -> 64 (half to even), 31.75 -> 32, 0.25 -> 0
    assert s[1].item() == 1.0
    assert s[0].item() == (1.0 / torch.tensor(127.0)).item()
    assert s[2].item() == (1.0 / (torch.tensor(127.0) / 2.0)).item()


def test_route_is_a_stable_expert_major_permutation() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, eri, counts = route(ids, 4)
    assert order.tolist() == [1, 2, 3, 5, 0, 4]
    assert eri.tolist() == [4, 0, 1, 2, 5, 3]
    assert counts.tolist() == [2, 2, 2, 0]


def test_combine_order_and_zero_weights() -> None:
    y = torch.tensor([[1.0], [2.0], [float("inf")]], dtype=torch.bfloat16)
    eri = torch.tensor([0, 1, 2])
    w = torch.tensor([[0.5, 0.25, 0.0]])
    out = combine(y, eri, w, torch.bfloat16)
    assert out.tolist() == [[1.0]]  # the zero-weight slot is skipped, not multiplied


def test_swiglu_clamp_definition() -> None:
    h = torch.tensor([[20.0, -20.0, 30.0, -30.0]])
    a = swiglu(h, 10.0)
    g = torch.tensor([10.0, -20.0])
    u = torch.tensor([10.0, -10.0])
    assert torch.equal(a, (g / (1 + torch.exp(-g)) * u).unsqueeze(0))


def test_int4_msd_split_equals_integer_gemm() -> None:
    from afd_compute_npu.reference import _int4_dequant

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (5, 32), generator=g, dtype=torch.int8)
    w = torch.randint(-8, 8, (32, 16), generator=g, dtype=torch.int8)
    s = torch.rand(1, 16, generator=g) + 0.5
    bias = 8.0 * (w.float() * s).sum(0)
    exact = (q.double() @ w.double()) * s.double()
    got = _int4_dequant(q, w, s, bias)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-3)


def test_int_gemm_paths_agree_exactly() -> None:
    from afd_compute_npu.reference import _int_gemm_float64, int_gemm

    g = torch.Generator().manual_seed(2)
    for m in (0, 1, 5, 33):
        a = torch.randint(-127, 128, (m, 48), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (48, 24), generator=g, dtype=torch.int8)
        exact = a.long() @ b.long()
        assert torch.equal(int_gemm(a, b).long(), exact)
        assert torch.equal(_int_gemm_float64(a, b).long(), exact)
        assert int_gemm(a, b).dtype == torch.int32
