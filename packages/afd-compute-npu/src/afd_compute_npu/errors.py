"""Exception types raised by afd-compute-npu.

Every error names the rejected field, the value seen and what is allowed; validation happens before
any side effect (no workspace write, no native call).
"""

from __future__ import annotations

from afd_core.errors import AFDError, AFDFieldError

__all__ = [
    "BackendUnavailableError",
    "ComputeConfigError",
    "ComputeError",
    "ComputeInputError",
    "MegaNotBoundError",
]


class ComputeError(AFDFieldError, ValueError):
    """Base class (afd-core's :class:`~afd_core.errors.AFDFieldError`, and a ``ValueError``):
    ``field`` was ``value``; ``allowed`` says what is accepted."""

    subject = "afd-compute-npu value"


class ComputeConfigError(ComputeError):
    """Bad construction-time configuration (or a configuration the backend cannot run)."""


class ComputeInputError(ComputeError):
    """A per-call input (layer id, hidden states, top-k ids or weights) was rejected."""


class MegaNotBoundError(AFDError, RuntimeError):
    """:class:`~afd_compute_npu.MegaCompute` was run before :meth:`bind` gave it comm parameters."""


class BackendUnavailableError(AFDError, RuntimeError):
    """The Ascend native modules (torch_npu, vllm-ascend custom ops) could not be loaded."""
