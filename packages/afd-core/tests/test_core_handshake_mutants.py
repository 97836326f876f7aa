"""The handshake comparison field by field: which difference is named, in which order, with which
values and peer; model identity paths; role agreement only within a role.

Written for the mutation check (CONTRIBUTING, "Mutation check"): the layer rule had its own tests,
the other fields were only exercised through whole connector worlds that agree.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDHandshakeError
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.handshake import MODEL_MISMATCH_HINT, _compare_handshake

SPEC = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)


def fields(
    role: AFDRole = AFDRole.ATTENTION,
    *,
    spec: AFDPayloadSpec = SPEC,
    num_layers: int = 4,
    role_agreement: dict[str, Any] | None = None,
    model_identity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    conn = P2PConnector(
        AFDConfig(role=role),
        payload_spec=spec,
        num_layers=num_layers,
        role_agreement=role_agreement,
        model_identity=model_identity,
    )
    return conn.handshake_fields()


def refusal(mine: dict[str, Any], theirs: dict[str, Any], peer: int = 3) -> AFDHandshakeError:
    with pytest.raises(AFDHandshakeError) as info:
        _compare_handshake(mine, theirs, peer)
    assert info.value.peer_rank == peer
    return info.value


def test_the_publication_holds_what_the_rank_serves() -> None:
    mine = fields(AFDRole.FFN, num_layers=6, role_agreement={"g": 1}, model_identity={"m": 2})
    assert mine["role"] == "ffn"
    assert mine["num_layers"] == 6 and mine["num_draft_layers"] == 0
    assert mine["hidden_size"] == 8 and mine["dtype"] == "float32"
    assert mine["device_type"] == "cpu"
    assert mine["role_agreement"] == {"g": 1}
    assert mine["model_identity"]["m"] == 2
    assert isinstance(mine["protocol_version"], int)
    assert mine["config"] == AFDConfig(role=AFDRole.FFN).agreement_fields()
    assert mine["config_hash"] == AFDConfig(role=AFDRole.FFN).agreement_hash()
    assert len(mine["topology"]) == 3 and all(isinstance(v, int) for v in mine["topology"])
    assert mine["ffn_members"] == [0]  # the one FFN slot of a default topology


def test_identical_ranks_of_both_roles_agree() -> None:
    attention, ffn = fields(AFDRole.ATTENTION), fields(AFDRole.FFN)
    _compare_handshake(attention, ffn, 1)
    _compare_handshake(ffn, attention, 0)
    _compare_handshake(attention, copy.deepcopy(attention), 2)


def test_protocol_version_is_compared_first() -> None:
    mine = fields()
    theirs = copy.deepcopy(mine)
    theirs["protocol_version"] = mine["protocol_version"] + 1
    theirs["hidden_size"] = 99  # a later field differs too: the version is named
    err = refusal(mine, theirs)
    assert err.field == "protocol_version"
    assert (err.local, err.remote) == (mine["protocol_version"], mine["protocol_version"] + 1)
    missing = copy.deepcopy(mine)
    del missing["protocol_version"]
    assert refusal(mine, missing).remote is None


def test_a_config_agreement_field_is_named_with_both_values() -> None:
    mine = fields()
    key = next(iter(mine["config"]))
    theirs = copy.deepcopy(mine)
    theirs["config"][key] = "something else"
    err = refusal(mine, theirs)
    assert err.field == f"config.{key}"
    assert (err.local, err.remote) == (mine["config"][key], "something else")
    no_config = copy.deepcopy(mine)
    del no_config["config"]
    assert refusal(mine, no_config).field == f"config.{key}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("config_hash", "0" * 8),
        ("hidden_size", 16),
        ("dtype", "bfloat16"),
        ("topology", [9, 9, 9]),
        ("ffn_members", [1]),
        ("device_type", "cuda"),
    ],
)
def test_each_plain_field_is_named(key: str, value: Any) -> None:
    mine = fields()
    theirs = copy.deepcopy(mine)
    theirs[key] = value
    err = refusal(mine, theirs)
    assert err.field == key and (err.local, err.remote) == (mine[key], value)


def test_plain_fields_are_compared_in_order_after_layers() -> None:
    mine = fields()
    theirs = copy.deepcopy(mine)
    theirs["hidden_size"] = 16
    theirs["device_type"] = "cuda"
    assert refusal(mine, theirs).field == "hidden_size"
    theirs["num_layers"] = mine["num_layers"] + 1
    assert refusal(mine, theirs).field == "num_layers"


def test_a_payload_spec_difference_names_the_first_spec_field() -> None:
    plain = fields()
    routed = fields(
        spec=AFDPayloadSpec(hidden_size=8, dtype=torch.float32, router_logits_width=4, top_k=2)
    )
    err = refusal(routed, plain)
    # PAYLOAD_FIELDS order: router_logits before topk_ids
    assert err.field == "payload_spec.router_logits"
    assert (err.local, err.remote) == (routed["payload_spec"]["router_logits"], None)
    err = refusal(plain, routed)
    assert err.field == "payload_spec.router_logits"
    assert (err.local, err.remote) == (None, routed["payload_spec"]["router_logits"])
    # a missing spec reads as empty: its first field is named
    gone = copy.deepcopy(plain)
    gone["payload_spec"] = None
    err = refusal(plain, gone)
    assert err.field == "payload_spec.hidden_states"
    assert (err.local, err.remote) == (plain["payload_spec"]["hidden_states"], None)
    # a difference outside the known fields still refuses, naming the whole spec
    odd = copy.deepcopy(plain)
    odd["payload_spec"]["future_field"] = 1
    err = refusal(plain, odd)
    assert err.field == "payload_spec"
    assert (err.local, err.remote) == (plain["payload_spec"], odd["payload_spec"])


def test_model_identity_names_the_first_differing_leaf_with_a_hint() -> None:
    base = {"config": {"hidden_act": "silu", "layers": 4}, "weights": {"model.safetensors": 1}}
    mine = fields(model_identity=base)
    other = copy.deepcopy(base)
    other["config"]["hidden_act"] = "gelu"
    other["config"]["layers"] = 5
    other["weights"]["model.safetensors"] = 2
    err = refusal(mine, fields(AFDRole.FFN, model_identity=other))
    # sorted key order: config before weights, hidden_act before layers
    assert err.field == "model_identity.config.hidden_act"
    assert (err.local, err.remote) == ("silu", "gelu")
    assert MODEL_MISMATCH_HINT in str(err)

    only_weights = copy.deepcopy(base)
    only_weights["weights"]["model.safetensors"] = 2
    err = refusal(mine, fields(model_identity=only_weights))
    assert err.field == "model_identity.weights['model.safetensors']"
    assert (err.local, err.remote) == (1, 2)


def test_model_identity_missing_keys_read_as_none() -> None:
    mine = fields(model_identity={"a": 1})
    err = refusal(mine, fields(model_identity={}))
    assert err.field == "model_identity.a" and (err.local, err.remote) == (1, None)
    err = refusal(fields(model_identity={}), fields(model_identity={"b": 2}))
    assert err.field == "model_identity.b" and (err.local, err.remote) == (None, 2)
    _compare_handshake(fields(model_identity={}), fields(), 1)


def test_role_agreement_is_compared_within_a_role_only() -> None:
    a = fields(AFDRole.FFN, role_agreement={"group": 32, "scheme": "w8a8"})
    b = fields(AFDRole.FFN, role_agreement={"group": 64, "scheme": "w8a8"})
    err = refusal(a, b)
    assert err.field == "role_agreement.group" and (err.local, err.remote) == (32, 64)
    c = fields(AFDRole.FFN, role_agreement={"group": 32})
    err = refusal(a, c)
    assert err.field == "role_agreement.scheme" and (err.local, err.remote) == ("w8a8", None)
    err = refusal(c, a)
    assert err.field == "role_agreement.scheme" and (err.local, err.remote) == (None, "w8a8")
    # across roles the other role's agreement is its own business
    _compare_handshake(a, fields(AFDRole.ATTENTION), 0)
    _compare_handshake(fields(AFDRole.ATTENTION), b, 1)


def test_a_publication_without_draft_layers_reads_as_none_drafted() -> None:
    mine = fields(AFDRole.ATTENTION)
    theirs = fields(AFDRole.FFN)
    del theirs["num_draft_layers"]
    _compare_handshake(mine, theirs, 1)  # 4 target layers on both sides
    theirs["num_layers"] = 5
    err = refusal(mine, theirs)
    assert err.field == "num_layers" and (err.local, err.remote) == (4, 5)


def test_a_publication_without_layers_reads_as_zero_layers() -> None:
    mine = fields(AFDRole.ATTENTION)
    theirs = fields(AFDRole.FFN)
    del theirs["num_layers"]
    err = refusal(mine, theirs)
    assert err.field == "num_layers" and (err.local, err.remote) == (4, 0)


def test_a_draft_layer_refusal_names_the_peer() -> None:
    ffn_drafting = P2PConnector(
        AFDConfig(role=AFDRole.FFN), payload_spec=SPEC, num_layers=5, num_draft_layers=1
    ).handshake_fields()
    err = refusal(ffn_drafting, fields(AFDRole.FFN), peer=7)
    assert err.field == "num_draft_layers" and (err.local, err.remote) == (1, 0)
    assert "world rank 7" in str(err)
