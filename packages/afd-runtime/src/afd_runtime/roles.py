"""Role resolution and per-role accounting shared by every AFD worker.

The byte count of a module's parameters (:func:`afd_weights.param_bytes`, shared tensors counted
once) lives in afd-weights, where the model adapters (afd-models) use it too; this module picks the
number a role reports (:func:`model_param_bytes`) and publishes it (:func:`report_param_bytes`:
the ``afd_param_bytes`` gauge of :mod:`afd_runtime.metrics`, and a log line for humans).

Invariants:
* :func:`require_afd_config` returns the parsed ``additional_config["afd"]`` whose role equals the
  worker's role, or raises :class:`~afd_core.errors.AFDConfigError` naming the field and values.
* The role rank of an Attention worker is its peer index ``dp_rank * T + tp_rank``
  (:meth:`afd_core.topology.AFDTopology.attention_peer`): every TP worker is a peer of the FFN
  ranks; ``T`` (vLLM's ``tensor_parallel_size``) must equal ``afd.attention_tp_size``. An FFN
  worker's is its ``ffn_rank``; the FFN role runs neither tensor nor pipeline parallelism (it
  scales by ``num_ffn_ranks``), and neither role runs pipeline parallelism. Violations raise an
  error naming the setting.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole, parse_afd_config
from afd_core.errors import AFDConfigError
from afd_core.topology import AFDTopology
from afd_weights import param_bytes

from afd_runtime.metrics import RoleMetrics

logger = logging.getLogger(__name__)


def require_afd_config(vllm_config: Any, role: AFDRole) -> AFDConfig:
    """The AFD config of ``vllm_config``; it must exist and name ``role``."""
    cfg = parse_afd_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        raise AFDConfigError(
            "additional_config['afd']",
            None,
            f"an AFD config with role={role.value!r}",
            detail=f"additional_config['afd'] is missing; an AFD {role.value} worker needs it",
        )
    if cfg.role is not role:
        raise AFDConfigError(
            "afd.role",
            cfg.role.value,
            repr(role.value),
            detail=f"this is the AFD {role.value} worker",
        )
    return cfg


def check_role_tensor_parallelism(cfg: AFDConfig, parallel_config: Any) -> None:
    """Refuse a vLLM tensor/pipeline parallel size the AFD config does not describe: the
    Attention role's ``tensor_parallel_size`` must equal ``afd.attention_tp_size``; the FFN role
    runs one worker per FFN rank (TP 1); no role runs pipeline parallelism."""
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise AFDConfigError(
            "--pipeline-parallel-size",
            pp,
            "1 (scale the Attention role with --data-parallel-size and "
            "--tensor-parallel-size, the FFN role with num_ffn_ranks)",
            detail="pipeline parallelism is not supported by AFD",
        )
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    if cfg.role is AFDRole.FFN and tp != 1:
        raise AFDConfigError(
            "--tensor-parallel-size",
            tp,
            "1 on the FFN role",
            detail="an FFN server is one FFN rank; split the experts with num_ffn_ranks (expert "
            "parallel) instead",
        )
    if cfg.role is AFDRole.ATTENTION and tp != cfg.attention_tp_size:
        raise AFDConfigError(
            "attention_tp_size",
            cfg.attention_tp_size,
            f"the Attention server's --tensor-parallel-size ({tp})",
            detail="every Attention TP worker is a peer of the FFN ranks, so both roles must know "
            f"T: set attention_tp_size={tp} on both roles or start the Attention role with "
            f"--tensor-parallel-size {cfg.attention_tp_size}",
        )


def check_speculative_decoding(cfg: AFDConfig, vllm_config: Any) -> None:
    """Refuse a speculative-decoding setup AFD does not run: a ``--speculative-config`` on the
    FFN role (it runs no drafter: the Attention role's drafter sends its MoE layers' tokens
    there), or beside several Attention ranks or two stages (every served peer must run the
    same draft steps in lockstep; only one data-parallel rank, one stage is verified)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    method = getattr(spec, "method", None)
    if cfg.role is AFDRole.FFN:
        raise AFDConfigError(
            "--speculative-config",
            method,
            "none on the FFN role (pass it to the Attention server only; the FFN role serves "
            "the draft layers' experts for it)",
        )
    for name, value in (
        ("num_attention_ranks", cfg.num_attention_ranks),
        ("num_stages", cfg.num_stages),
    ):
        if value != 1:
            raise AFDConfigError(
                name,
                value,
                f"1 with --speculative-config (method {method!r}): AFD runs speculative "
                "decoding on one Attention data-parallel rank and one stage",
            )


def role_rank(vllm_config: Any, cfg: AFDConfig, tp_rank: int = 0) -> int:
    """The role rank of this worker: an Attention worker's peer index ``dp_rank * T + tp_rank``
    (checked against the topology), an FFN worker's ``ffn_rank``."""
    pc = vllm_config.parallel_config
    check_role_tensor_parallelism(cfg, pc)
    if cfg.role is AFDRole.FFN:
        # One process per FFN rank (vLLM data parallelism is refused on the FFN role): the
        # rank is the config's ffn_rank, checked against num_ffn_ranks when it was parsed.
        return cfg.ffn_rank
    rank = getattr(pc, "data_parallel_index", None)
    if rank is None:
        rank = getattr(pc, "data_parallel_rank", 0)
    rank = int(rank or 0)
    expected = cfg.num_attention_ranks
    if not 0 <= rank < expected:
        raise AFDConfigError(
            "parallel_config.data_parallel_rank",
            rank,
            f"ranks 0..{expected - 1} (--data-parallel-size {expected})",
            detail=f"this attention worker's afd.num_attention_ranks={expected}",
        )
    return AFDTopology.from_config(cfg).attention_peer(rank, tp_rank)


def model_param_bytes(model: torch.nn.Module) -> int:
    """The role's weight bytes: ``model.afd_param_bytes`` when the adapter measured it while
    loading (before vLLM's post-load processing, which on CPU repacks linear weights into
    kernel-private buffers and leaves empty Parameters), else :func:`afd_weights.param_bytes`."""
    measured = getattr(model, "afd_param_bytes", None)
    return int(measured) if isinstance(measured, int) else param_bytes(model)


def report_param_bytes(
    metrics: RoleMetrics, model: torch.nn.Module, drafter: torch.nn.Module | None = None
) -> int:
    """Publish ``model``'s bytes (see :func:`model_param_bytes`), plus a speculative
    ``drafter``'s (the Attention role's MTP model), as ``afd_param_bytes`` of ``metrics``' role
    rank, log them, and return them."""
    n = model_param_bytes(model) + (0 if drafter is None else model_param_bytes(drafter))
    metrics.param_bytes(n)
    logger.info("AFD role=%s param_bytes=%d (rank %d)", metrics.role, n, metrics.rank)
    return n
