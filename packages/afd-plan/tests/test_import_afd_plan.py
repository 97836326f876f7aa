"""Every module of afd_plan imports in an environment holding only afd-plan and its declared
deps, and none of them imports vLLM, transformers or matplotlib."""

import importlib
import importlib.metadata
import pkgutil
import subprocess
import sys

import afd_plan


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_plan.__path__, prefix="afd_plan.")]
    for name in names:
        importlib.import_module(name)
    # The version the package reports is the installed distribution's, not a second copy.
    assert afd_plan.__version__ == importlib.metadata.version("afd-plan")


def test_no_heavy_imports() -> None:
    code = (
        "import sys, afd_plan, afd_plan.report, afd_plan.plan;"
        "bad = [m for m in ('vllm', 'transformers', 'matplotlib') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
