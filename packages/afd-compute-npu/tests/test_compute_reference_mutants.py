"""Reference steps at the edges the other tests did not reach: bf16 rounding of the router
weights and of GEMM2's output, a SwiGLU limit below 1, a routed scaling factor of exactly 2, rows
without columns, the float64 integer GEMM's dtype.

Written for the mutation check (CONTRIBUTING, "Mutation check"): each test kills mutants of
``afd_compute_npu/reference.py`` that survived the first run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from afd_compute_npu.reference import (
    _int_gemm_float64,
    combine,
    dynamic_quant_int8,
    expert_gemm2,
    swiglu,
)
from afd_weights import QuantScheme, layer_codes

sys.path.insert(0, str(Path(__file__).parent))
from test_compute_reference import build, make_inputs, make_weights


def test_combine_rounds_the_router_weights_to_out_dtype_first() -> None:
    """Step 7: ``p = fp32(out_dtype(topk_weights))``. 0.3 is not a bf16 value (0.30078125), and
    3 * 0.3 and 3 * 0.30078125 round to different bf16 values."""
    y = torch.tensor([[3.0], [5.0]], dtype=torch.bfloat16)
    w = torch.tensor([[0.3, 0.0]])
    out = combine(y, torch.tensor([0, 1]), w, torch.bfloat16)
    p = float(torch.tensor(0.3).to(torch.bfloat16))
    want = torch.tensor([[3.0 * p]]).to(torch.bfloat16)
    assert not torch.equal(want, torch.tensor([[3.0 * 0.3]]).to(torch.bfloat16))
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    ("scheme", "group"), [(QuantScheme.W8A8, 0), (QuantScheme.W4A8_PER_GROUP, 16)]
)
def test_expert_gemm2_returns_out_dtype(scheme: QuantScheme, group: int) -> None:
    """The Layered path keeps GEMM2's output as it is: it must already be ``out_dtype``."""
    codes = layer_codes(make_weights(scheme, group, 0.0), 5)
    g = torch.Generator().manual_seed(7)
    q_a = torch.randint(-127, 128, (3, codes.w2_codes.shape[1]), generator=g, dtype=torch.int8)
    s_a = torch.rand(3, generator=g) + 0.5
    int4 = scheme is not QuantScheme.W8A8
    for dtype in (torch.bfloat16, torch.float16):
        assert expert_gemm2(q_a, s_a, 4, codes, int4, dtype).dtype == dtype


def test_swiglu_limit_below_one_still_clamps() -> None:
    h = torch.tensor([[0.9, -0.2, 0.8, -0.7]])
    a = swiglu(h, 0.5)
    g = torch.tensor([0.5, -0.2])
    u = torch.tensor([0.5, -0.5])
    assert torch.equal(a, (g / (1 + torch.exp(-g)) * u).unsqueeze(0))


@pytest.mark.parametrize("factor", [2.0, 0.5, 2.5])
@pytest.mark.parametrize("path", ["layered", "mega"])
def test_every_routed_scaling_factor_but_one_multiplies(factor: float, path: str) -> None:
    x, ids, w = make_inputs(9, seed=4)
    which = 0 if path == "layered" else 1
    one = build(make_weights(QuantScheme.W8A8, 0, 0.0, rsf=1.0))[which]
    scaled = build(make_weights(QuantScheme.W8A8, 0, 0.0, rsf=factor))[which]
    base = one(5, x, ids, w).clone()
    assert torch.equal(scaled(5, x, ids, w), base * factor)
    assert not torch.equal(base * factor, base)


def test_rows_without_columns_quantize_to_nothing_with_unit_scales() -> None:
    q, scale = dynamic_quant_int8(torch.zeros(3, 0))
    assert q.shape == (3, 0) and q.dtype == torch.int8
    assert scale.tolist() == [1.0, 1.0, 1.0]


def test_the_float64_integer_gemm_returns_int32() -> None:
    a = torch.ones(2, 4, dtype=torch.int8)
    assert _int_gemm_float64(a, a.t().contiguous()).dtype == torch.int32
