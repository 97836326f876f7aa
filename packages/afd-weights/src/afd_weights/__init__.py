"""Quantized expert-weight contract (W8A8/W4A8), quantizers and packers, layout validation, geometry and graph signatures."""

from importlib.metadata import version as _version

__version__ = _version("afd-weights")
