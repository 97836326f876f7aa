"""Collection rules shared by afd-models' tests."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``applies_to(predicate)`` runs only for the parametrizations of its
    module-scoped ``deployment`` fixture whose case satisfies ``predicate``; the others are
    deselected at collection (reported as deselected), so no case runs it only to skip."""
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        marker = item.get_closest_marker("applies_to")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            marker is not None
            and "deployment" in params
            and not marker.args[0](params["deployment"])
        ):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
