"""Which checkpoints AFD serves, checked before any engine starts.

:func:`check_checkpoint` is registered with afd-runtime (:mod:`afd_runtime.checkpoint_checks`)
by the vLLM plugin, and ``afd serve`` runs :func:`check_checkpoint_config` on a local
checkpoint's ``config.json`` before it imports vLLM, so an AFD role (``afd serve`` or ``vllm serve`` with the ``afd`` mapping) of a
checkpoint AFD cannot serve is refused in the API server process, with an
:class:`~afd_core.errors.AFDModelError` naming the checkpoint field, before an engine core starts.

Refused, each with its reason:

* ``architectures`` other than the adapters' (:data:`SUPPORTED_ARCHITECTURES`): AFD has no
  adapter, so neither role would know which tensors are its own.
* a ``quantization_config`` (FP8 block, compressed-tensors, AWQ, GPTQ, ...): the FFN role serves
  the checkpoint's experts in float, or quantizes them itself (``afd.expert_quant``); experts
  quantized by the checkpoint are not verified through AFD. Where plain vLLM 0.32 CPU cannot load
  such a checkpoint either, vLLM's own configuration refuses it first (as for plain vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from afd_core.config import AFDConfig
from afd_core.errors import AFDModelError

from afd_models.plugin import MODEL_REGISTRATIONS

#: Architectures of the speculative drafters AFD serves: never a served model's own.
DRAFTER_ARCHITECTURES: Final[frozenset[str]] = frozenset({"DeepSeekMTPModel", "Glm4MoeMTPModel"})

#: The ``architectures`` of checkpoints AFD serves (one adapter each).
SUPPORTED_ARCHITECTURES: Final[tuple[str, ...]] = tuple(
    sorted(set(MODEL_REGISTRATIONS) - DRAFTER_ARCHITECTURES)
)


def _quant_method(quant: Any) -> Any:
    if isinstance(quant, Mapping):
        return quant.get("quant_method", dict(quant))
    return getattr(quant, "quant_method", quant)


def check_checkpoint_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse the checkpoint whose ``config.json`` content is ``config`` (see the module
    docstring); ``where`` names it in the error."""
    architectures = list(config.get("architectures") or [])
    unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unknown or not architectures:
        raise AFDModelError(
            "architectures",
            architectures,
            f"one of {list(SUPPORTED_ARCHITECTURES)}",
            detail=f"{where}: AFD has no adapter for it; plain vLLM serves it without the "
            "'afd' mapping",
        )
    quant = config.get("quantization_config")
    if quant:
        raise AFDModelError(
            "quantization_config.quant_method",
            _quant_method(quant),
            "a checkpoint without quantization_config",
            detail=f"{where}: AFD serves the checkpoint's experts in float, or quantizes them on "
            "the FFN role itself (afd.expert_quant); checkpoint-quantized experts are not "
            "verified through AFD",
        )


def check_checkpoint(cfg: AFDConfig, vllm_config: Any) -> None:
    """The check afd-runtime runs before any AFD engine starts (either role); a config without
    a model (a stand-in of vLLM's) has no checkpoint to check."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    hf_config = model_config.hf_config
    fields = {
        "architectures": getattr(hf_config, "architectures", None),
        "quantization_config": getattr(hf_config, "quantization_config", None),
    }
    check_checkpoint_config(fields, f"checkpoint {model_config.model!r}, AFD role {cfg.role.value}")
