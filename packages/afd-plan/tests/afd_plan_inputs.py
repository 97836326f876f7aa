"""Shared inputs: a round-number device and a tiny Qwen3-MoE shape, so every term can be worked
out by hand in the tests."""

from __future__ import annotations

from typing import Any

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

DEEPSEEK_V3: dict[str, Any] = {
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
DEEPSEEK_V32: dict[str, Any] = {
    **DEEPSEEK_V3,
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}
