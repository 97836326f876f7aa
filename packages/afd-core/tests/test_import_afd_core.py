"""Every module of afd_core imports in an environment holding only afd-core and its declared deps."""

import importlib
import pkgutil

import afd_core


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_core.__path__, prefix="afd_core.")]
    for name in names:
        importlib.import_module(name)
    assert afd_core.__version__
