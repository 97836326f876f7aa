"""Shared inputs: a round-number device and a tiny Qwen3-MoE shape, so every term can be worked
out by hand in the tests."""

from __future__ import annotations

from typing import Any

from afd_plan.public_configs import PUBLIC_CONFIGS

#: 1 TFLOP/s bf16, 2 TOP/s int8, 100 GB/s memory, 10 GB/s link, 10 us latency, 1 us a message,
#: no efficiency loss, 10 GB of memory all usable.
ROUND_DEVICE: dict[str, Any] = {
    "name": "round",
    "source": "test numbers",
    "peak_flops": {"bf16": 1e12, "int8": 2e12},
    "memory_bandwidth": 1e11,
    "memory_bytes": 1e10,
    "link_bandwidth": 1e10,
    "link_latency": 1e-5,
    "message_overhead": 1e-6,
    "memory_usable_fraction": 1.0,
}

#: hidden 64, 2 layers (both MoE), 4 heads / 2 KV heads of 16, 8 experts top-2 of 32, vocab 100.
TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "vocab_size": 100,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

DEEPSEEK_V3: dict[str, Any] = dict(PUBLIC_CONFIGS["deepseek-v3"])
DEEPSEEK_V32: dict[str, Any] = dict(PUBLIC_CONFIGS["deepseek-v3.2"])
