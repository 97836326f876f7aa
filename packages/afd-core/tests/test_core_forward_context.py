"""Forward-context access with and without a (fake) vLLM forward context, and the DBO hook."""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDContextError
from afd_core.forward_context import (
    AFD_FORWARD_CONTEXT_KEY,
    AFDForwardMetadata,
    current_stage_idx,
    dbo_yield,
    get_afd_forward_metadata,
    has_afd_forward_metadata,
    set_afd_forward_metadata,
)
from afd_core.metadata import AFDPayloadSpec


def make_connector() -> P2PConnector:
    cfg = AFDConfig(role=AFDRole.ATTENTION)
    return P2PConnector(
        cfg, payload_spec=AFDPayloadSpec(hidden_size=4, dtype=torch.float32), num_layers=1
    )


def test_missing_metadata_raises() -> None:
    assert not has_afd_forward_metadata()
    with pytest.raises(AFDContextError, match="set_afd_forward_metadata"):
        get_afd_forward_metadata()


def test_contextvar_install_nest_restore() -> None:
    conn = make_connector()
    outer = AFDForwardMetadata(conn, stage_idx=1, num_stages=2, num_tokens=(3, 4))
    inner = outer.with_layer(5)
    with set_afd_forward_metadata(outer) as got:
        assert got is outer and get_afd_forward_metadata() is outer
        with set_afd_forward_metadata(inner):
            assert get_afd_forward_metadata().layer_idx == 5
        assert get_afd_forward_metadata() is outer
        assert current_stage_idx() == 1
    assert not has_afd_forward_metadata()
    with pytest.raises(RuntimeError), set_afd_forward_metadata(outer):
        raise RuntimeError("boom")
    assert not has_afd_forward_metadata()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stage_idx": 2, "num_stages": 2},
        {"stage_idx": -1},
        {"num_stages": 0},
        {"num_stages": True},
        {"layer_idx": -1},
        {"num_tokens": (1, 2)},
        {"num_tokens": (-1,)},
    ],
)
def test_metadata_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(AFDContextError):
        AFDForwardMetadata(make_connector(), **kwargs)
    with pytest.raises(AFDContextError):
        AFDForwardMetadata("not a connector")  # type: ignore[arg-type]
    with pytest.raises(AFDContextError), set_afd_forward_metadata("nope"):  # type: ignore[arg-type]
        pass


@dataclass
class FakeForwardContext:
    additional_kwargs: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """Fake ``vllm.forward_context`` and ``vllm.v1.worker.ubatching`` modules in sys.modules."""
    state = types.SimpleNamespace(ctx=None, dbo=False, ubatch=0, yields=0)
    fc = types.ModuleType("vllm.forward_context")
    fc.is_forward_context_available = lambda: state.ctx is not None  # type: ignore[attr-defined]
    fc.get_forward_context = lambda: state.ctx  # type: ignore[attr-defined]
    ub = types.ModuleType("vllm.v1.worker.ubatching")
    ub.dbo_enabled = lambda: state.dbo  # type: ignore[attr-defined]
    ub.dbo_current_ubatch_id = lambda: state.ubatch  # type: ignore[attr-defined]

    def _yield() -> None:
        state.yields += 1

    ub.dbo_yield = _yield  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.forward_context", fc)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.ubatching", ub)
    yield state


def test_attaches_to_vllm_forward_context(fake_vllm: types.SimpleNamespace) -> None:
    ctx = FakeForwardContext(additional_kwargs={"other": 1})
    fake_vllm.ctx = ctx
    meta = AFDForwardMetadata(make_connector())
    with set_afd_forward_metadata(meta):
        assert ctx.additional_kwargs[AFD_FORWARD_CONTEXT_KEY] is meta
        # A thread does not inherit context variables, but sees vLLM's (global) context.
        seen: list[Any] = []
        t = threading.Thread(target=lambda: seen.append(get_afd_forward_metadata()))
        t.start()
        t.join()
        assert seen == [meta]
    assert ctx.additional_kwargs == {"other": 1}


def test_reads_metadata_attached_by_runner(fake_vllm: types.SimpleNamespace) -> None:
    meta = AFDForwardMetadata(make_connector(), num_stages=2)
    fake_vllm.ctx = FakeForwardContext(additional_kwargs={AFD_FORWARD_CONTEXT_KEY: meta})
    assert get_afd_forward_metadata() is meta
    fake_vllm.ctx = None
    assert not has_afd_forward_metadata()


def test_dbo_stage_and_yield(fake_vllm: types.SimpleNamespace) -> None:
    meta = AFDForwardMetadata(make_connector(), num_stages=2)
    with set_afd_forward_metadata(meta):
        dbo_yield()
        assert fake_vllm.yields == 0  # DBO off: no-op
        assert current_stage_idx() == 0
        fake_vllm.dbo, fake_vllm.ubatch = True, 1
        assert current_stage_idx() == 1
        dbo_yield()
        assert fake_vllm.yields == 1
