"""Every module of afd_weights imports in an env holding only afd-weights and its deps."""

import importlib
import pkgutil

import afd_weights


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_weights.__path__, prefix="afd_weights.")]
    for name in names:
        importlib.import_module(name)
    assert afd_weights.__version__
