"""The one field / value / allowed error base (:class:`afd_core.errors.AFDFieldError`)."""

from __future__ import annotations

import pytest
from afd_core.errors import (
    AFDConfigError,
    AFDError,
    AFDFieldError,
    AFDModelError,
    AFDPayloadError,
    AFDStateError,
)


def test_the_base_names_field_value_and_allowed() -> None:
    err = AFDFieldError("top_k", 0, "an integer >= 1")
    assert isinstance(err, AFDError) and not isinstance(err, ValueError)
    assert (err.field, err.value, err.allowed, err.detail) == ("top_k", 0, "an integer >= 1", None)
    assert str(err) == "invalid AFD value 'top_k': got 0; allowed: an integer >= 1"
    with_detail = AFDFieldError("top_k", 0, "an integer >= 1", detail="layer 3")
    assert (
        str(with_detail) == "invalid AFD value 'top_k': got 0; allowed: an integer >= 1 (layer 3)"
    )


@pytest.mark.parametrize(
    ("cls", "message", "is_value_error"),
    [
        (AFDConfigError, "invalid AFD config field 'port': got -1; allowed: 1..65535", True),
        (AFDPayloadError, "invalid AFD payload field 'port': got -1; expected 1..65535", True),
        (AFDModelError, "invalid AFD model value 'port': got -1; allowed: 1..65535", False),
    ],
)
def test_subclasses_only_name_their_subject(
    cls: type[AFDFieldError], message: str, is_value_error: bool
) -> None:
    err = cls("port", -1, "1..65535")
    assert str(err) == message
    assert (err.field, err.value, err.allowed) == ("port", -1, "1..65535")
    assert isinstance(err, ValueError) is is_value_error


def test_a_package_subclass_formats_through_the_base() -> None:
    class PackageError(AFDFieldError, ValueError):
        subject = "pkg argument"

    err = PackageError("rank", 5, "0..3", detail="F=4")
    assert str(err) == "invalid pkg argument 'rank': got 5; allowed: 0..3 (F=4)"
    assert isinstance(err, AFDError) and isinstance(err, ValueError)


def test_state_errors_are_afd_errors_only() -> None:
    err = AFDStateError("service not built")
    assert isinstance(err, AFDError) and not isinstance(err, RuntimeError)
    assert str(err) == "service not built"
