"""A cleanly shut-down AFD engine core exits without module teardown; any other exit keeps it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

# A process that shuts an "engine core" down and exits. A module-level object's finalizer runs
# during the interpreter's module teardown, so "teardown" in the output means it ran.
PROGRAM = textwrap.dedent(
    """
    import atexit, sys
    from afd_runtime.clean_exit import exit_without_teardown_after

    class Teardown:
        def __del__(self):
            print("teardown", flush=True)

    class Core:
        def shutdown(self):
            print("shutdown", flush=True)
            if FAIL:
                raise RuntimeError("shutdown failed")

    keep = Teardown()
    atexit.register(lambda: print("other atexit", flush=True))
    core = Core()
    if ARM:
        exit_without_teardown_after(core)
        exit_without_teardown_after(core)  # idempotent
    core.shutdown()
    sys.exit(0)
    """
)


def _run(arm: bool, fail: bool = False) -> subprocess.CompletedProcess[str]:
    code = f"ARM = {arm}\nFAIL = {fail}\n" + PROGRAM
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_armed_exit_skips_module_teardown_but_runs_every_atexit_handler_once() -> None:
    plain = _run(arm=False)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == ["shutdown", "other", "atexit", "teardown"]
    armed = _run(arm=True)
    assert armed.returncode == 0, armed.stderr
    assert armed.stdout.split() == ["shutdown", "other", "atexit"]


def test_a_shutdown_that_raises_arms_nothing_and_keeps_the_failure_status() -> None:
    failed = _run(arm=True, fail=True)
    assert failed.returncode == 1
    assert "RuntimeError: shutdown failed" in failed.stderr
    assert failed.stdout.split() == ["shutdown", "other", "atexit", "teardown"]


class _Core:
    """What the patched ``run_busy_loop`` reads of an engine core; vLLM's loop exits at once."""

    def __init__(self, additional_config: dict[str, Any]) -> None:
        self.vllm_config = SimpleNamespace(additional_config=additional_config)

    def _handle_shutdown(self) -> bool:
        return False  # shutdown already requested: vLLM's loop raises SystemExit

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("engine_cls", ["EngineCoreProc", "DPEngineCoreProc"])
@pytest.mark.parametrize(
    ("additional_config", "armed"),
    [({"afd": {"role": "attention"}}, True), ({}, False)],
    ids=["attention-role", "plain-vllm"],
)
def test_the_busy_loop_patch_arms_the_clean_exit_on_afd_roles_only(
    additional_config: dict[str, Any], armed: bool, engine_cls: str
) -> None:
    """Both engine-core loops (the data-parallel one is its own) arm it on a clean exit."""
    pytest.importorskip("vllm")
    from afd_runtime import patches
    from vllm.v1.engine import core as vllm_core

    patches.apply_vllm_patches()
    core = _Core(additional_config)
    with pytest.raises(SystemExit):
        getattr(vllm_core, engine_cls).run_busy_loop(core)
    assert getattr(core.shutdown, "_afd_exit_without_teardown", False) is armed
