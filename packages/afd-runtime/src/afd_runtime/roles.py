"""Role resolution and per-role accounting shared by every AFD worker.

Invariants:
* :func:`require_afd_config` returns the parsed ``additional_config["afd"]`` whose role equals the
  worker's role, or raises ``ValueError`` naming the field and values.
* The role rank of a worker is its vLLM data-parallel rank; tensor and pipeline parallelism inside
  one role are not supported yet and are rejected with an error naming the setting.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole, parse_afd_config

logger = logging.getLogger(__name__)

#: The line the demo parses: ``AFD role=<role> param_bytes=<n>``.
PARAM_BYTES_FORMAT = "AFD role={role} param_bytes={n}"


def require_afd_config(vllm_config: Any, role: AFDRole) -> AFDConfig:
    """The AFD config of ``vllm_config``; it must exist and name ``role``."""
    cfg = parse_afd_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        raise ValueError(
            f"additional_config['afd'] is missing; an AFD {role.value} worker needs it"
        )
    if cfg.role is not role:
        raise ValueError(
            f"additional_config['afd']['role']={cfg.role.value!r} but this is the AFD "
            f"{role.value} worker; allowed: {role.value!r}"
        )
    return cfg


def role_rank(vllm_config: Any, cfg: AFDConfig) -> int:
    """The role rank of this worker: its data-parallel rank (checked against the topology)."""
    pc = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = int(getattr(pc, name, 1))
        if size != 1:
            raise ValueError(
                f"parallel_config.{name}={size} is not supported by AFD yet; allowed: 1 "
                "(scale the attention role with --data-parallel-size)"
            )
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    rank = int(rank or 0)
    expected = cfg.num_attention_ranks if cfg.role is AFDRole.ATTENTION else cfg.num_ffn_ranks
    if not 0 <= rank < expected:
        field = "num_attention_ranks" if cfg.role is AFDRole.ATTENTION else "num_ffn_ranks"
        raise ValueError(
            f"this {cfg.role.value} worker has data-parallel rank {rank} but afd.{field}="
            f"{expected}; allowed: ranks 0..{expected - 1} (--data-parallel-size {expected})"
        )
    return rank


def param_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters (a tensor shared by two names counted once).

    Buffers (rotary caches and the like) are not weights and are not counted.
    """
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0
    for t in module.parameters():
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def model_param_bytes(model: torch.nn.Module) -> int:
    """The role's weight bytes: ``model.afd_param_bytes`` when the adapter measured it while
    loading (before vLLM's post-load processing, which on CPU repacks linear weights into
    kernel-private buffers and leaves empty Parameters), else :func:`param_bytes`."""
    measured = getattr(model, "afd_param_bytes", None)
    return int(measured) if isinstance(measured, int) else param_bytes(model)


def report_param_bytes(role: AFDRole, model: torch.nn.Module) -> int:
    """Print ``AFD role=<role> param_bytes=<n>`` for ``model`` (see :func:`model_param_bytes`)."""
    n = model_param_bytes(model)
    line = PARAM_BYTES_FORMAT.format(role=role.value, n=n)
    # Printed (not only logged) so the line has a stable, prefix-free form for log parsers.
    print(line, flush=True)
    return n
