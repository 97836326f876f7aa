"""Mega bound to several ranks (the reference backend's dispatch and combine over a gloo group):
each rank holds its contiguous share of the experts, takes global top-k ids, and every rank of
the group calls once per layer, one with no tokens of its own too."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from afd_compute_npu import (
    AscendBackend,
    ComputeConfig,
    ComputeConfigError,
    ComputeInputError,
    MegaCommParams,
    MegaCompute,
    ReferenceBackend,
)
from afd_weights import QuantScheme, export_quantized_expert_weights

E, H, INTER, K, LAYER = 8, 64, 32, 2, 3


def _sources() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.3
    w2 = torch.randn(E, H, INTER, generator=g)
    return {LAYER: (w13, w2)}


def _mega(
    experts: slice,
    scheme: QuantScheme,
    comm: MegaCommParams,
    backend: Any = None,
    dtype: torch.dtype = torch.bfloat16,
    rsf: float = 1.0,
) -> Any:
    src = {i: (a[experts], b[experts]) for i, (a, b) in _sources().items()}
    weights = export_quantized_expert_weights(src, scheme=scheme, routed_scaling_factor=rsf)
    cfg = ComputeConfig(max_tokens=32, top_k=K, dtype=dtype, routed_scaling_factor=rsf)
    mega = MegaCompute(weights, cfg, backend or ReferenceBackend())
    mega.bind(comm)
    return mega


def _inputs(t: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to(dtype)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(t)]
    ids = (torch.stack(rows) if rows else torch.zeros(0, K)).to(torch.int32)
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    return x, ids, w


def _run_group(
    world: int,
    scheme: QuantScheme,
    calls: dict[int, tuple[torch.Tensor, ...]],
    dtype: torch.dtype = torch.bfloat16,
    rsf: float = 1.0,
) -> dict[int, torch.Tensor]:
    """Each rank of a ``world``-rank gloo group (threads) calls its Mega once with ``calls[r]``."""
    store = dist.HashStore()
    per_rank = E // world
    out: dict[int, Any] = {}

    def rank_main(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, r, world, timedelta(seconds=30))
            comm = MegaCommParams(
                group_name="g",
                world_size=world,
                rank=r,
                peer_ranks=tuple(p for p in range(world) if p != r),
                group=group,
            )
            experts = slice(r * per_rank, (r + 1) * per_rank)
            mega = _mega(experts, scheme, comm, dtype=dtype, rsf=rsf)
            x, ids, w = calls[r]
            out[r] = mega(LAYER, x, ids, w).clone()
        except BaseException as err:  # surfaced below
            out[r] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(world):
        if isinstance(out.get(r), BaseException):
            raise out[r]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", [QuantScheme.W8A8, QuantScheme.W4A8_PER_CHANNEL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_ranks_give_the_one_rank_result_and_an_idle_rank_joins(
    scheme: QuantScheme, dtype: torch.dtype
) -> None:
    x, ids, w = _inputs(12, dtype)
    one_rank = _mega(slice(0, E), scheme, MegaCommParams("g", 1, 0, ()), dtype=dtype)
    one = one_rank(LAYER, x, ids, w).clone()
    # Rank 0 brings every token (a home FFN rank), rank 1 none: it still computes its experts'
    # share of rank 0's tokens through the group.
    out = _run_group(2, scheme, {0: (x, ids, w), 1: _inputs(0, dtype)}, dtype)
    assert out[1].shape == (0, H)
    assert out[0].shape == (12, H) and out[0].dtype == dtype
    same = (ids // (E // 2))[:, 0] == (ids // (E // 2))[:, 1]
    assert same.any() and (~same).any()
    if dtype == torch.float32:
        # Each share is its slots' fp32 terms; their sum is the one-rank sum: bit for bit.
        assert torch.equal(out[0], one)
    else:
        # A token whose two experts live on one rank gets exactly the one-rank result; a split
        # one gets two bf16-rounded shares summed: within one bf16 step at the output's scale.
        assert torch.equal(out[0][same], one[same])
        step = 2.0**-7 * float(one.float().abs().max())
        assert float((out[0].float() - one.float()).abs().max()) <= step
    # Rank 1's experts count: without its share the split tokens differ.
    alone = _mega(slice(0, E // 2), scheme, MegaCommParams("g", 1, 0, ()), dtype=dtype)
    mine = (ids // (E // 2)) == 0
    half = alone(LAYER, x, torch.where(mine, ids, 0), torch.where(mine, w, 0)).clone()
    assert not torch.allclose(half[~same].float(), one[~same].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rsf", [1.0, 2.5])
def test_both_ranks_bring_tokens(rsf: float) -> None:
    """fp32, with and without routed scaling (applied after the group's sum, as one rank does
    after its own): bit for bit the one-rank result, each rank getting its own rows back."""
    f32 = torch.float32
    x, ids, w = _inputs(10, f32)
    one = _mega(slice(0, E), QuantScheme.W8A8, MegaCommParams("g", 1, 0, ()), dtype=f32, rsf=rsf)
    expected = one(LAYER, x, ids, w).clone()
    calls = {0: (x[:7], ids[:7], w[:7]), 1: (x[7:], ids[7:], w[7:])}
    out = _run_group(2, QuantScheme.W8A8, calls, f32, rsf)
    assert torch.equal(torch.cat([out[0], out[1]]), expected)


def test_global_ids_are_checked_against_the_group_s_experts() -> None:
    mega = _mega(slice(0, E // 2), QuantScheme.W8A8, MegaCommParams("g", 2, 0, (1,), group=None))
    x, ids, w = _inputs(3)
    with pytest.raises(ComputeInputError) as err:
        mega(LAYER, x, ids + E, w)  # past the group's E experts
    assert err.value.field == "topk_ids" and f"[0, {E})" in str(err.value)
    with pytest.raises(ComputeConfigError) as cfg_err:  # ids fit; no group to exchange through
        mega(LAYER, x, ids, w)
    assert cfg_err.value.field == "group"


def test_ascend_idle_rank_calls_the_fused_kernel_with_one_inactive_row() -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class RecordedNative:
        def dispatch_ffn_combine(self, *args: Any, **kwargs: Any) -> None:
            calls.append((args, kwargs))

    comm = MegaCommParams("hccl_ffn", 2, 1, (0,))
    mega = _mega(slice(E // 2, E), QuantScheme.W8A8, comm, AscendBackend(RecordedNative()))  # type: ignore[arg-type]
    x, ids, w = _inputs(0)
    assert mega(LAYER, x, ids, w).shape == (0, H)
    ((args, kwargs),) = calls
    assert args[0].shape == (1, H) and not args[0].any()
    assert args[9] == "hccl_ffn" and args[10] == 32 * K * 2
    assert kwargs["x_active_mask"].tolist() == [False]
    mega(LAYER, *_inputs(2))  # a rank with tokens: every row active
    assert calls[1][1]["x_active_mask"] is None and calls[1][0][0].shape == (2, H)
