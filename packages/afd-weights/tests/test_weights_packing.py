"""Bit-exact int4 packing and int64 scale encoding (property tests + fixed examples)."""

import struct

import pytest
import torch
from afd_weights import (
    QuantizationError,
    decode_scale_int64,
    encode_scale_int64,
    pack_int4,
    pack_int4_to_int32,
    unpack_int4,
    unpack_int4_from_int32,
)
from hypothesis import given, settings
from hypothesis import strategies as st

int4_rows = st.lists(st.integers(-8, 7), min_size=1, max_size=64)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), values=int4_rows)
def test_pack_int4_round_trip(rows: int, values: list[int]) -> None:
    vals = values + values[:1] if len(values) % 2 else values
    t = torch.tensor([vals] * rows, dtype=torch.int8)
    packed = pack_int4(t)
    assert packed.dtype == torch.int8
    assert packed.shape == (rows, len(vals) // 2)
    assert torch.equal(unpack_int4(packed), t)


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 8), data=st.data())
def test_pack_int4_to_int32_round_trip(words: int, data: st.DataObject) -> None:
    vals = data.draw(st.lists(st.integers(-8, 7), min_size=8 * words, max_size=8 * words))
    t = torch.tensor([vals, vals[::-1]], dtype=torch.int8)
    packed = pack_int4_to_int32(t)
    assert packed.dtype == torch.int32
    assert packed.shape == (2, words)
    assert torch.equal(unpack_int4_from_int32(packed), t)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.floats(min_value=2.0**-100, max_value=2.0**100, width=32),
        min_size=1,
        max_size=32,
    )
)
def test_scale_encoding_round_trip_is_bit_exact(values: list[float]) -> None:
    s = torch.tensor(values, dtype=torch.float32)
    enc = encode_scale_int64(s)
    assert enc.dtype == torch.int64
    assert bool(((enc >> 32) == 0).all())
    assert torch.equal(decode_scale_int64(enc).view(torch.int32), s.view(torch.int32))


def test_nibble_order_low_nibble_is_even_element() -> None:
    t = torch.tensor([[1, -2, 3, 4, -8, 7, 0, -1]], dtype=torch.int8)
    packed = pack_int4(t)
    # byte = (odd << 4) | (even & 0xF): (-2<<4 | 1) = 0xE1, (4<<4 | 3) = 0x43, 0x78, 0xF0
    assert packed.view(torch.uint8).tolist() == [[0xE1, 0x43, 0x78, 0xF0]]
    word = pack_int4_to_int32(t)
    # little endian: element 8m+i is nibble i counting from the least significant one
    assert word.item() == int.from_bytes(bytes([0xE1, 0x43, 0x78, 0xF0]), "little", signed=True)


def test_scale_encoding_is_zero_extended_fp32_bits() -> None:
    s = torch.tensor([1.0, 0.5, 3.0e-3], dtype=torch.float32)
    expected = [int.from_bytes(struct.pack("<f", v), "little") for v in s.tolist()]
    assert encode_scale_int64(s).tolist() == expected
    assert encode_scale_int64(torch.tensor([1.0]))[0].item() == 0x3F800000


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: pack_int4(torch.tensor([[8, 0]], dtype=torch.int8)), "values (min, max)"),
        (lambda: pack_int4(torch.tensor([[1, 2, 3]], dtype=torch.int8)), "values.shape"),
        (lambda: pack_int4(torch.tensor([[1, 2]], dtype=torch.int32)), "values.dtype"),
        (lambda: pack_int4_to_int32(torch.zeros(1, 4, dtype=torch.int8)), "values.shape"),
        (lambda: unpack_int4_from_int32(torch.zeros(1, 4, dtype=torch.int8)), "packed.dtype"),
        (lambda: unpack_int4(torch.zeros(1, 4, dtype=torch.int32)), "packed.dtype"),
        (lambda: encode_scale_int64(torch.ones(2, dtype=torch.bfloat16)), "scale.dtype"),
        (lambda: decode_scale_int64(torch.ones(2, dtype=torch.int32)), "encoded.dtype"),
        (lambda: decode_scale_int64(torch.tensor([1 << 40])), "encoded"),
    ],
)
def test_packing_rejects_bad_input(call: object, field: str) -> None:
    with pytest.raises(QuantizationError) as info:
        call()  # type: ignore[operator]
    assert info.value.field == field
