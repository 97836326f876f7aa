"""Which FFN slots serve a round, when the FFN ranks are elastic (``expert_replicas > 1``).

With replicated experts the ``F`` FFN ranks are slots (``ffn_rank``), and a round is served by
the live slots that joined it. The round's owner, world rank 0 (the first Attention rank, which
already opens every round), decides; nobody else does. Keys (round namespace ``afd/g<n>/``, root
for the join counter)::

    afd/g<n>/claim/ffn<slot>   an FFN slot's claim in round n (first claimant wins)
    afd/g<n>/members           JSON list of the round's FFN slots, ascending (set once, by rank 0)
    afd/joins                  a counter: +1 by each slot that found a round formed without it
    afd/joining/<slot>         set by that slot, removed once a round took it

Protocol (every wait polls startup cancellation and ends at the startup deadline):

* World rank 0 opens round ``n`` (:func:`~afd_core.session.rounds.claim_round`), then waits in
  :func:`form_members` until every slot has claimed; or the *expected* slots (the previous
  round's, less the one whose failure ended it, plus those asking to join) have claimed and
  hold every routed expert; or the claimed slots hold every routed expert and no other slot
  claimed within :data:`SETTLE_S`. It publishes them as ``members``. So a lost slot is left out
  at once when the failure named it, else after :data:`SETTLE_S`; a round with too few slots
  waits (until the deadline) for them.
* An FFN slot claims ``claim/ffn<slot>`` in the newest round and reads ``members``
  (:func:`await_members`). In it: its world rank is ``P + members.index(slot)``. Not in it (it
  came after the owner decided): it bumps ``afd/joins`` and claims again in the next round.
* Other Attention ranks claim their world rank as before, then read ``members``.
* While the round serves, world rank 0 compares ``afd/joins`` with the value it read before it
  published ``members`` (:func:`joins_pending`); a newer count means a slot waits to join, and
  the owner re-forms the round at a step boundary (afd-runtime's Attention link closes with a
  goodbye and initialises again). A loss re-forms the same way, after the connector failed.

A join and a loss at once: the loss ends the round; the owner's next formation takes every slot
that claims, the joiner included, and leaves the lost one out after :data:`SETTLE_S`. Two
formations never interleave: only world rank 0 opens rounds, one at a time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from afd_core.errors import AFDTimeoutError
from afd_core.session.startup import check_startup_cancelled

__all__ = [
    "JOINS_KEY",
    "MEMBERS_KEY",
    "SETTLE_S",
    "await_members",
    "form_members",
    "joins_pending",
    "note_join",
    "slot_claim",
]

JOINS_KEY = "afd/joins"
MEMBERS_KEY = "members"
#: How long world rank 0 waits, once the claimed slots hold every expert, for more slots to
#: claim before it forms the round without them (survivors of a loss claim within a poll of the
#: Attention rank's close; a slot that is not back by then joins later).
SETTLE_S = 2.0
_POLL_S = 0.01


def slot_claim(slot: int) -> str:
    """The claim key of FFN ``slot`` inside a round's namespace."""
    return f"ffn{slot}"


def form_members(
    store: Any,
    root: Any,
    num_slots: int,
    covers: Callable[[tuple[int, ...]], bool],
    deadline: float,
    *,
    startup_timeout_s: float,
    settle_s: float = SETTLE_S,
    expected: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], int]:
    """World rank 0: decide and publish the round's members (module docstring); return them and
    the join count read before publishing (:func:`joins_pending`'s ``seen``).

    Raises:
        AFDCancelledError: startup was cancelled.
        AFDTimeoutError: no set of claimed slots holding every expert by ``deadline``.
    """
    covered_since: float | None = None
    claimed: tuple[int, ...] = ()
    want: set[int] | None = None
    if expected is not None:
        want = set(expected) | {s for s in range(num_slots) if root.check([_joining(s)])}
    while True:
        check_startup_cancelled("members")
        claimed = tuple(
            s for s in range(num_slots) if int(store.add(f"claim/{slot_claim(s)}", 0)) > 0
        )
        now = time.monotonic()
        if len(claimed) == num_slots:
            break
        if want and want <= set(claimed) and covers(claimed):
            break
        if claimed and covers(claimed):
            if covered_since is None:
                covered_since = now
            if now - covered_since >= settle_s:
                break
        else:
            covered_since = None
        if now >= deadline:
            raise AFDTimeoutError(
                f"AFD init of world rank 0 timed out in stage 'members': the FFN slots that "
                f"joined within {startup_timeout_s:g}s ({list(claimed)} of {num_slots}) do not "
                "hold every routed expert; start the missing FFN ranks"
            )
        time.sleep(_POLL_S)
    seen = int(root.add(JOINS_KEY, 0))
    store.set(MEMBERS_KEY, json.dumps(list(claimed)))
    for s in claimed:
        if root.check([_joining(s)]):
            root.delete_key(_joining(s))
    return claimed, seen


def await_members(
    store: Any, deadline: float, *, who: str, startup_timeout_s: float
) -> tuple[int, ...]:
    """The round's members once world rank 0 published them.

    Raises:
        AFDCancelledError: startup was cancelled.
        AFDTimeoutError: none published by ``deadline``.
    """
    while not store.check([MEMBERS_KEY]):
        check_startup_cancelled("members")
        if time.monotonic() >= deadline:
            raise AFDTimeoutError(
                f"AFD init of {who} timed out in stage 'members': world rank 0 did not decide "
                f"which FFN slots serve the round within {startup_timeout_s:g}s"
            )
        time.sleep(_POLL_S)
    return tuple(int(s) for s in json.loads(store.get(MEMBERS_KEY).decode("utf-8")))


def _joining(slot: int) -> str:
    return f"afd/joining/{slot}"


def note_join(root: Any, slot: int) -> None:
    """FFN ``slot``, left out of a formed round, asks world rank 0 for a new one."""
    root.set(_joining(slot), "1")
    root.add(JOINS_KEY, 1)


def joins_pending(root: Any, seen: int) -> bool:
    """World rank 0: whether a slot asked to join since the round formed (``seen``)."""
    return int(root.add(JOINS_KEY, 0)) > seen
