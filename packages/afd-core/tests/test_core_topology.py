"""AFDTopology (world layout, all-to-all exchange) and ExpertMap, exhaustively for small A, F, E."""

from __future__ import annotations

import itertools

import pytest
import torch
from afd_core.config import AFDConfig, AFDConfigError, AFDRole
from afd_core.expert_map import ExpertMap
from afd_core.topology import AFDTopology

PAIRS = list(itertools.product(range(1, 9), repeat=2))


@pytest.mark.parametrize(("a", "f"), PAIRS)
def test_world_layout_and_all_to_all_peers(a: int, f: int) -> None:
    topo = AFDTopology(a, f)
    assert topo.world_size == a + f
    assert topo.expert_parallel is (f > 1)
    seen = []
    for role, size in ((AFDRole.ATTENTION, a), (AFDRole.FFN, f)):
        for rr in range(size):
            w = topo.world_rank(role, rr)
            assert topo.role_of(w) == (role, rr)
            seen.append(w)
    assert seen == list(range(a + f))
    assert topo.world_rank("ffn", 0) == a
    for rr in range(f):
        assert topo.attention_ranks_for(rr) == tuple(range(a))
        assert topo.peers_of(AFDRole.FFN, rr) == tuple(range(a))
    for rr in range(a):
        assert topo.ffn_ranks_for(rr) == tuple(range(f))
        assert topo.peers_of(AFDRole.ATTENTION, rr) == tuple(range(a, a + f))


@pytest.mark.parametrize(
    ("a", "f", "field"),
    [
        (0, 1, "num_attention_ranks"),
        (1, 0, "num_ffn_ranks"),
        (True, 1, "num_attention_ranks"),
        (2, 1.0, "num_ffn_ranks"),
        ("2", 1, "num_attention_ranks"),
    ],
)
def test_invalid_counts(a: object, f: object, field: str) -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDTopology(a, f)  # type: ignore[arg-type]
    assert info.value.field == field


def test_role_rank_range_checked() -> None:
    topo = AFDTopology(3, 2)
    for call in (
        lambda: topo.world_rank(AFDRole.ATTENTION, 3),
        lambda: topo.world_rank(AFDRole.FFN, 2),
        lambda: topo.world_rank(AFDRole.FFN, -1),
        lambda: topo.attention_ranks_for(2),
        lambda: topo.ffn_ranks_for(3),
        lambda: topo.ffn_ranks_for(True),
    ):
        with pytest.raises(AFDConfigError) as info:
            call()
        assert info.value.field == "role_rank"
    with pytest.raises(AFDConfigError) as info:
        topo.role_of(5)
    assert info.value.field == "world_rank"
    with pytest.raises(AFDConfigError) as info:
        topo.world_rank("decoder", 0)
    assert info.value.field == "role"


def test_from_config_and_fewer_attention_than_ffn() -> None:
    c = AFDConfig(
        role=AFDRole.FFN,
        num_attention_ranks=1,
        num_ffn_ranks=3,
        ffn_rank=2,
        compute_gate_on_attention=True,
    )
    topo = AFDTopology.from_config(c)
    assert topo == AFDTopology(1, 3)
    assert topo.peers_of(AFDRole.ATTENTION, 0) == (1, 2, 3)


@pytest.mark.parametrize(("e", "f"), [(e, f) for e in range(1, 17) for f in range(1, e + 1)])
def test_contiguous_expert_map_is_balanced_and_complete(e: int, f: int) -> None:
    emap = AFDTopology(1, f).expert_map(e)
    assert emap == ExpertMap.contiguous(e, f)
    assert emap.num_experts == e
    ranges = [emap.local_experts(r) for r in range(f)]
    # A partition of 0..E-1 into F contiguous, ordered ranges of floor/ceil(E/F) experts.
    assert [x for g in ranges for x in g] == list(range(e))
    for r, g in enumerate(ranges):
        assert g == tuple(range(r * e // f, (r + 1) * e // f))
        assert len(g) in (e // f, -(-e // f))
        assert emap.contiguous_range(r) == range(g[0], g[-1] + 1)
        for i, x in enumerate(g):
            assert emap.owner(x) == r and emap.local_index(x) == i
    assert emap.owner_table().tolist() == [emap.owner(x) for x in range(e)]


def test_expert_map_rejects_bad_placements() -> None:
    with pytest.raises(AFDConfigError) as info:
        ExpertMap.contiguous(3, 4)
    assert (info.value.field, info.value.value) == ("num_ffn_ranks", 4)
    with pytest.raises(AFDConfigError) as info:
        ExpertMap(2, (0, 0, 0))
    assert info.value.field == "owners"
    with pytest.raises(AFDConfigError) as info:
        ExpertMap(2, (0, 2, 1))
    assert (info.value.field, info.value.value) == ("owners[1]", 2)
    with pytest.raises(AFDConfigError) as info:
        ExpertMap.contiguous(4, 2).owner(4)
    assert info.value.field == "expert"
    with pytest.raises(AFDConfigError) as info:
        ExpertMap.contiguous(4, 2).local_experts(2)
    assert info.value.field == "ffn_rank"


def test_non_contiguous_map() -> None:
    emap = ExpertMap(2, (1, 0, 1, 0))
    assert emap.local_experts(0) == (1, 3) and emap.local_experts(1) == (0, 2)
    assert emap.contiguous_range(0) is None
    assert emap.local_table(1).tolist() == [0, -1, 1, -1]


def test_localise_keeps_own_slots_and_zeroes_the_rest() -> None:
    emap = ExpertMap.contiguous(8, 2)  # rank 0: 0..3, rank 1: 4..7
    ids = torch.tensor([[1, 6], [5, 4], [2, 3]], dtype=torch.int32)
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    w0, i0 = emap.localise(0, w, ids)
    assert i0.dtype == torch.int32
    assert torch.equal(w0, torch.tensor([[0.7, 0.0], [0.0, 0.0], [0.5, 0.5]]))
    assert i0.tolist() == [[1, 0], [0, 0], [2, 3]]
    w1, i1 = emap.localise(1, w, ids)
    assert torch.equal(w1, torch.tensor([[0.0, 0.3], [0.6, 0.4], [0.0, 0.0]]))
    assert i1.tolist() == [[0, 2], [1, 0], [0, 0]]
    # Fewer local experts than top_k: slots shrink to num_local, own slots first.
    emap4 = ExpertMap.contiguous(4, 4)
    w3, i3 = emap4.localise(3, torch.tensor([[0.2, 0.8]]), torch.tensor([[1, 3]]))
    assert w3.tolist() == [[0.800000011920929]] and i3.tolist() == [[0]]
    with pytest.raises(AFDConfigError) as info:
        emap.localise(0, w, torch.tensor([[1, 8], [0, 0], [0, 0]], dtype=torch.int32))
    assert info.value.field == "topk_ids"


@pytest.mark.parametrize(("a", "t", "f"), list(itertools.product((1, 2, 3), (1, 2, 4), (1, 2))))
def test_tensor_parallel_attention_workers_are_peers(a: int, t: int, f: int) -> None:
    """Each of the A x T Attention TP workers is a peer: world ranks 0..A*T-1, then the FFN
    ranks; (dp_rank, tp_rank) maps one to one onto the peers, data-parallel rank major."""
    topo = AFDTopology(a, f, t)
    assert topo.num_attention_peers == a * t
    assert topo.world_size == a * t + f
    assert topo.role_size(AFDRole.ATTENTION) == a * t
    peers = [topo.attention_peer(dp, tp) for dp in range(a) for tp in range(t)]
    assert peers == list(range(a * t))
    for rr in range(f):
        assert topo.attention_ranks_for(rr) == tuple(range(a * t))
    assert topo.world_rank(AFDRole.FFN, 0) == a * t
    assert topo.role_of(a * t - 1) == (AFDRole.ATTENTION, a * t - 1)
    for field, call in (
        ("data_parallel_rank", lambda: topo.attention_peer(a, 0)),
        ("tp_rank", lambda: topo.attention_peer(0, t)),
        ("tp_rank", lambda: topo.attention_peer(0, True)),
    ):
        with pytest.raises(AFDConfigError) as info:
            call()
        assert info.value.field == field


def test_from_config_carries_the_attention_tp_size() -> None:
    c = AFDConfig(role=AFDRole.FFN, num_attention_ranks=2, attention_tp_size=2)
    assert AFDTopology.from_config(c) == AFDTopology(2, 1, 2)
    with pytest.raises(AFDConfigError) as info:
        AFDTopology(1, 1, 0)
    assert info.value.field == "attention_tp_size"


# -- replicated experts and elastic rounds ------------------------------------------------


@pytest.mark.parametrize(("e", "f", "r"), [(8, 2, 2), (9, 3, 2), (12, 4, 3), (5, 5, 5), (7, 3, 1)])
def test_replicated_placement_puts_each_expert_on_r_neighbouring_ranks(
    e: int, f: int, r: int
) -> None:
    placed = ExpertMap.replicated(e, f, r)
    base = ExpertMap.contiguous(e, f)
    # With every rank live the routing is the contiguous one: the same experts compute.
    assert placed.owners == base.owners
    assert placed.replicated_routing is (r > 1)
    for x in range(e):
        p = base.owner(x)
        assert placed.replicas(x) == tuple((p + j) % f for j in range(r))
    for rank in range(f):
        held = placed.local_experts(rank)
        assert set(base.local_experts(rank)) <= set(held)
        assert held == tuple(sorted(held))
        assert placed.num_local(rank) == sum(rank in placed.replicas(x) for x in range(e))


def test_route_sends_a_lost_ranks_experts_to_their_next_live_replica() -> None:
    placed = ExpertMap.replicated(9, 3, 2)  # slots hold [0..2]+[6..8], [3..5]+[0..2], [6..8]+[3..5]
    round_map = placed.route((1, 2))  # slot 0 lost
    assert round_map.num_ffn_ranks == 2 and round_map.slots == (1, 2)
    # Experts 0..2 (slot 0's) now go to slot 1 (round rank 0); the rest stay where they were.
    assert round_map.owners == (0, 0, 0, 0, 0, 0, 1, 1, 1)
    assert round_map.local_experts(0) == placed.local_experts(1)
    assert round_map.local_experts(1) == placed.local_experts(2)
    assert placed.route((0, 1, 2)) is placed
    with pytest.raises(AFDConfigError) as info:
        placed.route((1,))  # experts 6..8 live on slots 2 and 0 only
    assert info.value.field == "members" and "expert 6" in str(info.value)
    for bad in ((2, 1), (), (0, 0), (3,), [0, 1]):
        with pytest.raises(AFDConfigError) as info:
            placed.route(bad)  # type: ignore[arg-type]
        assert info.value.field == "members"


def test_a_replica_holder_computes_only_the_slots_routed_to_it() -> None:
    placed = ExpertMap.replicated(4, 2, 2)  # both ranks hold every expert
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[0, 3], [2, 1]])
    owner_table = placed.owner_table()
    for rank in range(2):
        routed = placed.routed_ids(rank, ids, owner_table)
        w, local = placed.localise(rank, weights, routed)
        mine = owner_table[ids] == rank
        assert torch.equal(w, torch.where(mine, weights, torch.zeros_like(weights)))
        assert torch.equal(local, torch.where(mine, ids, torch.zeros_like(ids)))
    with pytest.raises(AFDConfigError) as info:
        placed.localise(0, weights, torch.tensor([[-2, 0], [0, 1]]))
    assert info.value.field == "topk_ids" and "-1" in str(info.value)


def test_held_must_include_what_a_rank_owns() -> None:
    with pytest.raises(AFDConfigError) as info:
        ExpertMap(2, (0, 1, 1), held=((0,), (2,)))
    assert info.value.field == "held[1]"
    with pytest.raises(AFDConfigError) as info:
        ExpertMap(2, (0, 1), slots=(3, 3))
    assert info.value.field == "slots"


def test_a_rounds_topology_numbers_only_its_ffn_members() -> None:
    topo = AFDTopology(2, 3, expert_replicas=2)
    assert topo.elastic and topo.members == (0, 1, 2) and topo.world_size == 5
    round_topo = topo.with_members((0, 2))
    assert round_topo.world_size == 4
    assert round_topo.world_rank(AFDRole.FFN, 2) == 3
    assert round_topo.role_of(3) == (AFDRole.FFN, 2)
    assert round_topo.peers_of(AFDRole.ATTENTION, 1) == (2, 3)
    assert round_topo.peers_of(AFDRole.FFN, 2) == (0, 1)
    with pytest.raises(AFDConfigError) as info:
        round_topo.world_rank(AFDRole.FFN, 1)
    assert info.value.field == "ffn_rank" and "(0, 2)" in str(info.value)
    assert topo.with_members((0, 1, 2)) == topo
    emap = round_topo.expert_map(6)
    # Slot 1 (experts 2, 3) is out: its experts go to its next replica, slot 2.
    assert emap.slots == (0, 2) and emap.owners == (0, 0, 1, 1, 1, 1)
    with pytest.raises(AFDConfigError) as info:
        AFDTopology(1, 2, expert_replicas=3)
    assert info.value.field == "expert_replicas"
    with pytest.raises(AFDConfigError) as info:
        topo.with_members((2, 0))
    assert info.value.field == "ffn_members"


@pytest.mark.parametrize(("f", "r"), [(2, 1), (2, 2), (3, 2), (4, 2), (4, 3)])
def test_covers_agrees_with_routing_over_every_subset(f: int, r: int) -> None:
    topo = AFDTopology(1, f, expert_replicas=r)
    placed = topo.placement(2 * f + 1)
    for n in range(1, f + 1):
        for members in itertools.combinations(range(f), n):
            if topo.covers(members):
                placed.route(members)
            else:
                with pytest.raises(AFDConfigError):
                    placed.route(members)


def test_from_config_carries_the_replicas() -> None:
    c = AFDConfig(
        role=AFDRole.ATTENTION, num_ffn_ranks=2, compute_gate_on_attention=True, expert_replicas=2
    )
    assert AFDTopology.from_config(c).expert_replicas == 2


@pytest.mark.parametrize(
    ("peers", "ffn", "homes"),
    [
        (4, 2, (0, 0, 1, 1)),  # consecutive peers share an FFN rank
        (3, 2, (0, 0, 1)),
        (2, 1, (0, 0)),
        (1, 2, (0,)),  # fewer peers than FFN ranks: FFN rank 1 gets no tokens of its own
        (6, 3, (0, 0, 1, 1, 2, 2)),
    ],
)
def test_home_ffn_rank_splits_the_peers_in_consecutive_groups(
    peers: int, ffn: int, homes: tuple[int, ...]
) -> None:
    topo = AFDTopology(peers, ffn)
    assert tuple(topo.home_ffn_rank(a) for a in range(peers)) == homes
    with pytest.raises(AFDConfigError) as err:
        topo.home_ffn_rank(peers)
    assert err.value.field == "role_rank"
