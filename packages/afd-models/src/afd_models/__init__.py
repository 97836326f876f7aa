"""AFD model adapters, checkpoint filtering, the vLLM plugin entry point and the `afd` CLI. The package users install."""

from importlib.metadata import version as _version

__version__ = _version("afd-models")
