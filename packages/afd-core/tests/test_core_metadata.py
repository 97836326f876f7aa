"""Transfer metadata, payloads, payload spec and the control message codec."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from afd_core.errors import AFDPayloadError, AFDProtocolError
from afd_core.metadata import (
    CONTROL_MAGIC,
    CONTROL_VERSION,
    PAYLOAD_FIELDS,
    AFDControlMessage,
    AFDPayload,
    AFDPayloadSpec,
    AFDTransferMetadata,
    dtype_from_name,
    dtype_name,
)


def test_transfer_metadata() -> None:
    m = AFDTransferMetadata(3, 1, [4, 0, 7])  # type: ignore[arg-type]
    assert m.num_tokens == (4, 0, 7) and m.total_tokens == 11
    with pytest.raises(AttributeError):
        m.layer_idx = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((-1, 0, (1,)), "layer_idx"),
        ((True, 0, (1,)), "layer_idx"),
        ((0, -2, (1,)), "stage_idx"),
        ((0, 1.0, (1,)), "stage_idx"),
        ((0, 0, ()), "num_tokens"),
        ((0, 0, (1, -1)), "num_tokens"),
        ((0, 0, (True,)), "num_tokens"),
        ((0, 0, (1.0,)), "num_tokens"),
        ((0, 0, 3), "num_tokens"),
    ],
)
def test_transfer_metadata_invalid(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(AFDPayloadError) as info:
        AFDTransferMetadata(*args)
    assert info.value.field == field


def test_payload_fields() -> None:
    h = torch.zeros(3, 4)
    p = AFDPayload(h, topk_ids=torch.zeros(3, 2, dtype=torch.int32))
    assert p.present_fields == ("hidden_states", "topk_ids")
    assert p.num_tokens == 3
    assert list(p.tensors()) == ["hidden_states", "topk_ids"]
    assert PAYLOAD_FIELDS[0] == "hidden_states"
    with pytest.raises(AFDPayloadError) as info:
        AFDPayload([1, 2])  # type: ignore[arg-type]
    assert info.value.field == "hidden_states"
    with pytest.raises(AFDPayloadError) as info:
        AFDPayload(h, router_logits=[1.0])  # type: ignore[arg-type]
    assert info.value.field == "router_logits"


def test_payload_of_hidden_states_is_the_plain_payload() -> None:
    """The connectors' receive fast path builds the same object as ``AFDPayload(h)``."""
    h = torch.arange(12.0).reshape(3, 4)
    fast, plain = AFDPayload._of_hidden_states(h), AFDPayload(h)
    assert type(fast) is AFDPayload and fast.hidden_states is h
    for f in dataclasses.fields(AFDPayload):  # the other fields: None, as in the plain one
        assert getattr(fast, f.name) is getattr(plain, f.name)
    assert fast.present_fields == plain.present_fields == ("hidden_states",)
    assert fast.num_tokens == 3 and list(fast.tensors()) == ["hidden_states"]
    assert repr(fast) == repr(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.router_logits = h  # type: ignore[misc]
    AFDPayloadSpec(hidden_size=4, dtype=torch.float32).validate_payload(fast, 3, "cpu")


def full_spec() -> AFDPayloadSpec:
    return AFDPayloadSpec(
        hidden_size=4,
        dtype=torch.bfloat16,
        router_logits_width=6,
        router_logits_dtype=torch.float32,
        top_k=2,
        input_ids=True,
    )


def full_payload(n: int) -> AFDPayload:
    return AFDPayload(
        torch.zeros(n, 4, dtype=torch.bfloat16),
        router_logits=torch.zeros(n, 6),
        topk_ids=torch.zeros(n, 2, dtype=torch.int32),
        topk_weights=torch.zeros(n, 2),
        input_ids=torch.zeros(n, dtype=torch.int64),
    )


def test_spec_fields_and_wire() -> None:
    spec = full_spec()
    assert [f.name for f in spec.fields] == list(PAYLOAD_FIELDS)
    assert spec.field_names == frozenset(PAYLOAD_FIELDS)
    assert spec.to_wire() == {
        "hidden_states": [4, "bfloat16"],
        "router_logits": [6, "float32"],
        "topk_ids": [2, "int32"],
        "topk_weights": [2, "float32"],
        "input_ids": [None, "int64"],
    }
    plain = AFDPayloadSpec(hidden_size=8, dtype=torch.float16, router_logits_width=3)
    assert plain.fields[1].dtype == torch.float16  # router logits default to the hidden dtype
    assert plain.output_shape(5) == (5, 8)
    spec.validate_payload(full_payload(3), 3, "cpu")
    spec.validate_payload(full_payload(0), 0, "cpu")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        ({"hidden_states": torch.zeros(3, 5, dtype=torch.bfloat16)}, "hidden_states"),
        ({"hidden_states": torch.zeros(3, 4)}, "hidden_states"),
        ({"hidden_states": torch.zeros(2, 4, dtype=torch.bfloat16)}, "hidden_states"),
        ({"router_logits": None}, "router_logits"),
        ({"router_logits": torch.zeros(3, 5)}, "router_logits"),
        ({"topk_ids": torch.zeros(3, 2, dtype=torch.int64)}, "topk_ids"),
        ({"topk_weights": torch.zeros(3, 3)}, "topk_weights"),
        ({"input_ids": torch.zeros(3, 1, dtype=torch.int64)}, "input_ids"),
        ({"input_ids": None}, "input_ids"),
    ],
)
def test_spec_rejects(mutate: dict[str, Any], field: str) -> None:
    base = full_payload(3)
    fields = {**base.tensors(), **mutate}
    with pytest.raises(AFDPayloadError) as info:
        full_spec().validate_payload(AFDPayload(**fields), 3, "cpu")
    assert info.value.field == field


def test_spec_rejects_extra_fields_and_device() -> None:
    spec = AFDPayloadSpec(hidden_size=4, dtype=torch.float32)
    assert spec.field_names == frozenset({"hidden_states"})
    with pytest.raises(AFDPayloadError) as info:
        spec.validate_payload(AFDPayload(torch.zeros(2, 4), topk_ids=torch.zeros(2, 1)), 2, "cpu")
    assert info.value.field == "topk_ids"
    with pytest.raises(AFDPayloadError) as info:
        spec.validate_payload(AFDPayload(torch.zeros(2, 4)), 2, "cuda")
    assert info.value.field == "hidden_states" and "cuda" in str(info.value)
    with pytest.raises(AFDPayloadError) as info:
        spec.validate_payload("payload", 2, "cpu")  # type: ignore[arg-type]
    assert info.value.field == "payload"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": True}, "hidden_size"),
        ({"dtype": "float32"}, "dtype"),
        ({"router_logits_width": 0}, "router_logits_width"),
        ({"router_logits_dtype": 3}, "router_logits_dtype"),
        ({"top_k": -1}, "top_k"),
        ({"topk_ids_dtype": None}, "topk_ids_dtype"),
        ({"input_ids": 1}, "input_ids"),
    ],
)
def test_spec_invalid(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"hidden_size": 4, "dtype": torch.float32, **kwargs}
    with pytest.raises(AFDPayloadError) as info:
        AFDPayloadSpec(**args)
    assert info.value.field == field


def test_dtype_names() -> None:
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        assert dtype_from_name(dtype_name(d)) == d
    with pytest.raises(AFDPayloadError):
        dtype_from_name("complex64")


@pytest.mark.parametrize(
    "msg",
    [
        AFDControlMessage(((5,),)),
        AFDControlMessage(((1, 2, 3), (4, 0, 6)), is_warmup=True),
        AFDControlMessage(((64,), (1,)), is_capture=True),
        AFDControlMessage(((7, 8),), is_warmup=True, is_capture=True),
        AFDControlMessage(((3,),), is_draft=True),
        AFDControlMessage.shutdown_message(),
    ],
)
def test_control_roundtrip(msg: AFDControlMessage) -> None:
    wire = msg.encode()
    assert wire.dtype == torch.int64 and wire.dim() == 1
    assert int(wire[0]) == CONTROL_MAGIC and int(wire[1]) == CONTROL_VERSION
    assert AFDControlMessage.decode(wire) == msg
    assert wire.tolist() == msg.words()
    assert AFDControlMessage.decode_words(msg.words()) == msg


def test_control_helpers() -> None:
    msg = AFDControlMessage([[1, 2, 3], [4, 5, 6]])  # type: ignore[arg-type]
    assert msg.stage_token_counts == ((1, 2, 3), (4, 5, 6))
    assert (msg.num_stages, msg.width) == (2, 3)
    assert msg.select([2, 0]).stage_token_counts == ((3, 1), (6, 4))
    meta = msg.transfer_metadata(4, 1)
    assert meta == AFDTransferMetadata(4, 1, (4, 5, 6))
    with pytest.raises(AFDPayloadError) as info:
        msg.transfer_metadata(0, 2)
    assert info.value.field == "stage_idx"
    assert AFDControlMessage.shutdown_message().shutdown


@pytest.mark.parametrize(
    ("layer", "stage", "field"),
    [
        (-1, 0, "layer_idx"),
        (True, 0, "layer_idx"),
        (1.0, 0, "layer_idx"),
        ("1", 0, "layer_idx"),
        (0, True, "stage_idx"),
        (0, -1, "stage_idx"),
        (0, 1.0, "stage_idx"),
    ],
)
def test_control_transfer_metadata_checks_what_it_does_not_take_from_the_message(
    layer: Any, stage: Any, field: str
) -> None:
    # The counts come from the (validated) message; the indices are the caller's.
    msg = AFDControlMessage(((3,), (5,)))
    with pytest.raises(AFDPayloadError) as info:
        msg.transfer_metadata(layer, stage)
    assert info.value.field == field
    assert info.value.value == (layer if field == "layer_idx" else stage)
    meta = msg.transfer_metadata(7, 1)  # the same object the checked constructor builds
    assert type(meta) is AFDTransferMetadata
    assert (meta.layer_idx, meta.stage_idx, meta.num_tokens) == (7, 1, (5,))
    assert meta == AFDTransferMetadata(7, 1, (5,)) and hash(meta) == hash(
        AFDTransferMetadata(7, 1, (5,))
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stage_token_counts": ()}, "stage_token_counts"),
        ({"stage_token_counts": ((1, 2), (3,))}, "stage_token_counts"),
        ({"stage_token_counts": ((),)}, "stage_token_counts"),
        ({"stage_token_counts": ((-1,),)}, "stage_token_counts"),
        ({"stage_token_counts": ((True,),)}, "stage_token_counts"),
        ({"stage_token_counts": (5,)}, "stage_token_counts"),
        ({"stage_token_counts": ((1,),), "is_warmup": 1}, "is_warmup"),
        ({"stage_token_counts": ((1,),), "shutdown": "no"}, "shutdown"),
    ],
)
def test_control_invalid(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(AFDPayloadError) as info:
        AFDControlMessage(**kwargs)
    assert info.value.field == field


def test_control_decode_rejects_malformed() -> None:
    good = AFDControlMessage(((1, 2), (3, 4))).encode()
    bad_magic = good.clone()
    bad_magic[0] = 123
    bad_version = good.clone()
    bad_version[1] = CONTROL_VERSION + 1
    bad_flags = good.clone()
    bad_flags[2] = 64
    cases = [
        good.to(torch.int32),
        good.view(1, -1),
        good[:3],
        bad_magic,
        bad_version,
        bad_flags,
        good[:-1],
        torch.cat([good, torch.zeros(1, dtype=torch.int64)]),
        torch.tensor([CONTROL_MAGIC, CONTROL_VERSION, 0, 1, 1, -3]),
        torch.tensor([CONTROL_MAGIC, CONTROL_VERSION, 0, 0, 0]),  # no stages, not shutdown
    ]
    for wire in cases:
        with pytest.raises(AFDProtocolError):
            AFDControlMessage.decode(wire)
    with pytest.raises(AFDProtocolError, match="version"):
        AFDControlMessage.decode(bad_version)
