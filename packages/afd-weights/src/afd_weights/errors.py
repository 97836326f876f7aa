"""Exception types raised by afd-weights.

Every error names what was wrong (the field or tensor), the value seen and what is allowed, and is
raised before any side effect (no tensor is copied, packed or registered when validation fails).
"""

from __future__ import annotations

from afd_core.errors import AFDFieldError

__all__ = ["QuantizationError", "WeightLayoutError", "WeightsError"]


class WeightsError(AFDFieldError, ValueError):
    """Base class of every afd-weights error (afd-core's
    :class:`~afd_core.errors.AFDFieldError`, and a ``ValueError``).

    ``field`` is the argument, attribute or tensor name that was rejected, ``value`` the rejected
    value (or a short description of it, e.g. a shape), ``allowed`` what would have been accepted;
    ``context`` (optional, e.g. ``"layer 3"``) says where, and is the message's detail.
    """

    subject = "afd-weights value"

    def __init__(self, field: str, value: object, allowed: str, *, context: str = "") -> None:
        self.context = context
        super().__init__(field, value, allowed, detail=context or None)


class WeightLayoutError(WeightsError):
    """A tensor of one layer does not have the expected shape, dtype, device or strides.

    Attributes (in addition to :class:`WeightsError`'s):
        layer_id: the layer whose tensor was rejected (None when not layer specific).
        tensor: the tensor's name inside the layer (e.g. ``"w13_scale"``).
        expected: the expected property (shape, dtype, stride or device).
        actual: the property found.
    """

    def __init__(
        self,
        *,
        layer_id: int | None,
        tensor: str,
        prop: str,
        expected: object,
        actual: object,
    ) -> None:
        self.layer_id = layer_id
        self.tensor = tensor
        self.prop = prop
        self.expected = expected
        self.actual = actual
        where = f"layer {layer_id}" if layer_id is not None else "expert weights"
        super().__init__(
            f"{tensor}.{prop}",
            actual,
            f"{expected!r}",
            context=f"{where}: tensor {tensor!r} has {prop} {actual!r}, expected {expected!r}",
        )


class QuantizationError(WeightsError):
    """A quantizer, packer or exporter received values or shapes it cannot encode exactly."""
