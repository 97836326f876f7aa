"""Checks of the served checkpoint that run before any engine starts.

The model adapters know which checkpoints AFD serves (afd-models registers its check with
:func:`register_checkpoint_check` when vLLM loads its plugin); the runtime runs every registered
check where it selects the AFD worker (``EngineArgs.create_engine_config``, in the API server
process, before an engine core is started), so a checkpoint AFD cannot serve is refused in a
second with an error naming the checkpoint field, instead of one role dying while it loads.

Invariants: registering the same check twice keeps one; checks run in registration order and
the first error propagates unchanged (an :class:`~afd_core.errors.AFDError` naming the field).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from afd_core.config import AFDConfig

#: ``check(afd_config, vllm_config)``: raises to refuse the checkpoint of ``vllm_config``.
CheckpointCheck = Callable[[AFDConfig, Any], None]

_CHECKS: list[CheckpointCheck] = []


def register_checkpoint_check(check: CheckpointCheck) -> None:
    """Run ``check`` before every AFD engine starts (idempotent)."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def run_checkpoint_checks(cfg: AFDConfig, vllm_config: Any) -> None:
    """Run every registered check on ``vllm_config``'s checkpoint for the role of ``cfg``."""
    for check in tuple(_CHECKS):
        check(cfg, vllm_config)
