"""CAM model-side TP/SP layout, padding, output restoration and the DBO receive handoff."""

from importlib.metadata import version as _version

__version__ = _version("afd-cam")
