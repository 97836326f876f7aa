"""The model identity in the P2P handshake: validation, canonical form, and the comparison that
names the first differing key on every rank of both roles."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDConfigError, AFDRole
from afd_core.connector import create_connector
from afd_core.connector.p2p import PROTOCOL_VERSION, P2PConnector
from afd_core.errors import AFDHandshakeError
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.handshake import _compare_handshake, _handshake_fields
from afd_core.testing import free_port, run_world
from afd_core.topology import AFDTopology

sys.path.insert(0, str(Path(__file__).parent))
import afd_core_worlds as worlds

SPEC = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)


def fields(identity: dict[str, Any] | None, role: AFDRole = AFDRole.ATTENTION) -> dict[str, Any]:
    conn = P2PConnector(
        AFDConfig(role=role), payload_spec=SPEC, num_layers=2, model_identity=identity
    )
    return conn.handshake_fields()


def compare_error(mine: dict[str, Any], theirs: dict[str, Any]) -> AFDHandshakeError:
    with pytest.raises(AFDHandshakeError) as info:
        _compare_handshake(mine, theirs, 1)
    return info.value


def test_identity_is_published_in_canonical_json_form() -> None:
    published = fields({"weights": {"a.safetensors": ("h", 3)}, "config": {"n": 1.5}})
    assert published["model_identity"] == {
        "config": {"n": 1.5},
        "weights": {"a.safetensors": ["h", 3]},
    }
    assert fields(None)["model_identity"] == {}


@pytest.mark.parametrize(
    "bad",
    [["config"], "config", {"config": {"rope_theta": float("nan")}}, {"weights": {"f": object()}}],
)
def test_bad_identity_is_refused_naming_the_field(bad: Any) -> None:
    with pytest.raises(AFDConfigError) as info:
        fields(bad)
    assert info.value.field == "model_identity"
    assert "JSON-serialisable mapping" in str(info.value)


def test_create_connector_passes_the_identity() -> None:
    identity = {"config": {"num_experts": 8}}
    conn = create_connector(
        AFDConfig(role=AFDRole.FFN), 0, payload_spec=SPEC, num_layers=2, model_identity=identity
    )
    assert conn.model_identity == identity


def test_equal_identities_compare_equal_across_roles() -> None:
    identity = copy.deepcopy(worlds.IDENTITY)
    _compare_handshake(fields(identity), fields(identity, AFDRole.FFN), 1)


@pytest.mark.parametrize(
    ("change", "field", "local", "remote"),
    [
        (
            lambda i: i["config"].update(hidden_act="gelu"),
            "model_identity.config.hidden_act",
            "silu",
            "gelu",
        ),
        (
            lambda i: i["weights"]["model.safetensors"].update(samples="s1"),
            "model_identity.weights['model.safetensors'].samples",
            "s0",
            "s1",
        ),
        (
            lambda i: i["config"].update(extra=1),
            "model_identity.config.extra",
            None,
            1,
        ),
        (
            lambda i: i.pop("weights"),
            "model_identity.weights",
            worlds.IDENTITY["weights"],
            None,
        ),
        # The first differing key in sorted order: config before weights, a before b.
        (
            lambda i: (
                i["weights"]["model.safetensors"].update(size=1),
                i["config"].update(b=2, a=3),
            ),
            "model_identity.config.a",
            None,
            3,
        ),
    ],
)
def test_the_first_differing_leaf_is_named(
    change: Any, field: str, local: Any, remote: Any
) -> None:
    identity = copy.deepcopy(worlds.IDENTITY)
    theirs = copy.deepcopy(identity)
    change(theirs)
    err = compare_error(fields(identity), fields(theirs, AFDRole.FFN))
    assert (err.field, err.local, err.remote, err.peer_rank) == (field, local, remote, 1)
    assert field in str(err) and "the roles serve different models" in str(err)


def test_a_peer_without_identity_differs() -> None:
    err = compare_error(fields(copy.deepcopy(worlds.IDENTITY)), fields(None, AFDRole.FFN))
    assert err.field == "model_identity.config"


def test_shape_fields_are_named_before_the_identity() -> None:
    mine = fields({"config": {"hidden_size": 8}})
    theirs = copy.deepcopy(mine)
    theirs["hidden_size"] = 16
    theirs["model_identity"] = {"config": {"hidden_size": 16}}
    err = compare_error(mine, theirs)
    assert err.field == "hidden_size" and "different models" not in str(err)


def test_handshake_fields_without_identity_argument() -> None:
    cfg = AFDConfig(role=AFDRole.FFN)
    published = _handshake_fields(
        cfg, AFDTopology(1, 1), SPEC, 2, torch.device("cpu"), protocol_version=PROTOCOL_VERSION
    )
    assert published["model_identity"] == {}


def _ok(results: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
    values = {}
    for rank, outcome in sorted(results.items()):
        assert outcome[0] == "ok", f"rank {rank}: {outcome}"
        values[rank] = outcome[1]
    return values


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "field", "first", "last"),
    [
        ("weights", "model_identity.weights['model.safetensors'].samples", "s0", "s1"),
        ("config", "model_identity.config.hidden_act", "silu", "gelu"),
    ],
)
def test_both_roles_refuse_a_different_identity(
    case: str, field: str, first: str, last: str
) -> None:
    results = _ok(run_world(worlds.identity_rank, 2, free_port(), 1, 1, case, timeout_s=100))
    assert results[0] == {
        "error": "AFDHandshakeError",
        "text": results[0]["text"],
        "field": field,
        "local": first,
        "remote": last,
        "peer_rank": 1,
    }
    assert results[1] == {
        "error": "AFDHandshakeError",
        "text": results[1]["text"],
        "field": field,
        "local": last,
        "remote": first,
        "peer_rank": 0,
    }
    assert field in results[0]["text"] and field in results[1]["text"]


@pytest.mark.timeout(120)
def test_every_rank_of_a_two_to_one_world_names_the_extra_key() -> None:
    results = _ok(run_world(worlds.identity_rank, 3, free_port(), 2, 1, "extra_key", timeout_s=100))
    for rank in (0, 1):
        assert results[rank]["error"] == "AFDHandshakeError", results[rank]
        assert results[rank]["field"] == "model_identity.config.moe_renorm"
        assert (results[rank]["local"], results[rank]["remote"]) == (None, True)
        assert results[rank]["peer_rank"] == 2
    assert results[2]["error"] == "AFDHandshakeError", results[2]
    assert results[2]["field"] == "model_identity.config.moe_renorm"
    assert (results[2]["local"], results[2]["remote"]) == (True, None)


@pytest.mark.timeout(120)
def test_equal_identities_pair() -> None:
    results = _ok(run_world(worlds.identity_rank, 2, free_port(), 1, 1, "same", timeout_s=100))
    assert results == {0: {"error": None}, 1: {"error": None}}
