"""vLLM ``general_plugins`` entry point for AFD.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
possibly more than once, so it is re-entrant and cheap. It never imports vLLM at module import
time. What it does (once per process):

1. refuses a vLLM outside 0.32.x (:class:`afd_runtime.vllm_compat.UnsupportedVLLMError`);
2. installs the runtime's vLLM patches (:mod:`afd_runtime.patches`: AFD worker selection, FFN
   engine loop); both are no-ops without ``additional_config["afd"]``;
3. registers the AFD model classes under the upstream architecture names
   (:data:`MODEL_REGISTRATIONS`). Without ``additional_config["afd"]`` those classes construct
   exactly the upstream model;
4. declares the served architectures (:data:`SERVED_MODELS`) to afd-runtime's checkpoint check
   (:mod:`afd_runtime.checkpoint_checks`), which refuses any other before an AFD engine starts.

Without vLLM installed it does nothing.
"""

from __future__ import annotations

import importlib.util
from typing import Final

#: Upstream architecture name -> AFD class (``module:Class``), registered with vLLM.
#: The architectures of the checkpoints AFD serves (declared to afd-runtime's checkpoint check).
SERVED_MODELS: Final[dict[str, str]] = {
    "Qwen3MoeForCausalLM": "afd_models.models.qwen3_moe:AFDQwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM": "afd_models.models.deepseek_v2:AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "afd_models.models.deepseek_v2:AFDDeepseekV3ForCausalLM",
    "Qwen3_5MoeForCausalLM": "afd_models.models.qwen3_5_moe:AFDQwen3_5MoeForCausalLM",
    "DeepseekV4ForCausalLM": "afd_models.models.deepseek_v4:AFDDeepseekV4ForCausalLM",
    "Glm4MoeForCausalLM": "afd_models.models.glm4_moe:AFDGlm4MoeForCausalLM",
}
#: Speculative drafters (vLLM builds them from a served checkpoint's MTP layers).
DRAFTER_MODELS: Final[dict[str, str]] = {
    "DeepSeekMTPModel": "afd_models.models.deepseek_v2:AFDDeepSeekMTP",
    "Glm4MoeMTPModel": "afd_models.models.glm4_moe:AFDGlm4MoeMTP",
}
MODEL_REGISTRATIONS: Final[dict[str, str]] = {**SERVED_MODELS, **DRAFTER_MODELS}

_registered = False


def is_registered() -> bool:
    """True once :func:`register` completed in this process."""
    return _registered


def register() -> None:
    """Register AFD with vLLM. Idempotent: later calls are no-ops."""
    global _registered
    if _registered:
        return
    if importlib.util.find_spec("vllm") is None:
        _registered = True
        return
    from afd_runtime.checkpoint_checks import declare_architectures
    from afd_runtime.patches import apply_vllm_patches
    from vllm import ModelRegistry

    apply_vllm_patches()
    declare_architectures(SERVED_MODELS)
    for arch, target in MODEL_REGISTRATIONS.items():
        ModelRegistry.register_model(arch, target)
    _registered = True
