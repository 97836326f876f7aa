"""Expert-parallel dispatch and combine on the Attention side (``num_ffn_ranks > 1``).

With the routed experts split over ``F`` FFN ranks (afd-core's :class:`~afd_core.expert_map.
ExpertMap`), a token goes to every FFN rank that holds at least one of its top-k experts, with its
hidden state and its (global) top-k ids and weights; each rank answers the sum over *its* experts
of ``weight * expert(x)``. :func:`plan_expert_dispatch` decides the rows (or
:func:`plan_home_dispatch` when the FFN compute dispatches among the FFN ranks itself,
``expert_dispatch='ffn'``: every row to one FFN rank, whose reply is each token's whole output),
:func:`split_for_dispatch` cuts a token-aligned tensor into the per-rank pieces, :func:`combine_expert_outputs` adds the
partial outputs back.

Combine order (fixed, documented, tested): start from zeros, then add FFN rank 0's partials, then
rank 1's, ... in ascending rank order, each at its rows. A token served by one rank gets exactly
that rank's output (``0 + p == p``); a token served by ranks ``f < g`` gets ``p_f + p_g``, which
may differ by an ulp from a kernel summing all k experts in one pass.

Invariants (for any ids and any map):

* each rank's rows are ascending and unique; a token appears in the rows of exactly the ranks
  owning one of its experts (so never in none: every expert has an owner);
* ``combine(split(x)) == x`` for a row-wise identity on tokens served by one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from afd_core.errors import AFDPayloadError
from afd_core.expert_map import ExpertMap

__all__ = [
    "ExpertDispatchPlan",
    "combine_expert_outputs",
    "plan_expert_dispatch",
    "plan_home_dispatch",
    "split_for_dispatch",
]


@dataclass(frozen=True, eq=False)
class ExpertDispatchPlan:
    """Which rows of an ``num_tokens``-row batch each FFN rank gets (``rows[f]``, ascending)."""

    num_tokens: int
    rows: tuple[torch.Tensor, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        """Rows dispatched to each FFN rank."""
        return tuple(int(r.numel()) for r in self.rows)

    @property
    def num_ffn_ranks(self) -> int:
        """``F``."""
        return len(self.rows)


def plan_expert_dispatch(topk_ids: torch.Tensor, expert_map: ExpertMap) -> ExpertDispatchPlan:
    """The rows each FFN rank gets: the tokens with at least one top-k expert on that rank.

    Raises:
        AFDPayloadError: ``topk_ids`` is not ``[tokens, k]`` integers, or holds an id outside
            ``0..num_experts-1``.
    """
    if (
        not isinstance(topk_ids, torch.Tensor)
        or topk_ids.dim() != 2
        or topk_ids.dtype.is_floating_point
    ):
        shape = tuple(topk_ids.shape) if isinstance(topk_ids, torch.Tensor) else topk_ids
        raise AFDPayloadError("topk_ids", shape, "an integer [tokens, k] tensor")
    ids = topk_ids.long()
    n = int(ids.shape[0])
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= expert_map.num_experts):
        raise AFDPayloadError(
            "topk_ids",
            (int(ids.min()), int(ids.max())),
            f"expert ids in 0..{expert_map.num_experts - 1}",
        )
    owners = expert_map.owner_table(ids.device)[ids]  # [n, k]
    rows = tuple(
        torch.nonzero((owners == f).any(dim=1)).flatten() for f in range(expert_map.num_ffn_ranks)
    )
    return ExpertDispatchPlan(n, rows)


def plan_home_dispatch(num_tokens: int, home: int, num_ffn_ranks: int) -> ExpertDispatchPlan:
    """Every row to FFN rank ``home``, none to the others: the plan when the FFN compute
    dispatches the tokens among the FFN ranks itself (``expert_dispatch='ffn'``, Mega). Combined
    with :func:`combine_expert_outputs` the output is ``home``'s rows as replied.

    Raises:
        AFDPayloadError: ``home`` is not in ``0..num_ffn_ranks-1`` or ``num_tokens < 0``.
    """
    if not 0 <= home < num_ffn_ranks:
        raise AFDPayloadError("home", home, f"an FFN rank in 0..{num_ffn_ranks - 1}")
    if num_tokens < 0:
        raise AFDPayloadError("num_tokens", num_tokens, "an int >= 0")
    empty = torch.empty(0, dtype=torch.int64)
    rows = tuple(torch.arange(num_tokens) if f == home else empty for f in range(num_ffn_ranks))
    return ExpertDispatchPlan(num_tokens, rows)


def split_for_dispatch(
    tensor: torch.Tensor, plan: ExpertDispatchPlan, *, field: str = "hidden_states"
) -> list[torch.Tensor]:
    """``tensor``'s rows for each FFN rank (contiguous copies), in rank order."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise AFDPayloadError(field, getattr(tensor, "shape", tensor), "a token-aligned tensor")
    if tensor.shape[0] != plan.num_tokens:
        raise AFDPayloadError(
            field, tuple(tensor.shape), f"{plan.num_tokens} rows (the dispatched batch)"
        )
    return [tensor.index_select(0, rows) for rows in plan.rows]


def combine_expert_outputs(
    partials: Sequence[torch.Tensor], plan: ExpertDispatchPlan
) -> torch.Tensor:
    """Add each FFN rank's partial output at its rows, ranks in ascending order (see the module
    docstring for why the order is fixed).

    Raises:
        AFDPayloadError: not one partial per rank, or a partial's rows differ from the plan.
    """
    if len(partials) != plan.num_ffn_ranks:
        raise AFDPayloadError(
            "ffn_outputs", len(partials), f"{plan.num_ffn_ranks} tensors (one per FFN rank)"
        )
    ref = next((p for p in partials if p.numel()), partials[0])
    out = torch.zeros((plan.num_tokens, ref.shape[-1]), dtype=ref.dtype, device=ref.device)
    for f, (part, rows) in enumerate(zip(partials, plan.rows, strict=True)):
        if part.dim() != 2 or part.shape[0] != rows.numel():
            raise AFDPayloadError(
                f"ffn_outputs[{f}]", tuple(part.shape), f"{rows.numel()} rows (as dispatched)"
            )
        if rows.numel():
            out.index_add_(0, rows, part)
    return out
