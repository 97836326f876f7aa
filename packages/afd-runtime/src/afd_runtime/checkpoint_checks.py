"""Which checkpoints the AFD roles serve, checked before any engine starts.

The model package declares the architectures it has adapters for
(:func:`declare_architectures`: names, as vLLM's ``ModelRegistry`` takes them; no code of the
model package runs here). :func:`check_checkpoint_config` refuses, with an
:class:`~afd_core.errors.AFDModelError` naming the checkpoint field:

* ``architectures`` outside the declared ones (listed in the error): no adapter, so neither role
  would know which tensors are its own;
* a ``quantization_config`` (FP8 block, compressed-tensors, AWQ, GPTQ, ...): the FFN role serves
  the checkpoint's experts in float, or quantizes them itself (``afd.expert_quant``); experts
  quantized by the checkpoint are not verified through AFD.

It runs where the AFD worker is selected (:func:`check_served_checkpoint`, from the
``create_engine_config`` patch in the API server process, before an engine core starts), and
``afd serve`` runs it on a local checkpoint's ``config.json`` before it imports vLLM.

Invariants: declaring is idempotent and additive; with nothing declared (no model package
loaded) only the quantization rule applies.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from afd_core.config import AFDConfig
from afd_core.errors import AFDModelError

_ARCHITECTURES: set[str] = set()


def declare_architectures(names: Iterable[str]) -> None:
    """Declare the ``architectures`` the installed model package has adapters for."""
    _ARCHITECTURES.update(names)


def declared_architectures() -> tuple[str, ...]:
    """The declared architectures, sorted."""
    return tuple(sorted(_ARCHITECTURES))


def _quant_method(quant: Any) -> Any:
    if isinstance(quant, Mapping):
        return quant.get("quant_method", dict(quant))
    return getattr(quant, "quant_method", quant)


def check_checkpoint_config(
    config: Mapping[str, Any], where: str, supported: Collection[str]
) -> None:
    """Refuse the checkpoint whose ``config.json`` content is ``config`` (see the module
    docstring); ``supported``: the architectures with an adapter (empty: not checked);
    ``where`` names the checkpoint in the error."""
    architectures = list(config.get("architectures") or [])
    unknown = [a for a in architectures if a not in supported]
    if supported and (unknown or not architectures):
        raise AFDModelError(
            "architectures",
            architectures,
            f"one of {sorted(supported)}",
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


def check_served_checkpoint(cfg: AFDConfig, vllm_config: Any) -> None:
    """:func:`check_checkpoint_config` on the checkpoint vLLM is about to serve, against the
    declared architectures (a config without a model, a stand-in of vLLM's, is not checked)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    hf_config = model_config.hf_config
    fields = {
        "architectures": getattr(hf_config, "architectures", None),
        "quantization_config": getattr(hf_config, "quantization_config", None),
    }
    where = f"checkpoint {model_config.model!r}, AFD role {cfg.role.value}"
    check_checkpoint_config(fields, where, declared_architectures())
