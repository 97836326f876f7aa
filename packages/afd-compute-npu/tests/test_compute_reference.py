"""Reference backend numerics: Layered and Mega against independent float64 and fp32 references,
fp32 tolerance, step-level rounding."""

import struct

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
from afd_compute_npu.reference import (
    _fp32_quotient,
    _int4_dequant,
    combine,
    dynamic_quant_int8,
    expert_gemm1_swiglu_quant,
    expert_gemm2,
    route,
    swiglu,
)
from afd_weights import (
    QuantizedExpertWeights,
    QuantScheme,
    dequantize_layer,
    export_quantized_expert_weights,
    layer_codes,
)

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
    mega.bind(MegaCommParams(group_name="ffn", world_size=1, rank=0, peer_ranks=()))
    return layered, mega


def _int8_round_trip(a: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 round trip in float64: ``round(a / s) * s``, ``s = max|a| / 127``."""
    amax = a.abs().amax(dim=-1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, 1.0)
    return torch.clamp(torch.round(a / step), -127, 127) * step


def float64_moe(
    weights: QuantizedExpertWeights,
    layer_id: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype | None,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """The quantized MoE written plainly in float64, one token and slot at a time.

    ``sum_k p_k * W2_e(q(SwiGLU_L(q(x) W13_e))) * routed_scaling_factor`` over the dequantized
    weights, where ``q`` is the per-row int8 round trip of both GEMM inputs (when
    ``quantize_activations``) and, when ``out_dtype`` is given, the expert outputs, the router
    weights, the combined sum and the scaled result are rounded to ``out_dtype`` where
    :mod:`afd_compute_npu.reference` documents it (steps 6-8). Shares no code with the backend.
    """
    w13, w2 = (t.double() for t in dequantize_layer(weights, layer_id))
    inter, limit = w2.shape[1], weights.swiglu_limit

    def rnd(v: torch.Tensor) -> torch.Tensor:
        return v if out_dtype is None else v.to(out_dtype).double()

    def q(v: torch.Tensor) -> torch.Tensor:
        return _int8_round_trip(v) if quantize_activations else v

    xs = q(x.double())
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e, p = int(ids[t, k]), float(rnd(w[t, k].double()))
            if p == 0.0:
                continue
            h = xs[t : t + 1] @ w13[e]
            g, u = h[:, :inter], h[:, inter:]
            if limit > 0:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += p * rnd(q(g * torch.sigmoid(g) * u) @ w2[e])[0]
    return rnd(rnd(out) * weights.routed_scaling_factor)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


# The backend against float64_moe (bf16 output): both quantize and round at the same documented
# steps, so they differ only where fp32 vs float64 arithmetic flips a bf16 rounding or an int8
# code (measured: >= 95.6 % of elements bit-equal, worst 5.1e-3 of max|ref|, one bf16 step).
# A 3 % error anywhere in the chain exceeds both bounds; so does the unquantized fp32 result
# rounded to bf16 (<= 28 % of elements equal, 8.9e-3 .. 1.7e-2 of max|ref| away).
ONE_BF16_STEP = 2.0**-7
EXACT_SHARE = 0.9
FP32_SHARE = 0.5  # at most this share of elements equal to the unquantized result in bf16
QUANTIZATION_FLOOR = 2e-3  # quantized output vs fp32_dequantized_moe: measurably apart


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
@pytest.mark.parametrize("clamp", [0.0, 10.0])
def test_float64_reference_without_quantization_is_the_fp32_yardstick(
    scheme: QuantScheme, group: int, clamp: float
) -> None:
    """Anchor for the test's own reference: with the activation round trips and output
    roundings off it is fp32_dequantized_moe; with them on it is measurably not."""
    weights = make_weights(scheme, group, clamp, rsf=1.5)
    x, ids, w = make_inputs(11, seed=8)
    for layer_id in weights.layer_ids:
        fp32 = fp32_dequantized_moe(weights, layer_id, x, ids, w)
        plain = float64_moe(weights, layer_id, x, ids, w, None, quantize_activations=False)
        assert _rel_err(plain, fp32) <= 1e-5
        quantized = float64_moe(weights, layer_id, x, ids, w, torch.bfloat16)
        assert QUANTIZATION_FLOOR <= _rel_err(quantized, fp32) <= FP32_TOLERANCE


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
@pytest.mark.parametrize("clamp", [0.0, 10.0])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_layered_and_mega_match_a_float64_reference_and_differ_from_fp32(
    scheme: QuantScheme, group: int, clamp: float, tokens: int
) -> None:
    weights = make_weights(scheme, group, clamp, rsf=1.5)
    layered, mega = build(weights)
    x, ids, w = make_inputs(tokens)
    for layer_id in weights.layer_ids:
        a = layered(layer_id, x, ids, w).clone()
        b = mega(layer_id, x, ids, w).clone()
        assert a.shape == b.shape == (tokens, H)
        assert a.dtype == b.dtype == torch.bfloat16
        if tokens:
            ref = float64_moe(weights, layer_id, x, ids, w, torch.bfloat16)
            fp32 = fp32_dequantized_moe(weights, layer_id, x, ids, w)
            for out in (a, b):
                assert _rel_err(out, ref) <= ONE_BF16_STEP
                assert (out.double() == ref).double().mean() >= EXACT_SHARE
                assert QUANTIZATION_FLOOR <= _rel_err(out, fp32) <= FP32_TOLERANCE
                assert (out == fp32.to(torch.bfloat16)).double().mean() <= FP32_SHARE
        assert torch.equal(a, b)  # in addition: one rank's Mega runs the Layered steps


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


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
@pytest.mark.parametrize("clamp", [0.0, 10.0])
def test_padding_rows_are_exactly_zero_in_every_scheme(
    scheme: QuantScheme, group: int, clamp: float
) -> None:
    weights = make_weights(scheme, group, clamp, rsf=1.5)
    layered, mega = build(weights)
    x, ids, w = make_inputs(12, seed=6)
    pad = [0, 3, 4, 11]
    keep = [i for i in range(12) if i not in pad]
    x[pad] = 0.0
    for layer_id in weights.layer_ids:
        alone = layered(layer_id, x[keep], ids[keep], w[keep]).clone()
        assert alone.abs().amax(dim=-1).min() > 0
        for comp in (layered, mega):
            out = comp(layer_id, x, ids, w).clone()
            assert torch.equal(out[pad], torch.zeros(len(pad), H, dtype=torch.bfloat16))
            assert torch.equal(out[keep], alone)  # the other rows do not see the padding
            only = comp(layer_id, x[:1], ids[:1], w[:1])
            assert torch.equal(only, torch.zeros(1, H, dtype=torch.bfloat16))


@pytest.mark.parametrize(("scheme", "group"), SCHEMES)
def test_zero_code_rows_give_exact_zero_at_both_gemms(scheme: QuantScheme, group: int) -> None:
    weights = make_weights(scheme, group, 0.0)
    codes = layer_codes(weights, 5)
    int4 = scheme.is_int4
    q = torch.zeros(3, H, dtype=torch.int8)
    q[1] = torch.arange(H, dtype=torch.int8) - 32
    q[1, 0] = 127
    s = torch.tensor([1.0, 0.02, 1.0])
    q_a, s_a = expert_gemm1_swiglu_quant(q, s, 4, codes, int4, 0.0)
    assert torch.equal(q_a[[0, 2]], torch.zeros(2, INTER, dtype=torch.int8))
    assert s_a[[0, 2]].tolist() == [1.0, 1.0]
    assert q_a[1].abs().max() == 127
    y = expert_gemm2(q_a, s_a, 4, codes, int4, torch.bfloat16)
    assert torch.equal(y[[0, 2]], torch.zeros(2, H, dtype=torch.bfloat16))
    assert y[1].abs().max() > 0


def test_int4_split_residue_is_dropped_for_zero_rows() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randint(-8, 8, (64, 48), generator=g, dtype=torch.int8)
    s = torch.rand(2, 48, generator=g) + 0.5
    bias = 8.0 * (w.float() * s.repeat_interleave(32, dim=0)).sum(0)
    # without the zero-row rule the split leaves C_lo + B = fp32(-8 sum W) s + B != 0
    residue = sum((-8 * w[i * 32 : (i + 1) * 32].float().sum(0)) * s[i] for i in range(2))
    assert (residue + bias).abs().max() > 0
    q = torch.zeros(2, 64, dtype=torch.int8)
    q[1, 5] = -1
    got = _int4_dequant(q, w, s, bias)
    assert torch.equal(got[0], torch.zeros(48))
    exact = q[1].double() @ w.double().reshape(2, 32, 48).mul(s.double().unsqueeze(1)).reshape(
        64, 48
    )
    assert torch.allclose(got[1].double(), exact, rtol=1e-5, atol=1e-3)


def test_dynamic_quant_rounding() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, -1.0, 1.0 / 254]])
    q, s = dynamic_quant_int8(x)
    assert q.tolist() == [[127, -64, 32, 0], [0, 0, 0, 0], [127, 64, -64, 0]]
    # 63.5 -> 64 (half to even), 31.75 -> 32, 0.25 -> 0
    assert s[1].item() == 1.0
    assert s[0].item() == (1.0 / torch.tensor(127.0)).item()
    assert s[2].item() == (1.0 / (torch.tensor(127.0) / 2.0)).item()


def _fp32(v: float) -> float:
    """Round a Python float (float64) to the nearest fp32, half to even (CPython's float cast)."""
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


def _expected_quant(x: torch.Tensor) -> tuple[list[float], torch.Tensor, list[float], int]:
    """Independent per-row ``inv = fp32(127/amax)``, codes, ``scale = fp32(1/inv)`` and tie count.

    The quotients are Python float64 divisions rounded once to fp32 (correct rounding for fp32
    operands); the product ``x * inv`` of two fp32 values is exact in float64, then rounded once.
    """
    xd = x.double()
    amax = xd.abs().amax(dim=-1).tolist()
    inv = [_fp32(127.0 / a) if a else 0.0 for a in amax]
    scale = [_fp32(1.0 / i) if i else 1.0 for i in inv]
    prod = (xd * torch.tensor(inv, dtype=torch.float64).unsqueeze(-1)).float()
    ties = int((prod - prod.floor() == 0.5).sum())
    return inv, torch.clamp(torch.round(prod), -127, 127).to(torch.int8), scale, ties


def test_dynamic_quant_smallest_double_rounding_case_is_exact() -> None:
    # 127 / 2.375 = 53.47368421...: fp32 53.473682 (PyTorch's 127 * (1/2.375) gives 53.473686);
    # 1.1875 * inv = 63.49999... -> 63 (the twice-rounded inv gives the tie 63.5 -> 64).
    x = torch.tensor([[2.375, 1.1875]])
    inv = _fp32_quotient(127.0, torch.tensor([2.375]))
    assert inv.dtype == torch.float32
    assert inv.item() == float.fromhex("0x1.abca1ap+5") == _fp32(127.0 / 2.375)
    assert f"{inv.item():.8g}" == "53.473682"
    q, s = dynamic_quant_int8(x)
    assert q.tolist() == [[127, 63]]
    assert s.tolist() == [float.fromhex("0x1.3264cap-6")] == [_fp32(1.0 / inv.item())]
    assert f"{s.item():.8g}" == "0.018700788"
    for dtype in (torch.bfloat16, torch.float16):  # both values are exact in the narrow dtypes
        qn, sn = dynamic_quant_int8(x.to(dtype))
        assert torch.equal(qn, q) and torch.equal(sn, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (300, 96), (64, 4096)])
def test_dynamic_quant_matches_an_independent_float64_computation(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    r, c = shape
    magnitude = torch.pow(10.0, torch.empty(r, 1).uniform_(-4, 4, generator=g))
    x = (torch.randn(r, c, generator=g) * magnitude).to(dtype)
    inv, q_ref, s_ref, _ = _expected_quant(x)
    got = _fp32_quotient(127.0, x.float().abs().amax(dim=-1))
    assert got.tolist() == inv
    q, s = dynamic_quant_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.equal(q, q_ref)
    assert s.tolist() == s_ref


def test_dynamic_quant_rounding_ties_of_arbitrary_row_maxima() -> None:
    # bf16 rows: the maximum is an arbitrary (non power of two) bf16 value in [1, 4) and the row
    # holds every bf16 value in (0, amax], so many products x * inv land exactly on k + 0.5.
    g = torch.Generator().manual_seed(5)
    grid = (
        torch.arange(0x3B80, 0x4080, dtype=torch.int16).view(torch.bfloat16).float()
    )  # ~[2^-8, 4)
    maxima = grid[(grid >= 1) & (grid < 4)]
    maxima = maxima[torch.frexp(maxima).mantissa != 0.5]  # no powers of two
    maxima = maxima[torch.randperm(maxima.numel(), generator=g)[:96]]
    x = torch.stack([torch.where(grid <= m, grid, 0.0) for m in maxima]).to(torch.bfloat16)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0).to(torch.bfloat16)
    inv, q_ref, s_ref, ties = _expected_quant(x)
    assert ties >= 100
    assert _fp32_quotient(127.0, x.float().abs().amax(dim=-1)).tolist() == inv
    q, s = dynamic_quant_int8(x)
    assert torch.equal(q, q_ref)
    assert s.tolist() == s_ref


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
