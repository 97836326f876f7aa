"""Attention-side remote FFN proxy, AFDAttentionFusedMoE and routed TP padding."""

from importlib.metadata import version as _version

__version__ = _version("afd-remote")
