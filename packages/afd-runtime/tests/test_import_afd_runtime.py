"""Every module of afd_runtime imports in an environment holding only afd-runtime and its declared deps.

``afd_runtime.workers.npu`` subclasses vllm-ascend's worker and is skipped when vllm-ascend is
not installed (it has no PyPI release for vLLM 0.32).
"""

import importlib
import importlib.util
import pkgutil

import afd_runtime

NEEDS = {"afd_runtime.workers.npu": "vllm_ascend"}


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_runtime.__path__, prefix="afd_runtime.")]
    assert "afd_runtime.workers.cpu" in names
    for name in names:
        dep = NEEDS.get(name)
        if dep is not None and importlib.util.find_spec(dep) is None:
            continue
        importlib.import_module(name)
    assert afd_runtime.__version__
