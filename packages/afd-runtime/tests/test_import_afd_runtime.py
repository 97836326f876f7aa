"""Every module of afd_runtime imports in an environment holding only afd-runtime and its declared deps."""

import importlib
import pkgutil

import afd_runtime


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_runtime.__path__, prefix="afd_runtime.")]
    for name in names:
        importlib.import_module(name)
    assert afd_runtime.__version__
