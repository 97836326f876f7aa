"""Quantization schemes understood by the expert-weight contract."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["QuantScheme"]


class QuantScheme(StrEnum):
    """The expert-weight quantization scheme.

    * ``W8A8``: int8 weights, symmetric per-output-channel fp32 scales, int8 dynamic activations.
    * ``W4A8_PER_CHANNEL``: int4 weights packed eight to an int32 word, one scale per output channel
      (fp32 bits stored in int64), plus the fp32 ``scale_bias`` the int4 kernels add.
    * ``W4A8_PER_GROUP``: as above but with one scale per (input group, output channel).
    """

    W8A8 = "w8a8"
    W4A8_PER_CHANNEL = "w4a8_per_channel"
    W4A8_PER_GROUP = "w4a8_per_group"

    @property
    def is_int4(self) -> bool:
        """True for both W4A8 variants."""
        return self is not QuantScheme.W8A8

    @property
    def is_per_group(self) -> bool:
        """True only for W4A8 with per-group scales."""
        return self is QuantScheme.W4A8_PER_GROUP

    @property
    def weight_values_per_element(self) -> int:
        """Logical weight values per stored weight element (8 for int32-packed int4, else 1)."""
        return 8 if self.is_int4 else 1
