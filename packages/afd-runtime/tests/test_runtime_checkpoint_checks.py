"""The checkpoint check runs where the AFD worker is selected, before any engine starts: against
the architectures the model package declared, a refusal leaves the config untouched; without a
declared architecture only the quantization rule applies; a plain (non-AFD) config is never
checked."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from afd_core.errors import AFDModelError
from afd_runtime import checkpoint_checks, patches

CPU = "vllm.v1.worker.cpu_worker.CPUWorker"


def _vllm_config(afd: dict[str, Any] | None, **hf: Any) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config={} if afd is None else {"afd": afd},
        parallel_config=SimpleNamespace(
            worker_cls=CPU, distributed_executor_backend="mp", world_size=1
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(async_scheduling=True),
        shutdown_timeout=0,
        model_config=SimpleNamespace(model="/ckpt", hf_config=SimpleNamespace(**hf)),
    )


@pytest.fixture
def declared() -> Iterator[None]:
    """Only ``Qwen3MoeForCausalLM`` declared (whatever a model package declared is restored)."""
    saved = set(checkpoint_checks._ARCHITECTURES)
    checkpoint_checks._ARCHITECTURES.clear()
    checkpoint_checks.declare_architectures(["Qwen3MoeForCausalLM"])
    checkpoint_checks.declare_architectures(["Qwen3MoeForCausalLM"])  # idempotent
    yield
    checkpoint_checks._ARCHITECTURES.clear()
    checkpoint_checks._ARCHITECTURES.update(saved)


def test_an_undeclared_architecture_stops_the_worker_selection_before_any_change(
    declared: None,
) -> None:
    cfg = _vllm_config({"role": "ffn", "port": 1}, architectures=["MixtralForCausalLM"])
    with pytest.raises(AFDModelError) as info:
        patches.select_afd_worker(cfg, on_cpu=True)
    assert info.value.field == "architectures"
    assert "['Qwen3MoeForCausalLM']" in str(info.value) and "AFD role ffn" in str(info.value)
    assert cfg.parallel_config.worker_cls == CPU and cfg.shutdown_timeout == 0


def test_a_quantized_checkpoint_is_refused_naming_its_method(declared: None) -> None:
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg = _vllm_config(
        {"role": "attention", "port": 1},
        architectures=["Qwen3MoeForCausalLM"],
        quantization_config=quant,
    )
    with pytest.raises(AFDModelError) as info:
        patches.select_afd_worker(cfg, on_cpu=True)
    assert (info.value.field, info.value.value) == ("quantization_config.quant_method", "fp8")
    assert cfg.parallel_config.worker_cls == CPU


def test_a_declared_architecture_selects_the_worker(declared: None) -> None:
    cfg = _vllm_config({"role": "attention", "port": 1}, architectures=["Qwen3MoeForCausalLM"])
    patches.select_afd_worker(cfg, on_cpu=True)
    assert cfg.parallel_config.worker_cls != CPU


def test_with_nothing_declared_only_quantization_is_checked() -> None:
    saved = set(checkpoint_checks._ARCHITECTURES)
    checkpoint_checks._ARCHITECTURES.clear()
    try:
        mixtral = _vllm_config({"role": "ffn", "port": 1}, architectures=["MixtralForCausalLM"])
        patches.select_afd_worker(mixtral, on_cpu=True)
        assert mixtral.parallel_config.worker_cls != CPU
        quantized = _vllm_config(
            {"role": "ffn", "port": 1},
            architectures=["MixtralForCausalLM"],
            quantization_config={"quant_method": "awq"},
        )
        with pytest.raises(AFDModelError) as info:
            patches.select_afd_worker(quantized, on_cpu=True)
        assert info.value.field == "quantization_config.quant_method"
    finally:
        checkpoint_checks._ARCHITECTURES.update(saved)


def test_a_plain_config_is_not_checked(declared: None) -> None:
    cfg = _vllm_config(None, architectures=["MixtralForCausalLM"])
    patches.select_afd_worker(cfg, on_cpu=True)
    assert cfg.parallel_config.worker_cls == CPU
