"""The stage plan of a two-stage overlap (DBO): where a step's batch is split.

A step whose batch holds several requests is split at request boundaries into stages, balanced by
tokens. The executor that runs the stages (a ping-pong of one thread per stage, switching at
:func:`afd_core.forward_context.dbo_yield`) belongs to the runtime (``afd_runtime.overlap``).
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_core.errors import AFDConfigError

__all__ = ["plan_stages"]


def plan_stages(query_lens: Sequence[int], num_stages: int) -> tuple[int, ...] | None:
    """Requests per stage for a step whose requests have ``query_lens`` tokens, in batch order.

    Cuts at request boundaries only (a request never spans two stages), choosing the cut that
    best balances the stages' token counts (ties: the earlier cut). Returns ``None`` when the step
    runs as one stage: ``num_stages == 1`` or fewer requests than stages.

    Raises:
        AFDConfigError: ``num_stages`` is not 1 or 2, or a query length is not a positive int.
    """
    if isinstance(num_stages, bool) or num_stages not in (1, 2):
        raise AFDConfigError("num_stages", num_stages, "1 or 2")
    lens = [int(n) for n in query_lens]
    if any(n <= 0 for n in lens):
        raise AFDConfigError("query_lens", lens, "positive token counts")
    if num_stages == 1 or len(lens) < num_stages:
        return None
    total = sum(lens)
    best_cut, best_gap, prefix = 1, total, 0
    for cut in range(1, len(lens)):
        prefix += lens[cut - 1]
        gap = abs(total - 2 * prefix)
        if gap < best_gap:
            best_cut, best_gap = cut, gap
    return (best_cut, len(lens) - best_cut)
