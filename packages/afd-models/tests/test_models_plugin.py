"""The vLLM plugin: found through the entry point, idempotent, registers the AFD classes."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from afd_models import plugin


def _entry_point() -> importlib.metadata.EntryPoint:
    eps = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "afd"
    ]
    assert len(eps) == 1
    return eps[0]


def test_entry_point_targets_register() -> None:
    assert _entry_point().value == "afd_models.plugin:register"


def test_register_is_idempotent_through_the_entry_point() -> None:
    from afd_runtime.patches import patches_applied
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCoreProc

    fn = _entry_point().load()
    fn()
    create, loop = EngineArgs.create_engine_config, EngineCoreProc.run_busy_loop
    fn()
    fn()
    assert plugin.is_registered()
    assert patches_applied()
    # A second registration does not wrap the patched functions again.
    assert EngineArgs.create_engine_config is create
    assert EngineCoreProc.run_busy_loop is loop


def _adapter_kit() -> Any:
    sys.path.insert(0, str(Path(__file__).parent))
    import afd_models_adapter_kit

    return afd_models_adapter_kit


@pytest.mark.parametrize("arch", sorted(plugin.MODEL_REGISTRATIONS))
def test_architectures_resolve_to_afd_classes(arch: str) -> None:
    from vllm import ModelRegistry

    plugin.register()
    if arch == "Qwen3_5MoeForCausalLM":
        # vLLM's qwen3_5 module imports torchvision (vision stack): the test-only stub.
        _adapter_kit().import_qwen3_5()
    cls = ModelRegistry._try_load_model_cls(arch)
    module, name = plugin.MODEL_REGISTRATIONS[arch].split(":")
    assert cls is not None
    assert cls.__module__ == module and cls.__name__ == name
