"""Every module of afd_cam imports in an environment holding only afd-cam and its declared deps."""

import importlib
import pkgutil

import afd_cam


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(afd_cam.__path__, prefix="afd_cam.")]
    for name in names:
        importlib.import_module(name)
    assert afd_cam.__version__
