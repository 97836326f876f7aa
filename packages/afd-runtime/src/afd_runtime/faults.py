"""Fault injection for tests: the one place that reads ``AFD_INJECT_FAULT``.

Set ``AFD_INJECT_FAULT=<name>`` in a role's environment to make that role fail at one point on
purpose (a real failure there has no other trigger on CPU):

* ``mega_bind``: every Mega bind of the FFN role fails (:mod:`afd_runtime.quantized`);
* ``ffn_load``: the FFN role's model load fails after vLLM loaded the weights
  (:class:`afd_runtime.workers.base.AFDFFNWorkerMixin`);
* ``ffn_compute``: the FFN role's first expert computation fails while serving (a fatal service
  error, :mod:`afd_runtime.ffn_service`).

An unknown name is refused (``AFDConfigError`` naming the variable, the value and the known names)
the first time any fault point asks, so a misspelt fault cannot silently test nothing.

Set ``AFD_INJECT_DELAY_MS=<max>`` to make a role sleep a random 0..max milliseconds (seeded, so a
run is repeatable) at its ordering points: the FFN service before every (layer, stage) it
computes, the Attention role before every turn of a two-stage step (:mod:`afd_runtime.stages`).
Outputs must not change: the tests use it to shake the order in which stages and replies meet.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Final

from afd_core.errors import AFDConfigError, AFDError

#: Environment variable naming the fault to inject.
FAULT_ENV: Final[str] = "AFD_INJECT_FAULT"
#: The faults a role can be told to inject.
KNOWN_FAULTS: Final[tuple[str, ...]] = ("ffn_compute", "ffn_load", "mega_bind")
#: Environment variable holding the upper bound (milliseconds) of injected delays.
DELAY_ENV: Final[str] = "AFD_INJECT_DELAY_MS"


class InjectedFaultError(AFDError):
    """The failure raised at a fault point named by ``AFD_INJECT_FAULT``."""


def fault_injected(name: str) -> bool:
    """True when ``AFD_INJECT_FAULT`` names ``name`` (one of :data:`KNOWN_FAULTS`)."""
    if name not in KNOWN_FAULTS:
        raise AFDConfigError("fault point", name, f"one of {KNOWN_FAULTS}")
    value = os.environ.get(FAULT_ENV, "")
    if value and value not in KNOWN_FAULTS:
        raise AFDConfigError(FAULT_ENV, value, f"one of {KNOWN_FAULTS} or unset")
    return value == name


def raise_if_injected(name: str, what: str) -> None:
    """Raise :class:`InjectedFaultError` (``"<what> failed (injected: AFD_INJECT_FAULT=<name>)"``)
    when ``name`` is the injected fault."""
    if fault_injected(name):
        raise InjectedFaultError(f"{what} failed (injected: {FAULT_ENV}={name})")


def delay_injector(seed: str) -> Callable[[], None] | None:
    """A callable sleeping a random ``0..AFD_INJECT_DELAY_MS`` ms per call (its random sequence
    seeded by ``seed``), or ``None`` when the variable is unset or empty.

    Raises:
        AFDConfigError: the variable is not a finite number of milliseconds >= 0.
    """
    text = os.environ.get(DELAY_ENV, "").strip()
    if not text:
        return None
    try:
        bound_ms = float(text)
    except ValueError:
        bound_ms = -1.0
    if not 0 <= bound_ms < float("inf"):
        raise AFDConfigError(DELAY_ENV, text, "milliseconds >= 0, or unset")
    rng = random.Random(seed)

    def sleep() -> None:
        time.sleep(rng.uniform(0.0, bound_ms) / 1e3)

    return sleep
