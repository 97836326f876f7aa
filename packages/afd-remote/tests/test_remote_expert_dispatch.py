"""Expert-parallel dispatch: the layout, the combine order, and round trips over the in-process
connector (every shape, threads of this process) and over P2P/gloo (one shape: the transport)."""

from __future__ import annotations

import itertools
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_core.errors import AFDPayloadError
from afd_core.expert_map import ExpertMap
from afd_core.testing import free_port, run_world
from afd_core.topology import AFDTopology
from afd_remote import (
    combine_expert_outputs,
    plan_expert_dispatch,
    plan_home_dispatch,
    split_for_dispatch,
)

sys.path.insert(0, str(Path(__file__).parent))
import afd_remote_ep_worker as worker


def test_plan_rows_are_the_tokens_owning_an_expert_on_each_rank() -> None:
    emap = ExpertMap.contiguous(8, 2)  # rank 0: 0..3, rank 1: 4..7
    ids = torch.tensor([[0, 5], [1, 2], [7, 6], [3, 4]], dtype=torch.int32)
    plan = plan_expert_dispatch(ids, emap)
    assert [r.tolist() for r in plan.rows] == [[0, 1, 3], [0, 2, 3]]
    assert plan.counts == (3, 3) and plan.num_tokens == 4
    x = torch.arange(8.0).view(4, 2)
    parts = split_for_dispatch(x, plan)
    assert torch.equal(parts[0], x[[0, 1, 3]]) and torch.equal(parts[1], x[[0, 2, 3]])
    # An empty rank: every token on rank 0.
    plan = plan_expert_dispatch(torch.tensor([[0, 1], [2, 3]]), emap)
    assert plan.counts == (2, 0)
    assert split_for_dispatch(x[:2], plan)[1].shape == (0, 2)


def test_combine_adds_in_ffn_rank_order() -> None:
    emap = ExpertMap.contiguous(3, 3)  # one expert per rank
    plan = plan_expert_dispatch(torch.tensor([[0, 1, 2], [1, 1, 1]]), emap)
    assert [r.tolist() for r in plan.rows] == [[0], [0, 1], [0]]
    # float32 values where the order shows: ((0 + 1) + 2^-24) + 2^-24 == 1 (two ties to even),
    # while 1 + (2^-24 + 2^-24) == 1 + 2^-23.
    tiny = 2.0**-24
    p0 = torch.tensor([[1.0]])
    p1 = torch.tensor([[tiny], [3.0]])
    p2 = torch.tensor([[tiny]])
    out = combine_expert_outputs([p0, p1, p2], plan)
    assert out[0, 0].item() == 1.0
    reverse = (p2[0] + p1[0]) + p0[0]
    assert reverse.item() != 1.0  # the order is observable, and combine uses rank order
    # A token on one rank gets that rank's output exactly.
    assert out[1, 0].item() == 3.0


def test_plan_and_combine_reject_bad_shapes() -> None:
    emap = ExpertMap.contiguous(4, 2)
    with pytest.raises(AFDPayloadError) as info:
        plan_expert_dispatch(torch.tensor([[0.0, 1.0]]), emap)
    assert info.value.field == "topk_ids"
    with pytest.raises(AFDPayloadError) as info:
        plan_expert_dispatch(torch.tensor([[0, 4]]), emap)
    assert info.value.field == "topk_ids"
    plan = plan_expert_dispatch(torch.tensor([[0, 3]]), emap)
    with pytest.raises(AFDPayloadError) as info:
        split_for_dispatch(torch.zeros(2, 4), plan)
    assert info.value.field == "hidden_states"
    with pytest.raises(AFDPayloadError) as info:
        combine_expert_outputs([torch.zeros(1, 4)], plan)
    assert info.value.field == "ffn_outputs"
    with pytest.raises(AFDPayloadError) as info:
        combine_expert_outputs([torch.zeros(1, 4), torch.zeros(2, 4)], plan)
    assert info.value.field == "ffn_outputs[1]"


_ports = itertools.count(7500)  # in-process worlds are named by host:port; nothing listens


def test_home_plan_sends_every_row_to_one_rank() -> None:
    plan = plan_home_dispatch(4, 1, 3)
    assert plan.counts == (0, 4, 0) and plan.rows[1].tolist() == [0, 1, 2, 3]
    parts = [torch.zeros(0, 2), torch.arange(8.0).reshape(4, 2), torch.zeros(0, 2)]
    assert torch.equal(combine_expert_outputs(parts, plan), parts[1])  # the home's rows as replied
    assert plan_home_dispatch(0, 0, 2).counts == (0, 0)
    with pytest.raises(AFDPayloadError) as err:
        plan_home_dispatch(4, 3, 3)
    assert (err.value.field, err.value.value) == ("home", 3)


def _in_threads(a: int, f: int, run: Any = None) -> dict[int, Any]:
    """``run`` (default ``worker.run``) for every world rank on a thread, over the in-process
    connector; outcomes as :func:`afd_core.testing.run_world` reports them."""
    port = next(_ports)
    outcomes: dict[int, Any] = {}

    def rank(r: int) -> None:
        try:
            if run is None:
                outcomes[r] = ("ok", worker.run(r, port, a, f, "inprocess"))
            else:
                outcomes[r] = ("ok", run(r, port, a, f))
        except Exception as err:
            outcomes[r] = ("error", f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(a + f)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), outcomes
    return outcomes


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("a", "f", "transport"),
    [
        (1, 2, "p2p"),
        (1, 2, "inprocess"),
        (2, 2, "inprocess"),
        (3, 2, "inprocess"),
        (1, 3, "inprocess"),
    ],
    ids=lambda v: str(v),
)
def test_dispatch_routed_round_trip(a: int, f: int, transport: str) -> None:
    if transport == "p2p":
        outcomes = run_world(worker.run, a + f, free_port(), a, f, timeout_s=240)
    else:
        outcomes = _in_threads(a, f)
    assert sorted(outcomes) == list(range(a + f))
    reports = {}
    for rank, outcome in outcomes.items():
        assert outcome[0] == "ok", (rank, outcome)
        reports[rank] = outcome[1]
        assert reports[rank]["problems"] == [], (rank, reports[rank])
    emap = ExpertMap.contiguous(worker.EXPERTS, f)
    for arank in range(a):
        for layer, counts in enumerate(reports[arank]["counts"]):
            _, _, ids = worker.routing(arank, layer)
            assert counts == plan_expert_dispatch(ids, emap).counts
    # Layer 1 routes every token to experts 0 and 1 (FFN rank 0 when E/F >= 2): the other ranks
    # receive nothing and still answer, in bounded time.
    for fr in range(1, f):
        if emap.owner(1) != fr:
            assert reports[a + fr]["received"][1] == (0,) * a
    # The two-stage step: every FFN rank saw every (layer, stage), stage 1 of ranks >= 1 empty
    # (carried by their proxies' empty dispatches), and the outputs matched (no problems above).
    for fr in range(f):
        staged = reports[a + fr]["staged"]
        assert len(staged) == worker.LAYERS * 2
        for layer in range(worker.LAYERS):
            stage1 = staged[2 * layer + 1]
            assert all(stage1[ar] == 0 for ar in range(1, a)), (fr, layer, staged)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("a", "f"), [(1, 2), (2, 2), (3, 2), (4, 2), (2, 3)])
def test_expert_dispatch_ffn_sends_each_token_once_to_its_home_rank(a: int, f: int) -> None:
    """``expert_dispatch='ffn'`` (Mega dispatches among the FFN ranks): every token travels once,
    to the home FFN rank of its Attention rank; every FFN rank still sees every layer."""
    outcomes = _in_threads(a, f, worker.run_home)
    reports = {}
    for rank, outcome in outcomes.items():
        assert outcome[0] == "ok", (rank, outcome)
        reports[rank] = outcome[1]
        assert reports[rank]["problems"] == [], (rank, reports[rank])
    topo = AFDTopology(a, f)
    for arank in range(a):
        home = topo.home_ffn_rank(arank)
        want = tuple(worker.tokens(arank) if fr == home else 0 for fr in range(f))
        assert reports[arank]["counts"] == [want] * worker.LAYERS
        for fr in range(f):
            got = [layer[arank] for layer in reports[a + fr]["received"]]
            assert got == [want[fr]] * worker.LAYERS
