"""Layered and Mega FFN expert compute with reference (torch) and Ascend native backends."""

from importlib.metadata import version as _version

__version__ = _version("afd-compute-npu")
