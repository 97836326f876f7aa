"""AFDConfig parsing and validation: every field's invalid values, unknown keys, aliases, hash."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
from afd_core.config import (
    ADDITIONAL_CONFIG_FLAG,
    CONFIG_FIELDS,
    AFDConfig,
    AFDConfigError,
    AFDRole,
    parse_additional_config_json,
    parse_afd_config,
)


def cfg(**kw: Any) -> AFDConfig:
    raw: dict[str, Any] = {"role": "attention"}
    raw.update(kw)
    return AFDConfig.from_mapping(raw)


def test_defaults_and_types() -> None:
    c = cfg()
    assert c.role is AFDRole.ATTENTION
    assert (c.connector, c.host, c.port) == ("p2p", "127.0.0.1", 1239)
    assert (c.num_attention_ranks, c.num_ffn_ranks) == (1, 1)
    assert c.compute_gate_on_attention is False
    assert c.timeout_s == 120.0 and isinstance(c.timeout_s, float)
    assert c.startup_timeout_s == 300.0 and isinstance(c.startup_timeout_s, float)
    assert c.ffn_compute == "native"
    assert c.num_stages == 1
    assert dict(c.connector_extra_config) == {}
    assert c.is_attention and not c.is_ffn


def test_full_mapping_and_roundtrip() -> None:
    raw = {
        "role": "ffn",
        "connector": "p2p",
        "host": "10.0.0.2",
        "port": 4000,
        "num_attention_ranks": 5,
        "num_ffn_ranks": 3,
        "expert_replicas": "2",
        "attention_tp_size": "2",
        "ffn_rank": 2,
        "compute_gate_on_attention": True,
        "num_stages": "2",
        "timeout_s": 7,
        "startup_timeout_s": "30",
        "ffn_loss_grace_s": "12.5",
        "ffn_compute": "Layered",
        "expert_dispatch": "Attention",
        "expert_quant": "W4A8",
        "expert_quant_group_size": "32",
        "connector_extra_config": {"check_sequence": True},
    }
    c = AFDConfig.from_mapping(raw)
    assert c.role is AFDRole.FFN and c.is_ffn
    assert c.to_mapping() == {
        **raw,
        "expert_replicas": 2,
        "attention_tp_size": 2,
        "num_stages": 2,
        "timeout_s": 7.0,
        "startup_timeout_s": 30.0,
        "ffn_loss_grace_s": 12.5,
        "ffn_compute": "layered",
        "expert_dispatch": "attention",
        "expert_quant": "w4a8",
        "expert_quant_group_size": 32,
    }
    assert AFDConfig.from_mapping(c.to_mapping()) == c
    assert set(c.to_mapping()) == set(CONFIG_FIELDS)


def test_config_is_frozen_and_extra_read_only() -> None:
    c = cfg(connector_extra_config={"check_sequence": False})
    with pytest.raises(AttributeError):
        c.port = 5  # type: ignore[misc]
    assert isinstance(c.connector_extra_config, MappingProxyType)
    with pytest.raises(TypeError):
        c.connector_extra_config["check_sequence"] = True  # type: ignore[index]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("role", " FFN ", AFDRole.FFN),
        ("port", "4001", 4001),
        ("num_attention_ranks", "+3", 3),
        ("compute_gate_on_attention", "yes", True),
        ("compute_gate_on_attention", "Off", False),
        ("compute_gate_on_attention", "1", True),
        ("timeout_s", "2.5", 2.5),
        ("timeout_s", 3, 3.0),
        ("startup_timeout_s", "600", 600.0),
        ("expert_quant", " NONE ", "none"),
        ("connector", " p2p ", "p2p"),
        ("connector", "P2pNcclAFDConnector", "p2p"),
        ("host", " localhost ", "localhost"),
    ],
)
def test_strict_coercion_accepts(field: str, value: Any, expected: Any) -> None:
    assert getattr(cfg(**{field: value}), field) == expected


INVALID: list[tuple[str, Any]] = [
    ("role", "decoder"),
    ("role", 1),
    ("role", None),
    ("role", True),
    ("connector", ""),
    ("connector", "   "),
    ("connector", "nccl-magic"),
    ("connector", 3),
    ("host", ""),
    ("host", "a b"),
    ("host", 127),
    ("port", 0),
    ("port", 65536),
    ("port", -1),
    ("port", True),
    ("port", 1239.0),
    ("port", "12a"),
    ("port", "1.5"),
    ("port", None),
    ("num_attention_ranks", 0),
    ("num_attention_ranks", False),
    ("num_attention_ranks", 2.0),
    ("num_attention_ranks", "two"),
    ("num_ffn_ranks", 0),
    ("num_ffn_ranks", True),
    ("num_ffn_ranks", 1.0),
    ("expert_replicas", 0),
    ("expert_replicas", 2),  # more replicas than the default num_ffn_ranks=1
    ("expert_replicas", True),
    ("expert_replicas", 1.0),
    ("attention_tp_size", 0),
    ("attention_tp_size", True),
    ("attention_tp_size", 2.0),
    ("attention_tp_size", 65537),
    ("ffn_rank", 1),  # an FFN-role field, not 0 on the Attention role
    ("compute_gate_on_attention", 1),
    ("compute_gate_on_attention", 0),
    ("compute_gate_on_attention", "maybe"),
    ("compute_gate_on_attention", None),
    ("num_stages", 0),
    ("num_stages", 3),
    ("num_stages", True),
    ("num_stages", 2.0),
    ("timeout_s", 0),
    ("timeout_s", -1.0),
    ("timeout_s", float("inf")),
    ("timeout_s", float("nan")),
    ("timeout_s", True),
    ("timeout_s", "soon"),
    ("startup_timeout_s", 0),
    ("startup_timeout_s", float("inf")),
    ("startup_timeout_s", False),
    ("ffn_compute", "bogus"),
    ("ffn_compute", ""),
    ("ffn_compute", 1),
    ("connector_extra_config", [("check_sequence", True)]),
    ("connector_extra_config", "check_sequence"),
    ("connector_extra_config", {1: True}),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_every_invalid_value_names_field(field: str, value: Any) -> None:
    with pytest.raises(AFDConfigError) as info:
        cfg(**{field: value})
    assert info.value.field == field
    reported = info.value.value
    if isinstance(value, float) and value != value:  # NaN
        assert reported != reported
    elif isinstance(value, str):
        assert reported in (value, value.strip())
    else:
        assert reported == value
    assert field in str(info.value)
    assert "allowed" in str(info.value)


def test_expert_parallel_requires_the_gate_on_attention() -> None:
    with pytest.raises(AFDConfigError) as info:
        cfg(num_attention_ranks=2, num_ffn_ranks=2)
    assert info.value.field == "compute_gate_on_attention" and info.value.value is False
    assert "num_ffn_ranks=2" in str(info.value)
    # A < F is allowed (experts can outgrow attention).
    c = cfg(num_attention_ranks=1, num_ffn_ranks=3, compute_gate_on_attention=True)
    assert c.num_ffn_ranks == 3


def test_expert_replicas_name_the_ffn_ranks_they_live_on() -> None:
    with pytest.raises(AFDConfigError) as info:
        cfg(num_ffn_ranks=2, compute_gate_on_attention=True, expert_replicas=3)
    assert info.value.field == "expert_replicas" and info.value.value == 3
    assert "1..2" in str(info.value) and "num_ffn_ranks" in str(info.value)
    c = cfg(num_ffn_ranks=2, compute_gate_on_attention=True, expert_replicas=2)
    other = cfg(num_ffn_ranks=2, compute_gate_on_attention=True)
    # Both roles must agree on it: it is part of the agreement hash.
    assert c.agreement_fields()["expert_replicas"] == 2
    assert c.agreement_hash() != other.agreement_hash()


@pytest.mark.parametrize(
    ("kw", "value"),
    [
        ({"role": "ffn", "num_ffn_ranks": 2, "ffn_rank": 2}, 2),
        ({"role": "ffn", "ffn_rank": -1}, -1),
        ({"role": "ffn", "ffn_rank": True}, True),
        ({"role": "attention", "num_ffn_ranks": 2, "ffn_rank": 1}, 1),
    ],
)
def test_ffn_rank_checked(kw: dict[str, object], value: object) -> None:
    raw = {"compute_gate_on_attention": True, **kw}
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping(raw)
    assert info.value.field == "ffn_rank" and info.value.value == value
    ok = AFDConfig.from_mapping(
        {"role": "ffn", "num_ffn_ranks": 2, "ffn_rank": "1", "compute_gate_on_attention": True}
    )
    assert ok.ffn_rank == 1


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"check_sequence": 1}, "connector_extra_config.check_sequence"),
        ({"check_sequence": "true"}, "connector_extra_config.check_sequence"),
        ({"buffer_mb": 4}, "connector_extra_config.buffer_mb"),
    ],
)
def test_connector_validates_its_extra_config(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(AFDConfigError) as info:
        cfg(connector_extra_config=extra)
    assert info.value.field == field


def test_none_extra_config_is_empty() -> None:
    assert dict(cfg(connector_extra_config=None).connector_extra_config) == {}


@pytest.mark.parametrize("key", ["async_dp", "afd_role_rank", "num_attention_servers", "Role", ""])
def test_unknown_keys_rejected(key: str) -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"role": "ffn", key: 1})
    assert info.value.field == key
    assert "connector_extra_config" in str(info.value)


def test_non_string_key_rejected() -> None:
    with pytest.raises(AFDConfigError):
        AFDConfig.from_mapping({"role": "ffn", 3: 1})


def test_missing_role() -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"port": 5})
    assert info.value.field == "role"


@pytest.mark.parametrize(
    ("alias", "canonical", "value", "expected"),
    [
        ("afd_role", "role", "ffn", AFDRole.FFN),
        ("afd_connector", "connector", "p2p", "p2p"),
        ("afd_host", "host", "h1", "h1"),
        ("afd_port", "port", 4321, 4321),
    ],
)
def test_aliases(alias: str, canonical: str, value: Any, expected: Any) -> None:
    raw: dict[str, Any] = {"role": "attention"}
    if canonical == "role":
        raw = {}
    raw[alias] = value
    assert getattr(AFDConfig.from_mapping(raw), canonical) == expected
    # alias together with its canonical key: conflict names the canonical field.
    both = {"role": "attention", alias: value, canonical: value}
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping(both)
    assert info.value.field == canonical
    assert alias in str(info.value)


def test_not_a_mapping() -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping(["role", "ffn"])  # type: ignore[arg-type]
    assert info.value.field == "afd"


@pytest.mark.parametrize(
    ("kw", "field", "value"),
    [
        ({"ffn_compute": "layered"}, "ffn_compute", "layered"),
        ({"ffn_compute": "mega"}, "ffn_compute", "mega"),
        ({"expert_quant": "w8a8"}, "expert_quant", "w8a8"),
        ({"ffn_compute": "layered", "expert_quant": "int4"}, "expert_quant", "int4"),
        (
            {"ffn_compute": "layered", "expert_quant": "w8a8", "expert_quant_group_size": 32},
            "expert_quant_group_size",
            32,
        ),
        (
            {"ffn_compute": "mega", "expert_quant": "w4a8", "expert_quant_group_size": -1},
            "expert_quant_group_size",
            -1,
        ),
    ],
)
def test_invalid_compute_and_quant_combinations_name_the_field(
    kw: dict[str, Any], field: str, value: Any
) -> None:
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"role": "ffn", **kw})
    assert (info.value.field, info.value.value) == (field, value)
    ok = AFDConfig.from_mapping(
        {
            "role": "ffn",
            "ffn_compute": "mega",
            "expert_quant": "w4a8",
            "expert_quant_group_size": 32,
        }
    )
    assert (ok.ffn_compute, ok.expert_quant, ok.expert_quant_group_size) == ("mega", "w4a8", 32)


def test_expert_dispatch_fits_the_ffn_compute_and_names_the_field() -> None:
    ep = {"num_ffn_ranks": 2, "compute_gate_on_attention": True}
    mega = {"role": "ffn", "ffn_compute": "mega", "expert_quant": "w8a8", **ep}
    ok = AFDConfig.from_mapping({**mega, "expert_dispatch": "FFN"})
    assert ok.expert_dispatch == "ffn" and ok.needs_ffn_group
    assert AFDConfig.from_mapping({"role": "attention", **ep, "expert_dispatch": "ffn"})
    # One FFN rank: both ways are the same (every token goes to it).
    one = AFDConfig.from_mapping({**mega, "num_ffn_ranks": 1})
    assert one.expert_dispatch == "attention" and one.needs_ffn_group
    assert not AFDConfig.from_mapping({"role": "ffn"}).needs_ffn_group
    refused = [
        ({**mega}, "attention", "'ffn' with ffn_compute='mega' and num_ffn_ranks=2"),
        (
            {"role": "ffn", "ffn_compute": "layered", "expert_quant": "w8a8", **ep},
            "ffn",
            "'attention' with ffn_compute='layered'",
        ),
        ({"role": "ffn", **ep}, "ffn", "'attention' with ffn_compute='native'"),
        (
            {"role": "attention", "num_ffn_ranks": 3, "compute_gate_on_attention": True},
            "ffn",
            None,
        ),
        ({"role": "attention", **ep, "expert_dispatch": "home"}, "home", "one of"),
    ]
    for raw, value, allowed in refused:
        raw = {"expert_dispatch": value, **raw} if "expert_dispatch" not in raw else raw
        if allowed is None:  # replicated experts: each would live on two ranks
            raw = {**raw, "expert_replicas": 2}
            allowed = "'attention' with expert_replicas=2"
        with pytest.raises(AFDConfigError) as info:
            AFDConfig.from_mapping(raw)
        assert (info.value.field, info.value.value) == ("expert_dispatch", value), raw
        assert allowed in info.value.allowed, (raw, info.value.allowed)


def test_direct_construction_does_not_coerce() -> None:
    assert AFDConfig(role=AFDRole.FFN).role is AFDRole.FFN
    assert AFDConfig(role="ffn").role is AFDRole.FFN  # type: ignore[arg-type]
    for kwargs, field in [
        ({"role": "FFN"}, "role"),
        ({"role": "ffn", "port": "1239"}, "port"),
        ({"role": "ffn", "compute_gate_on_attention": "true"}, "compute_gate_on_attention"),
        ({"role": "ffn", "host": " h"}, "host"),
        ({"role": "ffn", "timeout_s": "1"}, "timeout_s"),
        ({"role": "ffn", "ffn_compute": "Native"}, "ffn_compute"),
    ]:
        with pytest.raises(AFDConfigError) as info:
            AFDConfig(**kwargs)
        assert info.value.field == field


def test_parse_afd_config() -> None:
    assert parse_afd_config(None) is None
    assert parse_afd_config({}) is None
    assert parse_afd_config({"other": 1}) is None
    c = parse_afd_config({"afd": {"role": "ffn", "port": 77}})
    assert c is not None and c.port == 77 and c.role is AFDRole.FFN

    class FakeVllmConfig:
        def __init__(self) -> None:
            self.additional_config = {"afd": {"role": "attention"}}

    from_obj = parse_afd_config(FakeVllmConfig())
    assert from_obj is not None and from_obj.role is AFDRole.ATTENTION
    with pytest.raises(AFDConfigError) as info:
        parse_afd_config(42)
    assert info.value.field == "additional_config"
    with pytest.raises(AFDConfigError) as info:
        parse_afd_config({"afd": "ffn"})
    assert info.value.field == "afd"


def test_additional_config_json_text_parses_to_the_mapping() -> None:
    text = '{"afd": {"role": "ffn", "port": 29700}, "other": [1, 2]}'
    assert parse_additional_config_json(text) == {
        "afd": {"role": "ffn", "port": 29700},
        "other": [1, 2],
    }
    parsed = parse_afd_config(text)
    assert parsed is not None and parsed.role is AFDRole.FFN and parsed.port == 29700
    assert parse_afd_config('{"other": 1}') is None


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # truncated: the parser stops at the end of the text
        ('{"afd": {"role": "ffn",', "line 1 column 24 (char 23)"),
        # trailing comma inside an object
        ('{"afd": {"role": "ffn",}}', "line 1 column 24 (char 23)"),
        # single quotes (a Python dict, not JSON)
        ("{'afd': {'role': 'ffn'}}", "line 1 column 2 (char 1)"),
        # a newline in the text: the line and column point into the second line
        ('{"afd":\n {"role": ffn}}', "line 2 column 11 (char 18)"),
        ("", "line 1 column 1 (char 0)"),
    ],
)
def test_malformed_additional_config_names_the_flag_and_the_position(text: str, where: str) -> None:
    for parse in (parse_additional_config_json, parse_afd_config):
        with pytest.raises(AFDConfigError) as info:
            parse(text)
        assert info.value.field == ADDITIONAL_CONFIG_FLAG == "--additional-config"
        assert info.value.value == text
        message = str(info.value)
        assert "not valid JSON" in message and where in message
        assert "<-- here -->" in message


def test_malformed_additional_config_shows_the_text_around_the_error() -> None:
    text = '{"afd": {"role": "attention", "port": 29700 "num_ffn_ranks": 1}}'
    with pytest.raises(AFDConfigError) as info:
        parse_additional_config_json(text)
    # 24 characters on each side of the position (char 44, where a comma is missing)
    expected = '\'tention", "port": 29700 \' <-- here --> \'"num_ffn_ranks": 1}}\''
    assert "Expecting ',' delimiter at line 1 column 45 (char 44)" in str(info.value)
    assert expected in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"afd"', "42", "null"])
def test_additional_config_json_must_be_an_object(text: str) -> None:
    with pytest.raises(AFDConfigError) as info:
        parse_additional_config_json(text)
    assert info.value.field == "--additional-config"
    assert "not an object" in str(info.value)


def test_additional_config_json_refuses_a_repeated_key() -> None:
    text = '{"afd": {"role": "ffn", "port": 1, "role": "attention"}}'
    with pytest.raises(AFDConfigError) as info:
        parse_additional_config_json(text)
    assert info.value.field == "--additional-config"
    assert info.value.value == text
    assert "key 'role' appears twice" in str(info.value)


def test_agreement_hash_covers_exactly_the_shared_fields() -> None:
    base = cfg(num_attention_ranks=4, num_ffn_ranks=2, compute_gate_on_attention=True)
    same = [
        {"role": "ffn"},
        {"role": "ffn", "ffn_rank": 1},  # each FFN rank says which it is
        {"timeout_s": 1.0},
        {"startup_timeout_s": 5.0},
        {"ffn_compute": "layered", "expert_quant": "w8a8"},  # FFN-local choices
        {"ffn_compute": "mega", "expert_quant": "w4a8", "expert_quant_group_size": 64},
    ]
    different = [
        {"connector_extra_config": {"check_sequence": True}},
        {"compute_gate_on_attention": False, "num_ffn_ranks": 1},
        {"num_attention_ranks": 3},
        {"attention_tp_size": 2},  # the FFN ranks must expect every TP worker as a peer
        {"num_ffn_ranks": 1},
        {"port": 1240},
        {"host": "127.0.0.2"},
        {"expert_dispatch": "ffn"},  # both roles must send the same way
    ]
    raw = base.to_mapping()
    for change in same:
        assert AFDConfig.from_mapping({**raw, **change}).agreement_hash() == base.agreement_hash()
    hashes = {base.agreement_hash()}
    for change in different:
        hashes.add(AFDConfig.from_mapping({**raw, **change}).agreement_hash())
    assert len(hashes) == len(different) + 1
    # Stable: a fixed value, independent of process and dict ordering.
    reordered = AFDConfig.from_mapping(dict(reversed(list(raw.items()))))
    assert reordered.agreement_hash() == base.agreement_hash()
    assert len(base.agreement_hash()) == 64


def test_config_hashable_and_equal() -> None:
    assert cfg() == cfg()
    assert hash(cfg()) == hash(cfg())
    assert cfg() != cfg(port=2)


def test_num_stages_is_agreed_by_both_roles() -> None:
    """Both roles must run the same number of stages: it is in the handshake's agreement."""
    one, two = cfg(), cfg(num_stages=2)
    assert one.agreement_fields()["num_stages"] == 1
    assert two.agreement_fields()["num_stages"] == 2
    assert one.agreement_hash() != two.agreement_hash()
    assert cfg(role=AFDRole.FFN, num_stages=2).agreement_hash() == two.agreement_hash()


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        (-1, "seconds >= 0"),
        (float("inf"), "seconds >= 0"),
        (float("nan"), "seconds >= 0"),
        (True, "a number (not bool)"),
        ("soon", "a number or a numeric string"),
    ],
)
def test_ffn_loss_grace_rejects_what_is_not_seconds(value: object, allowed: str) -> None:
    with pytest.raises(AFDConfigError) as err:
        AFDConfig.from_mapping({"role": "attention", "ffn_loss_grace_s": value})
    assert err.value.field == "ffn_loss_grace_s"
    assert allowed in str(err.value)


def test_ffn_loss_grace_zero_accepted_and_local_to_each_role() -> None:
    assert cfg().ffn_loss_grace_s == 60.0
    assert (
        AFDConfig.from_mapping({"role": "attention", "ffn_loss_grace_s": 0}).ffn_loss_grace_s == 0
    )
    held = AFDConfig.from_mapping({"role": "attention", "ffn_loss_grace_s": 5})
    # The FFN role never reads it: the roles need not agree on it.
    assert held.agreement_hash() == cfg().agreement_hash()


def test_attention_peers_are_bounded_by_the_rank_limit() -> None:
    """A x T Attention peers: each count valid alone, the product too large, refused naming
    attention_tp_size and the largest value allowed."""
    with pytest.raises(AFDConfigError) as info:
        AFDConfig(role=AFDRole.ATTENTION, num_attention_ranks=4, attention_tp_size=16385)
    assert (info.value.field, info.value.value) == ("attention_tp_size", 16385)
    assert info.value.allowed.startswith("at most 16384 with num_attention_ranks=4")
