"""ModelShape from config.json: layer layout, parameter counts against the published totals,
and errors that name the field, the value and what is allowed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_plan.errors import AFDPlanError
from afd_plan.shape import load_model_shape, shape_from_config
from afd_plan_inputs import DEEPSEEK_V3, DEEPSEEK_V32, TINY_QWEN3


def _total_params(cfg: dict[str, object]) -> int:
    s = shape_from_config(cfg)
    return (
        s.embedding_params()
        + s.num_layers * s.attention.weight_params(s.hidden_size)
        + s.num_dense_layers * s.dense_mlp_params()
        + s.num_moe_layers * (s.shared_params() + s.num_experts * s.expert_params())
    )


def test_deepseek_v3_layout_and_671b_parameters() -> None:
    s = shape_from_config(DEEPSEEK_V3)
    assert s.moe_layers == tuple(range(3, 61)) and s.num_dense_layers == 3
    # MLA per layer: q 7168*1536 + 1536*128*192 = 48,758,784; kv_a 7168*576 = 4,128,768;
    # kv_b 512*128*(128+128) = 16,777,216; o 128*128*7168 = 117,440,512.
    assert s.attention.weight_params(7168) == 187_105_280
    assert s.attention.kv_elems_per_token() == 512 + 64
    assert s.shared_intermediate_size == 2048
    # 671B published (without the 14B MTP module); norms and routers (~0.04B) are left out.
    assert 670.5e9 < _total_params(DEEPSEEK_V3) < 671.5e9


def test_qwen3_30b_a3b_parameters() -> None:
    cfg = {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    }
    s = shape_from_config(cfg)
    assert s.num_moe_layers == 48 and s.dense_intermediate_size == 0
    # 48 * (18.87M attention + 128 * 4.72M experts) + 2 * 151936 * 2048 = 30.5B (published 30.5B).
    assert 30.4e9 < _total_params(cfg) < 30.6e9


def test_qwen3_sparse_step_and_mlp_only_layers() -> None:
    s = shape_from_config(
        {**TINY_QWEN3, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    # (i + 1) % 2 == 0 -> 1, 3, 5; 3 is MLP-only.
    assert s.moe_layers == (1, 5) and s.num_dense_layers == 4


def test_deepseek_moe_layer_freq() -> None:
    s = shape_from_config({**DEEPSEEK_V3, "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert s.moe_layers == tuple(range(2, 61, 2))


def test_dsa_attends_index_topk_tokens_and_reads_every_indexer_key() -> None:
    a = shape_from_config(DEEPSEEK_V32).attention
    assert a.attended_tokens(16384) == 2048 and a.attended_tokens(1000) == 1000
    assert a.index_bytes_per_token() == 128 + 4
    # 2 * params + core 2*128*(2*512+64)*2048 + indexer 2*64*128*16384.
    params = a.weight_params(7168)
    assert params - 187_105_280 == 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
    expected = 2 * params + 2 * 128 * 1088 * 2048 + 2 * 64 * 128 * 16384
    assert a.flops_per_token(7168, 16384) == expected


def test_folder_or_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    assert load_model_shape(tmp_path) == load_model_shape(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("change", "field", "value", "allowed"),
    [
        ({"model_type": "llama"}, "config.json:model_type", "llama", "qwen3_moe"),
        ({"hidden_size": 0}, "config.json:hidden_size", 0, "an integer >= 1"),
        ({"hidden_size": "64"}, "config.json:hidden_size", "64", "an integer >= 1"),
        ({"num_experts_per_tok": 9}, "config.json:num_experts_per_tok", 9, "1..8"),
        ({"torch_dtype": "int4"}, "config.json:torch_dtype", "int4", "bfloat16"),
        ({"mlp_only_layers": [7]}, "config.json:mlp_only_layers", [7], "[0, 2)"),
    ],
)
def test_bad_config_names_field_value_allowed(
    change: dict[str, object], field: str, value: object, allowed: str
) -> None:
    with pytest.raises(AFDPlanError) as err:
        shape_from_config({**TINY_QWEN3, **change})
    assert err.value.field == field and err.value.value == value
    assert allowed in err.value.allowed and field in str(err.value)


def test_missing_field_is_named() -> None:
    cfg = dict(DEEPSEEK_V3)
    del cfg["kv_lora_rank"]
    with pytest.raises(AFDPlanError, match=r"'config.json:kv_lora_rank': got None.*missing"):
        shape_from_config(cfg)


def test_missing_file_and_bad_json(tmp_path: Path) -> None:
    with pytest.raises(AFDPlanError, match=r"config\.json"):
        load_model_shape(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(AFDPlanError, match="readable JSON"):
        load_model_shape(tmp_path)


#: Qwen3.5-35B-A3B's text_config (public config.json), nested as in the checkpoint.
QWEN3_5_35B = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "full_attention_interval": 4,
        "vocab_size": 248320,
        "torch_dtype": "bfloat16",
    },
}


def test_qwen3_5_moe_layout_and_35b_parameters() -> None:
    s = shape_from_config(QWEN3_5_35B)
    assert s.family == "qwen3_5_moe" and s.num_moe_layers == 40
    assert s.linear_layers == tuple(i for i in range(40) if (i + 1) % 4)  # 30 linear, 10 full
    full, linear = s.attention, s.linear_attention
    assert linear is not None and s.attention_at(3) is full and s.attention_at(0) is linear
    # full (gated q): 2048*16*256*2 + 2*2048*2*256 + 16*256*2048 = 27,262,976
    assert full.weight_params(2048) == 27_262_976
    # linear: Dk = 2048, Dv = 4096: 2048*8192 + 2048*4096 + 2*2048*32 + 8192*4 + 4096*2048
    assert linear.weight_params(2048) == 2048 * 8192 + 2048 * 4096 + 131072 + 32768 + 4096 * 2048
    assert linear.kv_elems_per_token() == 0
    # state: 32 * 128 * 128 * 4 B + 8192 * 3 * 2 B
    assert linear.state_bytes(2) == 2_097_152 + 49_152
    # Published: 35B total (the text model here; the vision encoder is left out).
    assert 34.3e9 < _total_params(QWEN3_5_35B) < 35.0e9


def test_qwen3_5_layer_types_win_and_are_checked() -> None:
    text = dict(QWEN3_5_35B["text_config"])  # type: ignore[call-overload]
    s = shape_from_config({**text, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2})
    assert s.linear_layers == ()
    with pytest.raises(AFDPlanError, match="layer_types"):
        shape_from_config({**text, "num_hidden_layers": 2, "layer_types": ["sliding"] * 2})
