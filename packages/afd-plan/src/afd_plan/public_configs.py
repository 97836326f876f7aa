"""Public model shapes by name: ``afd plan --model deepseek-v3`` needs no checkpoint.

Each entry holds the fields of the model's public ``config.json`` that :mod:`afd_plan.shape`
reads (copied from the model card's ``config.json``; weights are never needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["PUBLIC_CONFIGS"]

#: deepseek-ai/DeepSeek-V3 (and V3-0324, R1: the same shape).
_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "intermediate_size": 18432,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_experts_per_tok": 8,
    "vocab_size": 129280,
    "torch_dtype": "bfloat16",
}

#: DeepSeek-V3.2(-Exp): V3's shape plus the DSA lightning indexer (its public config.json).
_DEEPSEEK_V32: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}

PUBLIC_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "deepseek-v3": MappingProxyType(_DEEPSEEK_V3),
        "deepseek-v3.2": MappingProxyType(_DEEPSEEK_V32),
    }
)
"""Name -> public ``config.json`` fields; a name is accepted wherever a checkpoint path is."""
