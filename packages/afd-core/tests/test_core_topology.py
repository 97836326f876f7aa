"""AFDTopology: world layout and the balanced assignment, exhaustively for A, F <= 8."""

from __future__ import annotations

import itertools

import pytest
from afd_core.config import AFDConfig, AFDConfigError, AFDRole
from afd_core.topology import AFDTopology

PAIRS = [(a, f) for a, f in itertools.product(range(1, 9), repeat=2) if a >= f]


@pytest.mark.parametrize(("a", "f"), PAIRS)
def test_assignment_invariants(a: int, f: int) -> None:
    topo = AFDTopology(a, f)
    assert topo.world_size == a + f
    groups = [topo.attention_ranks_for(r) for r in range(f)]
    # A partition of 0..A-1 into F consecutive, ordered, non-empty groups.
    assert [x for g in groups for x in g] == list(range(a))
    for g in groups:
        assert g and list(g) == list(range(g[0], g[0] + len(g)))
        assert len(g) in (a // f, -(-a // f))
    # Documented formula.
    for r, g in enumerate(groups):
        assert g == tuple(range(r * a // f, (r + 1) * a // f))
    # ffn_rank_for is the inverse; index_in_group is the position.
    for r, g in enumerate(groups):
        for pos, att in enumerate(g):
            assert topo.ffn_rank_for(att) == r
            assert topo.index_in_group(att) == pos
    # Divisible case equals afd-plugin's [f*r, (f+1)*r).
    if a % f == 0:
        ratio = a // f
        assert groups == [tuple(range(r * ratio, (r + 1) * ratio)) for r in range(f)]


@pytest.mark.parametrize(("a", "f"), PAIRS)
def test_world_layout_attention_first(a: int, f: int) -> None:
    topo = AFDTopology(a, f)
    seen = []
    for role, size in ((AFDRole.ATTENTION, a), (AFDRole.FFN, f)):
        for rr in range(size):
            w = topo.world_rank(role, rr)
            assert topo.role_of(w) == (role, rr)
            seen.append(w)
    assert seen == list(range(a + f))
    assert topo.world_rank(AFDRole.ATTENTION, a - 1) == a - 1
    assert topo.world_rank("ffn", 0) == a
    for rr in range(f):
        peers = topo.peers_of(AFDRole.FFN, rr)
        assert peers == tuple(topo.attention_ranks_for(rr))
    for rr in range(a):
        assert topo.peers_of(AFDRole.ATTENTION, rr) == (a + topo.ffn_rank_for(rr),)


@pytest.mark.parametrize(("a", "f"), [(a, f) for a in range(1, 9) for f in range(a + 1, 10)])
def test_fewer_attention_than_ffn_rejected(a: int, f: int) -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDTopology(a, f)
    assert info.value.field == "num_ffn_ranks"
    assert info.value.value == f


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
        lambda: topo.ffn_rank_for(3),
        lambda: topo.ffn_rank_for(True),
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


def test_from_config() -> None:
    c = AFDConfig(role=AFDRole.FFN, num_attention_ranks=5, num_ffn_ranks=2)
    topo = AFDTopology.from_config(c)
    assert topo == AFDTopology(5, 2)
    assert topo.attention_ranks_for(0) == (0, 1) and topo.attention_ranks_for(1) == (2, 3, 4)
