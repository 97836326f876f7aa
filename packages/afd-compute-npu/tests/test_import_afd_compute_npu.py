"""Every module of afd_compute_npu imports in an env holding only afd-compute-npu and its deps."""

import importlib
import pkgutil

import afd_compute_npu


def test_every_module_imports() -> None:
    names = [
        m.name for m in pkgutil.walk_packages(afd_compute_npu.__path__, prefix="afd_compute_npu.")
    ]
    for name in names:
        importlib.import_module(name)
    assert afd_compute_npu.__version__
