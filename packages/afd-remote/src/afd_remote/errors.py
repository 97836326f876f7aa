"""Exception types raised by afd_remote.

Every error names the offending field and value and says what is allowed, and is raised before
any side effect: nothing has been sent to a connector or entered a collective when one of these
reaches the caller. All derive from afd-core's :class:`~afd_core.errors.AFDError`.
"""

from __future__ import annotations

from collections.abc import Iterable

from afd_core.errors import AFDFieldError, AFDPayloadError


class AFDRemoteError(AFDFieldError, ValueError):
    """A caller passed an argument afd_remote cannot use (``field`` / ``value`` / ``allowed`` as
    in afd-core's :class:`~afd_core.errors.AFDFieldError`, e.g. ``field="top_k"``)."""

    subject = "afd_remote argument"


class UnsupportedPayloadFieldError(AFDPayloadError):
    """The connector cannot carry a payload field the layer was given.

    Attributes:
        field: the payload field (e.g. ``input_ids``).
        value: the connector's class name.
        supported: the connector's ``supported_payload_fields``, sorted.
    """

    def __init__(self, field: str, connector_name: str, supported: Iterable[str]) -> None:
        self.supported = tuple(sorted(supported))
        super().__init__(
            field,
            connector_name,
            f"a connector that carries {field!r} ({connector_name} carries {list(self.supported)})",
        )
