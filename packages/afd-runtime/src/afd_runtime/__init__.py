"""vLLM workers and model runners per platform, FFN service loop, compute selection and communication binding."""

from importlib.metadata import version as _version

__version__ = _version("afd-runtime")
