"""Exception types of afd-plan.

Invariants:
* :class:`AFDPlanError` is one rejected input value (a ``config.json`` field, a hardware profile
  field, a workload or candidate setting): afd-core's :class:`~afd_core.errors.AFDFieldError`
  formats ``field`` / ``value`` / ``allowed`` into the message; it is also a ``ValueError``.
* :class:`AFDPlanMemoryError` is a deployment that does not fit a device: it names the role, the
  bytes that role needs and the bytes the device holds.
"""

from __future__ import annotations

from afd_core.errors import AFDError, AFDFieldError

__all__ = ["AFDPlanError", "AFDPlanMemoryError"]


class AFDPlanError(AFDFieldError, ValueError):
    """An input afd-plan cannot use (``field`` / ``value`` / ``allowed`` as in afd-core's
    :class:`~afd_core.errors.AFDFieldError`, e.g. ``field="config.json:num_experts_per_tok"``)."""

    subject = "afd plan input"


class AFDPlanMemoryError(AFDError, ValueError):
    """A candidate deployment whose ``role`` needs more device memory than the device holds.

    Attributes:
        role: ``"attention"``, ``"ffn"`` or ``"colocated"``.
        needed_bytes: weights + KV cache (Attention / colocated) or expert weights + buffers (FFN).
        available_bytes: the device's usable memory (``memory_bytes * memory_usable_fraction``).
        breakdown: the parts of ``needed_bytes`` by name.
    """

    def __init__(
        self,
        role: str,
        needed_bytes: float,
        available_bytes: float,
        breakdown: dict[str, float],
        *,
        candidate: str = "",
    ) -> None:
        self.role = role
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.breakdown = dict(breakdown)
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in breakdown.items())
        where = f"{candidate}: " if candidate else ""
        super().__init__(
            f"{where}the {role} role does not fit: needs {needed_bytes:.0f} bytes "
            f"({_gib(needed_bytes)}: {parts}), the device holds {available_bytes:.0f} bytes "
            f"({_gib(available_bytes)})"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
