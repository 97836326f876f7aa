"""softmax_topk against an independent per-token reference, and its argument checks.

Written for the mutation check (CONTRIBUTING, "Mutation check"): the routing tests elsewhere only
compare softmax_topk with itself across processes, so a changed softmax axis, a dropped
renormalization or a loosened top_k bound went unnoticed.
"""

from __future__ import annotations

import math

import pytest
import torch
from afd_remote import AFDRemoteError, softmax_topk


def _reference(logits: list[list[float]], top_k: int, renormalize: bool) -> list[list[tuple]]:
    """Per token, in plain Python: softmax over the experts, the top_k (probability, id) pairs
    in descending probability (lower id first on ties), optionally scaled to sum to 1."""
    out = []
    for row in logits:
        peak = max(row)
        exps = [math.exp(v - peak) for v in row]
        total = sum(exps)
        probs = [e / total for e in exps]
        ranked = sorted(range(len(row)), key=lambda e: (-probs[e], e))[:top_k]
        kept = [probs[e] for e in ranked]
        if renormalize:
            s = sum(kept)
            kept = [p / s for p in kept]
        out.append(list(zip(kept, ranked, strict=True)))
    return out


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_softmax_topk_matches_reference(top_k: int, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(7 + top_k)
    logits = torch.randn(5, 6, generator=gen, dtype=torch.float64) * 2
    weights, ids = softmax_topk(logits.to(torch.bfloat16), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (5, top_k)
    expected = _reference(logits.to(torch.bfloat16).double().tolist(), top_k, renormalize)
    for t, pairs in enumerate(expected):
        assert ids[t].tolist() == [e for _, e in pairs]
        assert weights[t].tolist() == pytest.approx([p for p, _ in pairs], rel=1e-5, abs=1e-7)
    sums = weights.sum(dim=-1)
    if renormalize:
        assert torch.allclose(sums, torch.ones(5), atol=1e-6)
    elif top_k < 6:
        assert bool((sums < 1).all())


def test_softmax_topk_all_experts_and_ties() -> None:
    # top_k == num_experts is allowed; equal logits tie and resolve lower id first.
    logits = torch.tensor([[0.0, 0.0, 0.0], [1.0, 3.0, 2.0]])
    weights, ids = softmax_topk(logits, 3, False)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 0]]
    assert weights[0].tolist() == pytest.approx([1 / 3] * 3)
    assert float(weights[1].sum()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("shape", "top_k"),
    [((4,), 1), ((2, 3, 4), 1), ((2, 3), 0), ((2, 3), -1), ((2, 3), 4), ((2, 3), True)],
)
def test_softmax_topk_rejects_with_field(shape: tuple[int, ...], top_k: object) -> None:
    with pytest.raises(AFDRemoteError) as info:
        softmax_topk(torch.zeros(shape), top_k, True)  # type: ignore[arg-type]
    err = info.value
    if len(shape) != 2:
        assert err.field == "router_logits"
        assert err.value == shape
        assert "2-D" in str(err)
    else:
        assert err.field == "top_k"
        assert err.value is top_k or err.value == top_k
        assert "1..3" in str(err)


def test_softmax_topk_rejects_float_top_k() -> None:
    with pytest.raises(AFDRemoteError):
        softmax_topk(torch.zeros(2, 3), 2.0, True)  # type: ignore[arg-type]
