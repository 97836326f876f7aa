"""construction_override: the scoped swap of a vLLM model-module attribute (no vLLM needed)."""

from __future__ import annotations

import types

import pytest
from afd_models.models._construction import construction_override


def test_construction_override_is_scoped() -> None:
    mod = types.ModuleType("fake_vllm_models")
    mod.Block = "upstream"  # type: ignore[attr-defined]
    with construction_override(mod, "Block", "afd"):
        assert mod.Block == "afd"  # type: ignore[attr-defined]
    assert mod.Block == "upstream"  # type: ignore[attr-defined]
    with pytest.raises(KeyError), construction_override(mod, "Block", "afd"):
        raise KeyError("boom")
    assert mod.Block == "upstream"  # type: ignore[attr-defined]
    with (
        pytest.raises(AttributeError, match=r"fake_vllm_models\.Missing"),
        construction_override(mod, "Missing", 1),
    ):
        pass
    assert not hasattr(mod, "Missing")
