"""Checkpoint checks registered by the model package run where the AFD worker is selected, before
any engine starts: a refusal leaves the config untouched; registering twice keeps one; a plain
(non-AFD) config is never checked."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from afd_core.config import AFDConfig
from afd_core.errors import AFDModelError
from afd_runtime import checkpoint_checks, patches

CPU = "vllm.v1.worker.cpu_worker.CPUWorker"


def _vllm_config(afd: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config={} if afd is None else {"afd": afd},
        parallel_config=SimpleNamespace(
            worker_cls=CPU, distributed_executor_backend="mp", world_size=1
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(async_scheduling=True),
        shutdown_timeout=0,
        model_config=SimpleNamespace(model="/ckpt", architectures=["MixtralForCausalLM"]),
    )


@pytest.fixture
def seen() -> Iterator[list[tuple[str, str]]]:
    """A registered check that records what it saw and refuses Mixtral (removed afterwards)."""
    calls: list[tuple[str, str]] = []

    def check(cfg: AFDConfig, vllm_config: Any) -> None:
        calls.append((cfg.role.value, vllm_config.model_config.model))
        if vllm_config.model_config.architectures == ["MixtralForCausalLM"]:
            raise AFDModelError("architectures", ["MixtralForCausalLM"], "an adapted one")

    saved = list(checkpoint_checks._CHECKS)
    checkpoint_checks._CHECKS.clear()  # only this check: another package's may be registered
    checkpoint_checks.register_checkpoint_check(check)
    checkpoint_checks.register_checkpoint_check(check)  # idempotent
    yield calls
    checkpoint_checks._CHECKS[:] = saved


def test_a_refused_checkpoint_stops_the_worker_selection_before_any_change(
    seen: list[tuple[str, str]],
) -> None:
    cfg = _vllm_config({"role": "ffn", "port": 1})
    with pytest.raises(AFDModelError) as info:
        patches.select_afd_worker(cfg, on_cpu=True)
    assert info.value.field == "architectures"
    assert seen == [("ffn", "/ckpt")]  # run once although registered twice
    assert cfg.parallel_config.worker_cls == CPU and cfg.shutdown_timeout == 0


def test_an_accepted_checkpoint_selects_the_worker(seen: list[tuple[str, str]]) -> None:
    cfg = _vllm_config({"role": "attention", "port": 1})
    cfg.model_config.architectures = ["Qwen3MoeForCausalLM"]
    patches.select_afd_worker(cfg, on_cpu=True)
    assert seen == [("attention", "/ckpt")]
    assert cfg.parallel_config.worker_cls != CPU


def test_a_plain_config_is_not_checked(seen: list[tuple[str, str]]) -> None:
    patches.select_afd_worker(_vllm_config(None), on_cpu=True)
    assert seen == []
