"""Every module of afd_runtime imports in an environment holding only afd-runtime and its declared deps.

``afd_runtime.workers.npu`` subclasses vllm-ascend's worker: without vllm-ascend (it has no PyPI
release for vLLM 0.32) importing it must fail with a ``ModuleNotFoundError`` naming
``vllm_ascend``, and nothing else in the package may need it.
"""

import importlib
import importlib.util
import pkgutil

import afd_runtime
import pytest

NEEDS = {"afd_runtime.workers.npu": "vllm_ascend"}


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_runtime.__path__, prefix="afd_runtime.")]
    assert "afd_runtime.workers.cpu" in names
    assert set(NEEDS) <= set(names)
    for name in names:
        dep = NEEDS.get(name)
        if dep is not None and importlib.util.find_spec(dep) is None:
            # Without the optional dependency the module fails to import, naming what is missing.
            with pytest.raises(ModuleNotFoundError) as err:
                importlib.import_module(name)
            assert err.value.name is not None
            assert err.value.name.split(".")[0] == dep, err.value
            continue
        importlib.import_module(name)
    assert afd_runtime.__version__
