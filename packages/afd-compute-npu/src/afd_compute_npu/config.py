"""Explicit compute configuration and Mega's communication parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from afd_compute_npu.errors import ComputeConfigError

__all__ = ["SUPPORTED_DTYPES", "ComputeConfig", "MegaCommParams"]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Activation/output dtypes of the reference backend (the Ascend backend takes bf16 and fp16)."""


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ComputeConfigError(name, value, "an int >= 1")


def _finite(name: str, value: object, *, allow_zero: bool) -> None:
    bound = ">= 0" if allow_zero else "> 0"
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = math.isfinite(v) and (v > 0 or (allow_zero and v == 0))
    if not ok:
        raise ComputeConfigError(name, value, f"a finite float {bound}")


@dataclass(frozen=True)
class ComputeConfig:
    """What the FFN runner states explicitly when it constructs Layered or Mega compute.

    Args:
        max_tokens: largest batch (tokens per call) the workspace is sized for; >= 1.
        top_k: experts per token; 1 <= top_k <= number of experts.
        dtype: activation and output dtype (one of :data:`SUPPORTED_DTYPES`).
        swiglu_limit: SwiGLU clamp; must equal the weights' value (0 disables it).
        routed_scaling_factor: must equal the weights' value.
        check_values: validate top-k id ranges and weight finiteness on every call (a host sync;
            turn off under graph capture once inputs are trusted).

    Invariant: a compute object never runs with a clamp or scaling other than the weights' own.
    """

    max_tokens: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16
    swiglu_limit: float = 0.0
    routed_scaling_factor: float = 1.0
    check_values: bool = True

    def __post_init__(self) -> None:
        _positive_int("max_tokens", self.max_tokens)
        _positive_int("top_k", self.top_k)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ComputeConfigError("dtype", self.dtype, f"one of {SUPPORTED_DTYPES}")
        _finite("swiglu_limit", self.swiglu_limit, allow_zero=True)
        _finite("routed_scaling_factor", self.routed_scaling_factor, allow_zero=False)
        if not isinstance(self.check_values, bool):
            raise ComputeConfigError("check_values", self.check_values, "a bool")


@dataclass(frozen=True, eq=False)
class MegaCommParams:
    """Communication parameters Mega receives through :meth:`MegaCompute.bind`.

    They come from the connector *after* it is initialised; Mega keeps these values, never the
    connector itself.

    Args:
        group_name: native communication group name (e.g. the HCCL comm name); non-empty.
        world_size: ranks in the group; >= 1.
        rank: this rank in the group; ``0 <= rank < world_size``.
        peer_ranks: the group ranks this rank exchanges tokens with (the peer layout); unique,
            each in ``[0, world_size)``, not containing ``rank``.
        comm_args: optional native communication context tensor owned by the connector.
        group: the torch.distributed process group behind ``group_name``, for a backend that
            runs the dispatch and combine through torch.distributed (the reference backend,
            when ``world_size > 1``); the Ascend kernel uses ``group_name`` only.
    """

    group_name: str
    world_size: int
    rank: int
    peer_ranks: tuple[int, ...]
    comm_args: torch.Tensor | None = None
    group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.group_name, str) or not self.group_name:
            raise ComputeConfigError("group_name", self.group_name, "a non-empty str")
        _positive_int("world_size", self.world_size)
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 0 <= self.rank < self.world_size
        ):
            raise ComputeConfigError("rank", self.rank, f"an int in [0, {self.world_size})")
        if not isinstance(self.peer_ranks, tuple):
            raise ComputeConfigError("peer_ranks", self.peer_ranks, "a tuple of ints")
        for p in self.peer_ranks:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.world_size:
                raise ComputeConfigError(
                    "peer_ranks", self.peer_ranks, f"ints in [0, {self.world_size})"
                )
        if len(set(self.peer_ranks)) != len(self.peer_ranks) or self.rank in self.peer_ranks:
            raise ComputeConfigError(
                "peer_ranks", self.peer_ranks, f"unique ranks not including rank={self.rank}"
            )
        if self.comm_args is not None and not isinstance(self.comm_args, torch.Tensor):
            raise ComputeConfigError("comm_args", type(self.comm_args).__name__, "a Tensor or None")
