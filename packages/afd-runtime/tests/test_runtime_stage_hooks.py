"""The runtime's stage hooks: what afd-core's AFD layers learn inside a vLLM worker.

The stage and the yield come from afd-runtime's executor, else from vLLM's dual-batch overlap;
the metadata from vLLM's active forward context (each split stage's own), read here through
vLLM's real ``vllm.forward_context`` and ``vllm.v1.worker.ubatching`` modules.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import create_connector
from afd_core.forward_context import (
    AFD_FORWARD_CONTEXT_KEY,
    AFDForwardMetadata,
    current_stage_idx,
    dbo_yield,
    get_afd_forward_metadata,
    install_stage_hooks,
    installed_stage_hooks,
    set_afd_forward_metadata,
)
from afd_core.metadata import AFDPayloadSpec
from afd_runtime import stage_hooks
from afd_runtime.overlap import run_overlapped
from vllm import forward_context as fc
from vllm.v1.worker import ubatching


@pytest.fixture
def hooks() -> Iterator[stage_hooks.VLLMStageHooks]:
    previous = install_stage_hooks(None)
    installed = stage_hooks.install()
    assert stage_hooks.install() is installed  # idempotent
    assert installed_stage_hooks() is installed
    yield installed
    install_stage_hooks(previous)


def _meta(stage: int = 0, stages: int = 2) -> AFDForwardMetadata:
    cfg = AFDConfig(role=AFDRole.ATTENTION, connector="inprocess")
    conn = create_connector(
        cfg, 0, payload_spec=AFDPayloadSpec(hidden_size=4, dtype=torch.float32), num_layers=1
    )
    return AFDForwardMetadata(conn, stage_idx=stage, num_stages=stages)


def test_metadata_comes_from_vllms_active_forward_context(
    hooks: stage_hooks.VLLMStageHooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert hooks.lookup_metadata() is None  # no forward context
    own, stage_one = _meta(), _meta(stage=1)
    ctx = types.SimpleNamespace(additional_kwargs={AFD_FORWARD_CONTEXT_KEY: stage_one})
    monkeypatch.setattr(fc, "_forward_context", ctx)
    with set_afd_forward_metadata(own):
        assert get_afd_forward_metadata() is stage_one
    # vLLM's context is global: a thread that inherited nothing sees it.
    seen: list[AFDForwardMetadata] = []
    worker = threading.Thread(target=lambda: seen.append(get_afd_forward_metadata()))
    worker.start()
    worker.join()
    assert seen == [stage_one]
    ctx.additional_kwargs = {}  # a forward context without AFD metadata: the caller's
    with set_afd_forward_metadata(own):
        assert get_afd_forward_metadata() is own


def test_the_executors_stage_and_turns_reach_the_afd_layers(
    hooks: stage_hooks.VLLMStageHooks,
) -> None:
    seen: list[tuple[int, int]] = []

    def stage(idx: int) -> object:
        def run() -> int:
            with set_afd_forward_metadata(_meta(stage=0)):
                for _layer in range(2):
                    seen.append((idx, current_stage_idx()))
                    dbo_yield()
            return idx

        return run

    assert run_overlapped([stage(0), stage(1)], timeout_s=10) == [0, 1]  # type: ignore[list-item]
    # Alternating turns, each stage named by the executor (not the metadata's stage 0).
    assert seen == [(0, 0), (1, 1), (0, 0), (1, 1)]


def test_vllms_own_dbo_names_the_stage_and_takes_the_yield(
    hooks: stage_hooks.VLLMStageHooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    yields: list[int] = []
    monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 1)
    monkeypatch.setattr(ubatching, "dbo_yield", lambda: yields.append(1))
    with set_afd_forward_metadata(_meta(stage=0)):
        assert current_stage_idx() == 1
        dbo_yield()
    assert yields == [1]


def test_outside_any_overlap_nothing_yields(hooks: stage_hooks.VLLMStageHooks) -> None:
    assert hooks.current_stage() is None
    hooks.yield_stage()  # returns at once
    with set_afd_forward_metadata(_meta(stage=1)):
        assert current_stage_idx() == 1
