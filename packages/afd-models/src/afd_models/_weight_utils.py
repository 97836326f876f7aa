"""Checkpoint name parsing and one-pass role filtering, shared by every model adapter.

An adapter supplies only a *classifier* (``name -> WeightOwner``); :func:`filter_role_weights`
streams the checkpoint once and yields what the role keeps, so a role never materialises the
other role's tensors beyond the loader's own read.

Invariants:
* ``filter_role_weights`` preserves the order of the kept weights and never yields a name twice
  more often than the checkpoint does.
* ``WeightOwner.BOTH`` goes to both roles, ``WeightOwner.NONE`` to neither.
* The per-role :class:`FilterStats` counts every name exactly once (kept or dropped).
* With ``local_experts`` (an expert-parallel FFN rank), a routed-expert tensor
  (``...experts.<j>....``) is kept only when ``j`` is one of the rank's experts, and renamed to
  its local index (the rank's ``FusedMoE`` holds only those); a routed-expert tensor without a
  per-expert index (a fused checkpoint layout) is an error naming it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final

import torch
from afd_core.config import AFDRole

_LAYER_RE: Final[re.Pattern[str]] = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_RE: Final[re.Pattern[str]] = re.compile(r"\.experts\.(\d+)\.")


class WeightOwner(enum.Enum):
    """Which role holds a checkpoint tensor."""

    ATTENTION = "attention"
    FFN = "ffn"
    BOTH = "both"
    NONE = "none"

    def kept_by(self, role: AFDRole) -> bool:
        """True when ``role`` loads tensors with this owner."""
        if self is WeightOwner.BOTH:
            return True
        if self is WeightOwner.NONE:
            return False
        return self.value == role.value


Classifier = Callable[[str], WeightOwner]


def layer_index(name: str) -> int | None:
    """The decoder layer index in a checkpoint name (``...layers.<i>....``), else ``None``."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def classify_moe_weight(
    name: str,
    *,
    gate_on_attention: bool,
    expert_marker: str = ".mlp.experts.",
    gate_marker: str = ".mlp.gate.",
) -> WeightOwner:
    """The generic MoE rule: routed experts -> FFN, router gate -> its side, the rest -> Attention.

    Shared experts, dense MLPs, attention, norms, embeddings and the LM head stay on Attention.
    """
    if expert_marker in name:
        return WeightOwner.FFN
    if gate_marker in name:
        return WeightOwner.ATTENTION if gate_on_attention else WeightOwner.FFN
    return WeightOwner.ATTENTION


@dataclass
class FilterStats:
    """Counts of one filtering pass (mutable; filled while the iterator is consumed)."""

    kept: int = 0
    dropped: int = 0
    kept_bytes: int = 0
    dropped_bytes: int = 0
    dropped_names: list[str] = field(default_factory=list)


def expert_index(name: str, marker: str = ".mlp.experts.") -> int | None:
    """The routed-expert index in a checkpoint name (``...experts.<j>....``), else ``None``."""
    if marker not in name:
        return None
    m = _EXPERT_RE.search(name)
    return int(m.group(1)) if m else None


def _localise_expert(name: str, local: dict[int, int], marker: str) -> str | None:
    """``name`` renamed to its local expert index, ``None`` when another rank holds it."""
    m = _EXPERT_RE.search(name, name.index(marker) + len(marker) - len(".experts."))
    if m is None:
        raise ValueError(
            f"checkpoint tensor {name!r} holds routed experts without a per-expert index; "
            "allowed with num_ffn_ranks > 1: one tensor per expert (experts.<j>.)"
        )
    j = local.get(int(m.group(1)))
    if j is None:
        return None
    return f"{name[: m.start()]}.experts.{j}.{name[m.end() :]}"


def filter_role_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    role: AFDRole,
    classify: Classifier,
    stats: FilterStats | None = None,
    *,
    local_experts: Iterable[int] | None = None,
    expert_marker: str = ".mlp.experts.",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the ``(name, tensor)`` pairs ``role`` keeps, in checkpoint order (one pass).

    ``local_experts`` (FFN role, expert parallel): the global routed experts this rank holds,
    ascending; their tensors are yielded under local indices, the others dropped.
    """
    local = None if local_experts is None else {e: i for i, e in enumerate(local_experts)}
    for name, tensor in weights:
        owner = classify(name)
        if not isinstance(owner, WeightOwner):
            raise TypeError(f"classifier returned {owner!r} for {name!r}; allowed: WeightOwner")
        nbytes = tensor.numel() * tensor.element_size()
        if local is not None and owner.kept_by(role) and expert_marker in name:
            renamed = _localise_expert(name, local, expert_marker)
            if renamed is None:
                owner = WeightOwner.NONE
            else:
                name = renamed
        if owner.kept_by(role):
            if stats is not None:
                stats.kept += 1
                stats.kept_bytes += nbytes
            yield name, tensor
        elif stats is not None:
            stats.dropped += 1
            stats.dropped_bytes += nbytes
            if len(stats.dropped_names) < 8:
                stats.dropped_names.append(name)
