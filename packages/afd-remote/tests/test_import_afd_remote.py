"""Every module of afd_remote imports in an environment holding only afd-remote and its declared deps."""

import importlib
import pkgutil

import afd_remote


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_remote.__path__, prefix="afd_remote.")]
    for name in names:
        importlib.import_module(name)
    assert afd_remote.__version__
