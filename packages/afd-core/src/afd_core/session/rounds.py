"""Initialisation rounds on a rendezvous store.

World rank 0 (the store's owner) opens a new round at each of its initialisations; every other
rank joins the newest round and claims its world rank there. Each round has its own key namespace
``afd/g<round>``, so any rank can close and initialise again without reading a previous round's
keys. A rank already claimed in the newest round waits for a newer one and then fails (a second
process runs that rank, stage ``claim``); a rank that beats a heartbeat (``served_by``) is refused
at once when the heartbeat of its claim in the newest round is moving: a live process serves it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from afd_core.errors import AFDRankServedError, AFDStartupError, AFDTimeoutError
from afd_core.session.startup import check_startup_cancelled

__all__ = ["ROUND_KEY", "claim_round", "current_round", "round_prefix"]

ROUND_KEY = "afd/round"
_ROUND_POLL_S = 0.01
#: How long a claimed rank's heartbeat is watched before a second claimant decides whether a live
#: process holds it (more than two of the holder's beats, ``session.liveness.HEARTBEAT_S``).
LIVE_HOLDER_WATCH_S = 2.5


def round_prefix(number: int) -> str:
    """The key namespace of round ``number``."""
    return f"afd/g{number}"


def claim_round(
    root: Any,
    world_rank: int,
    deadline: float,
    *,
    who: str,
    startup_timeout_s: float,
    served_by: tuple[str, int] | None = None,
    claim_key: str | None = None,
    after: int = 0,
    holder_rank: Callable[[int], int | None] | None = None,
) -> int:
    """Join the current round and claim ``world_rank`` in it; return the round's number.

    ``who`` names the rank in errors (e.g. ``"attention 0"``). ``served_by``: the config field
    and value that choose this rank (``("ffn_rank", 0)``) when ranks of its kind beat a
    heartbeat while they serve; a claim then found taken is checked for a live holder.
    Elastic FFN slots (:mod:`~afd_core.session.membership`) claim ``claim_key`` instead of their
    world rank (which the round's members decide), only in a round newer than ``after``, and
    ``holder_rank(round)`` gives the world rank whose heartbeat shows a live holder (``None``:
    the slot does not serve that round, so nobody live holds it).

    Raises:
        AFDCancelledError: startup was cancelled while waiting (checked every poll).
        AFDTimeoutError: world rank 0 opened no round before ``deadline``.
        AFDRankServedError: the rank is claimed in the newest round and its heartbeat moves
            (``served_by`` given): a live process serves it.
        AFDStartupError: stage ``claim``, the rank is already claimed in the newest round and no
            newer round opened before ``deadline``.
    """
    if world_rank == 0:
        number = int(root.add(ROUND_KEY, 1))
        root.add(f"{round_prefix(number)}/claim/0", 1)
        return number
    number = after
    key = str(world_rank) if claim_key is None else claim_key
    while True:
        check_startup_cancelled("claim")
        current = int(root.add(ROUND_KEY, 0))
        if current > number:
            number = current
            if int(root.add(f"{round_prefix(number)}/claim/{key}", 1)) == 1:
                return number
            holder = world_rank if holder_rank is None else holder_rank(number)
            if served_by is not None and holder is not None:
                _refuse_live_holder(root, number, holder, who, served_by)
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


def _refuse_live_holder(
    root: Any, number: int, world_rank: int, who: str, served_by: tuple[str, int]
) -> None:
    """Raise :class:`AFDRankServedError` when ``world_rank``'s heartbeat in round ``number``
    moves within :data:`LIVE_HOLDER_WATCH_S`; return when it stands still (the holder is gone:
    wait for world rank 0's next round, as a restarted rank does), at once when the holder said
    goodbye or published a failure in that round (a rank reconnecting after its peers closed
    finds its own claim)."""
    prefix = round_prefix(number)
    if root.check([f"{prefix}/left/{world_rank}"]) or root.check([f"{prefix}/failed/{world_rank}"]):
        return  # the holder left that round (goodbye) or failed in it: e.g. this very process,
        # reconnecting after its peers closed, finds its own claim there
    key = f"{round_prefix(number)}/alive/{world_rank}"
    before = int(root.add(key, 0))
    time.sleep(LIVE_HOLDER_WATCH_S)
    after = int(root.add(key, 0))
    if after == before:
        return
    field, value = served_by
    raise AFDRankServedError(
        field,
        value,
        f"a {field} that no running process serves",
        detail=f"world rank {world_rank} ({who}) is served by another live process in round "
        f"{number} (its heartbeat moved {after - before} time(s) in {LIVE_HOLDER_WATCH_S:g}s); "
        f"stop that server first, or start this one with another {field}",
    )


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
