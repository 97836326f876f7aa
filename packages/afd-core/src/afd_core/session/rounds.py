"""Initialisation rounds on a rendezvous store.

World rank 0 (the store's owner) opens a new round at each of its initialisations; every other
rank joins the newest round and claims its world rank there. Each round has its own key namespace
``afd/g<round>``, so any rank can close and initialise again without reading a previous round's
keys. A rank already claimed in the newest round waits for a newer one and then fails (a second
process runs that rank, stage ``claim``).
"""

from __future__ import annotations

import time
from typing import Any

from afd_core.errors import AFDStartupError, AFDTimeoutError

__all__ = ["ROUND_KEY", "claim_round", "current_round", "round_prefix"]

ROUND_KEY = "afd/round"
_ROUND_POLL_S = 0.01


def round_prefix(number: int) -> str:
    """The key namespace of round ``number``."""
    return f"afd/g{number}"


def claim_round(
    root: Any, world_rank: int, deadline: float, *, who: str, startup_timeout_s: float
) -> int:
    """Join the current round and claim ``world_rank`` in it; return the round's number.

    ``who`` names the rank in errors (e.g. ``"attention 0"``).

    Raises:
        AFDTimeoutError: world rank 0 opened no round before ``deadline``.
        AFDStartupError: stage ``claim``, the rank is already claimed in the newest round and no
            newer round opened before ``deadline``.
    """
    if world_rank == 0:
        number = int(root.add(ROUND_KEY, 1))
        root.add(f"{round_prefix(number)}/claim/0", 1)
        return number
    number = 0
    while True:
        current = int(root.add(ROUND_KEY, 0))
        if current > number:
            number = current
            if int(root.add(f"{round_prefix(number)}/claim/{world_rank}", 1)) == 1:
                return number
        if time.monotonic() >= deadline:
            if number == 0:
                raise AFDTimeoutError(
                    f"AFD init of world rank {world_rank} timed out in stage 'claim': world "
                    f"rank 0 opened no round within {startup_timeout_s:g}s"
                )
            raise AFDStartupError(
                world_rank,
                "claim",
                f"world rank {world_rank} ({who}) is already claimed in round {number} and "
                f"world rank 0 opened no newer round within {startup_timeout_s:g}s: another "
                "process runs this rank",
            )
        time.sleep(_ROUND_POLL_S)


def current_round(root: Any, world_rank: int, deadline: float) -> int:
    """The round a failure published now must land in (world rank 0 opens a new one; any other
    rank waits until deadline for world rank 0's first); 0 when none opened in time."""
    if world_rank == 0:
        return int(root.add(ROUND_KEY, 1))
    number = int(root.add(ROUND_KEY, 0))
    while number == 0 and time.monotonic() < deadline:
        time.sleep(_ROUND_POLL_S)
        number = int(root.add(ROUND_KEY, 0))
    return number
