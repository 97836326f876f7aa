"""Routed TP padding across real gloo processes (TP = 2 and 4).

One spawned world per TP size runs every token count (0, 1, TP-1, TP, TP+1, 17) once; the tests
check what each rank dispatched and got back: every global token leaves exactly once (with its
router top-k and input id on the same row), the output is restored exactly on every rank, and
sequence-parallel inputs pass through.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import afd_remote_tp_worker as worker
from afd_core.testing import free_port, run_world
from afd_remote import softmax_topk

Results = list[dict[int, dict[str, object]]]


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Results]:
    tp_size: int = request.param
    out_dir = tmp_path_factory.mktemp(f"afd_remote_tp{tp_size}")
    outcomes = run_world(worker.run, tp_size, tp_size, free_port(), str(out_dir), timeout_s=240)
    assert all(outcome[0] == "ok" for outcome in outcomes.values()), outcomes
    results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(tp_size)]
    return tp_size, results


CASES = list(worker.token_counts(2))


def _tensor(res: dict[str, object], key: str) -> torch.Tensor:
    value = res[key]
    assert isinstance(value, torch.Tensor)
    return value


def _sent(res: dict[str, object], key: str) -> dict[str, torch.Tensor]:
    value = res[key]
    assert isinstance(value, dict)
    return value


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_each_token_dispatched_once_and_restored(world: tuple[int, Results], case: str) -> None:
    tp_size, results = world
    n = worker.token_counts(tp_size)[case]
    per_rank = -(-n // tp_size)
    parent = worker.parent_hidden(n)
    sent = [_sent(r[n], "tp_sent")["hidden_states"] for r in results]
    # Rank r sends its slice clipped to the tokens; rank order rebuilds the parent exactly: every
    # real token leaves once and no padding row travels.
    sizes = [s.shape[0] for s in sent]
    assert sizes == [max(0, min(n, (r + 1) * per_rank) - r * per_rank) for r in range(tp_size)]
    assert torch.equal(torch.cat(sent), parent)
    for r in results:
        assert torch.equal(_tensor(r[n], "tp_out"), parent * 3 + 7)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_routing_fields_stay_aligned_under_tp(world: tuple[int, Results], case: str) -> None:
    tp_size, results = world
    n = worker.token_counts(tp_size)[case]
    sends = [_sent(r[n], "moe_sent") for r in results]
    hidden = torch.cat([s["hidden_states"] for s in sends])
    ids = torch.cat([s["input_ids"] for s in sends])
    topk_ids = torch.cat([s["topk_ids"] for s in sends])
    topk_w = torch.cat([s["topk_weights"] for s in sends])
    exp_w, exp_ids = softmax_topk(worker.parent_logits(n), worker.TOP_K, True)
    assert torch.equal(hidden, worker.parent_hidden(n))
    assert torch.equal(ids, torch.arange(n) + 1000)
    assert torch.equal(topk_ids, exp_ids)
    assert torch.equal(topk_w, exp_w)
    # Real token i routes to expert i % E first.
    assert torch.equal(topk_ids[:n, 0], (torch.arange(n) % worker.NUM_EXPERTS).to(torch.int32))
    for r in results:
        assert torch.equal(_tensor(r[n], "moe_out"), worker.parent_hidden(n) * 3 + 8)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_dispatch_under_tp(world: tuple[int, Results], case: str) -> None:
    """Each real token leaves exactly once per FFN rank holding one of its top-k experts (from
    the one TP rank whose slice holds it; no padding row travels), and every TP rank gets the
    whole combined output."""
    tp_size, results = world
    n = worker.token_counts(tp_size)[case]
    per_rank = -(-n // tp_size)
    _, ids = softmax_topk(worker.parent_logits(n), worker.TOP_K, True)
    owner = torch.where(ids < 2, 0, 1)  # experts 0-1 on FFN rank 0, 2-4 on rank 1
    for f in range(2):
        rows = torch.cat([_sent(r[n], "ep_sent")[f"hidden_states[{f}]"] for r in results])
        wanted = [float(i + 1) for i in range(n) if bool((owner[i] == f).any())]
        assert rows[:, 0].tolist() == wanted  # rank order, each real token once, nothing else
        for r in results:
            assert r[n]["ep_counts"][f] <= per_rank  # type: ignore[index]
    # default_ffn of layer 3 is h * 3 + 10 per rank holding an expert of the token, summed.
    hidden = worker.parent_hidden(n)
    ranks_hit = torch.stack([(owner == f).any(dim=1) for f in range(2)], dim=1).float()
    expected = (hidden * 3 + 10) * ranks_hit.sum(dim=1, keepdim=True)
    for r in results:
        assert torch.equal(_tensor(r[n], "ep_out"), expected)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", CASES)
def test_sequence_parallel_passes_through(world: tuple[int, Results], case: str) -> None:
    tp_size, results = world
    n = worker.token_counts(tp_size)[case]
    for rank, r in enumerate(results):
        local = _tensor(r[n], "sp_local")
        assert torch.equal(local, worker.parent_hidden(n, offset=100 * rank))
        assert torch.equal(_sent(r[n], "sp_sent")["hidden_states"], local)
        assert torch.equal(_tensor(r[n], "sp_out"), local * 3 + 9)
