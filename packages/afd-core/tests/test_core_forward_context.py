"""Forward metadata access (context variable, the runtime's hooks) and the stage hook point."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDContextError
from afd_core.forward_context import (
    AFDForwardMetadata,
    current_stage_idx,
    dbo_yield,
    get_afd_forward_metadata,
    has_afd_forward_metadata,
    install_stage_hooks,
    installed_stage_hooks,
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


class RecordingHooks:
    """A runtime's stage hooks as a recording fake."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.meta: AFDForwardMetadata | None = None
        self.yields = 0

    def current_stage(self) -> int | None:
        return self.stage

    def yield_stage(self) -> None:
        self.yields += 1

    def lookup_metadata(self) -> AFDForwardMetadata | None:
        return self.meta


@pytest.fixture
def hooks() -> Iterator[RecordingHooks]:
    fake = RecordingHooks()
    previous = install_stage_hooks(fake)
    assert installed_stage_hooks() is fake
    yield fake
    assert install_stage_hooks(previous) is fake


def test_without_hooks_a_yield_does_nothing_and_the_metadata_names_the_stage() -> None:
    previous = install_stage_hooks(None)
    try:
        meta = AFDForwardMetadata(make_connector(), stage_idx=1, num_stages=2)
        with set_afd_forward_metadata(meta):
            dbo_yield()
            assert current_stage_idx() == 1
    finally:
        install_stage_hooks(previous)


def test_hooks_name_the_stage_and_take_the_yield(hooks: RecordingHooks) -> None:
    meta = AFDForwardMetadata(make_connector(), stage_idx=0, num_stages=2)
    with set_afd_forward_metadata(meta):
        assert current_stage_idx() == 0  # the hooks run no stage here: the metadata's
        hooks.stage = 1
        assert current_stage_idx() == 1
        dbo_yield()
        dbo_yield()
        assert hooks.yields == 2


def test_metadata_the_hooks_hold_wins_over_the_context_variable(hooks: RecordingHooks) -> None:
    conn = make_connector()
    mine, runtime = AFDForwardMetadata(conn), AFDForwardMetadata(conn, num_stages=2)
    with set_afd_forward_metadata(mine):
        assert get_afd_forward_metadata() is mine
        hooks.meta = runtime
        assert get_afd_forward_metadata() is runtime
    # A thread does not inherit context variables; the runtime's holder reaches it.
    seen: list[Any] = []
    t = threading.Thread(target=lambda: seen.append(get_afd_forward_metadata()))
    t.start()
    t.join()
    assert seen == [runtime]
    hooks.meta = None
    assert not has_afd_forward_metadata()


def test_install_refuses_what_is_not_stage_hooks() -> None:
    with pytest.raises(AFDContextError, match="needs a StageHooks"):
        install_stage_hooks(object())  # type: ignore[arg-type]
