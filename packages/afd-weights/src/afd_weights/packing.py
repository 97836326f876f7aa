"""Bit-exact int4 packing and int64 scale encoding used by the Ascend int4 kernels.

Invariants:

* int4 values are signed two's complement in ``[-8, 7]``.
* Packing runs along the **last** dimension. In each byte the even element is the low nibble and
  the odd element the high nibble: ``byte = (v[2j+1] << 4) | (v[2j] & 0xF)``.
* The int32 form is the little-endian reinterpretation of four such bytes, so nibble ``i`` of a word
  (counting from the least significant) is element ``8m + i``.
* A scale is encoded in int64 as its fp32 bit pattern zero-extended (low word = fp32 bits, high word
  = 0); no truncation, no flag bits.

Every function here is exact: ``unpack(pack(v)) == v`` and ``decode(encode(s))`` is bit-identical.
"""

from __future__ import annotations

import sys

import torch

from afd_weights.errors import QuantizationError

__all__ = [
    "INT4_MAX",
    "INT4_MIN",
    "decode_scale_int64",
    "encode_scale_int64",
    "pack_int4",
    "pack_int4_to_int32",
    "unpack_int4",
    "unpack_int4_from_int32",
]

INT4_MIN = -8
INT4_MAX = 7
_LOW_WORD = 0xFFFFFFFF


def _require_little_endian() -> None:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little endian
        raise QuantizationError("sys.byteorder", sys.byteorder, "'little' (int32 nibble order)")


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values (stored one per int8) two per byte along the last dimension.

    Args:
        values: an int8 tensor with every element in ``[-8, 7]`` and an even last dimension.

    Returns:
        A contiguous int8 tensor whose last dimension is half as long.
    """
    if values.dtype != torch.int8:
        raise QuantizationError("values.dtype", values.dtype, "torch.int8 holding int4 values")
    if values.dim() == 0 or values.shape[-1] % 2 != 0:
        raise QuantizationError(
            "values.shape", tuple(values.shape), "a last dimension that is even"
        )
    if values.numel() and (int(values.min()) < INT4_MIN or int(values.max()) > INT4_MAX):
        bad = (int(values.min()), int(values.max()))
        raise QuantizationError("values (min, max)", bad, f"[{INT4_MIN}, {INT4_MAX}]")
    v = values.to(torch.int16)
    low = v[..., 0::2] & 0xF
    high = (v[..., 1::2] & 0xF) << 4
    byte = (high | low).to(torch.uint8)
    return byte.view(torch.int8).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: one signed int4 value per int8, last dimension doubled."""
    if packed.dtype != torch.int8:
        raise QuantizationError("packed.dtype", packed.dtype, "torch.int8 (two int4 per byte)")
    if packed.dim() == 0:
        raise QuantizationError("packed.shape", (), "at least one dimension")
    b = packed.to(torch.int16) & 0xFF
    low = b & 0xF
    high = (b >> 4) & 0xF
    low = torch.where(low >= 8, low - 16, low)
    high = torch.where(high >= 8, high - 16, high)
    out = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return out.to(torch.int8)


def pack_int4_to_int32(values: torch.Tensor) -> torch.Tensor:
    """Pack signed int4 values eight per int32 word along the last dimension (LSB first).

    The last dimension of ``values`` must be a multiple of 8; the result's is one eighth of it.
    """
    _require_little_endian()
    if values.dim() == 0 or values.shape[-1] % 8 != 0:
        shape = tuple(values.shape)
        raise QuantizationError("values.shape", shape, "a last dimension that is a multiple of 8")
    return pack_int4(values).view(torch.int32)


def unpack_int4_from_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_to_int32`: int8 values, last dimension multiplied by 8."""
    _require_little_endian()
    if packed.dtype != torch.int32:
        raise QuantizationError("packed.dtype", packed.dtype, "torch.int32 (eight int4 per word)")
    if packed.dim() == 0:
        raise QuantizationError("packed.shape", (), "at least one dimension")
    return unpack_int4(packed.contiguous().view(torch.int8))


def encode_scale_int64(scale: torch.Tensor) -> torch.Tensor:
    """Encode fp32 scales as int64: the fp32 bit pattern, zero-extended.

    Only float32 input is accepted, so that no rounding happens silently; round explicitly first.
    """
    if scale.dtype != torch.float32:
        raise QuantizationError("scale.dtype", scale.dtype, "torch.float32")
    bits = scale.contiguous().view(torch.int32).to(torch.int64)
    return bits & _LOW_WORD


def decode_scale_int64(encoded: torch.Tensor) -> torch.Tensor:
    """Decode :func:`encode_scale_int64` output back to fp32 (bit-exact).

    Raises :class:`QuantizationError` when a high word is not zero (not an encoded fp32 scale).
    """
    if encoded.dtype != torch.int64:
        raise QuantizationError("encoded.dtype", encoded.dtype, "torch.int64")
    if encoded.numel() and bool(((encoded >> 32) != 0).any()):
        raise QuantizationError("encoded", "a value with a non-zero high word", "fp32 bits < 2**32")
    low = encoded.contiguous()
    signed = torch.where(low >= 2**31, low - 2**32, low).to(torch.int32)
    return signed.view(torch.float32)
