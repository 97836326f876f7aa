"""Every module of afd_models imports in an environment holding only afd-models and its declared deps."""

import importlib
import pkgutil

import afd_models


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_models.__path__, prefix="afd_models.")]
    for name in names:
        importlib.import_module(name)
    assert afd_models.__version__
