"""One-pass role filtering and the adapters' classifiers (no vLLM needed for the generic part)."""

from __future__ import annotations

import pytest
import torch
from afd_core.config import AFDRole
from afd_models._weight_utils import (
    FilterStats,
    WeightOwner,
    classify_moe_weight,
    filter_role_weights,
    layer_index,
)

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.experts.0.gate_proj.weight",
    "model.layers.1.mlp.experts.7.down_proj.weight",
    "model.layers.1.mlp.shared_experts.up_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def _weights() -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.full((i + 1,), float(i))) for i, n in enumerate(NAMES)]


def test_layer_index() -> None:
    assert layer_index("model.layers.12.mlp.gate.weight") == 12
    assert layer_index("model.embed_tokens.weight") is None
    assert layer_index("layers.3.x") == 3


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_generic_moe_rule(gate_on_attention: bool) -> None:
    gate_owner = WeightOwner.ATTENTION if gate_on_attention else WeightOwner.FFN
    owners = [classify_moe_weight(n, gate_on_attention=gate_on_attention) for n in NAMES]
    assert owners == [
        WeightOwner.ATTENTION,
        WeightOwner.ATTENTION,
        WeightOwner.ATTENTION,  # dense MLP gate_proj is not the router gate
        gate_owner,
        WeightOwner.FFN,
        WeightOwner.FFN,
        WeightOwner.ATTENTION,
        WeightOwner.ATTENTION,
        WeightOwner.ATTENTION,
    ]


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_filter_is_one_pass_ordered_and_partitions(gate_on_attention: bool) -> None:
    def classify(name: str) -> WeightOwner:
        return classify_moe_weight(name, gate_on_attention=gate_on_attention)

    consumed: list[str] = []

    def source() -> object:
        for name, t in _weights():
            consumed.append(name)
            yield name, t

    stats = FilterStats()
    ffn = list(filter_role_weights(source(), AFDRole.FFN, classify, stats))  # type: ignore[arg-type]
    assert consumed == NAMES  # read exactly once, in order
    attn = list(filter_role_weights(_weights(), AFDRole.ATTENTION, classify))
    ffn_names = [n for n, _ in ffn]
    attn_names = [n for n, _ in attn]
    assert sorted(ffn_names + attn_names) == sorted(NAMES)
    assert set(ffn_names).isdisjoint(attn_names)
    assert ffn_names == [n for n in NAMES if n in ffn_names]  # order preserved
    assert ("model.layers.1.mlp.gate.weight" in ffn_names) is (not gate_on_attention)
    assert stats.kept == len(ffn) and stats.dropped == len(attn)
    by_name = dict(_weights())
    for name, t in ffn + attn:
        assert torch.equal(t, by_name[name])
    assert stats.kept_bytes == sum(t.numel() * 4 for _, t in ffn)


def test_both_and_none_owners() -> None:
    owners = {"a": WeightOwner.BOTH, "b": WeightOwner.NONE}
    w = [("a", torch.zeros(1)), ("b", torch.zeros(1))]
    for role in AFDRole:
        assert [n for n, _ in filter_role_weights(w, role, owners.__getitem__)] == ["a"]


def test_classifier_must_return_an_owner() -> None:
    with pytest.raises(TypeError, match="WeightOwner"):
        list(filter_role_weights(_weights(), AFDRole.FFN, lambda n: "ffn"))  # type: ignore[arg-type,return-value]


def test_deepseek_classifier_bias_and_mtp_layers() -> None:
    pytest.importorskip("vllm")
    from afd_models.models.deepseek_v2 import deepseek_classifier

    c = deepseek_classifier(gate_on_attention=True, num_layers=3)
    assert c("model.layers.1.mlp.gate.e_score_correction_bias") is WeightOwner.FFN
    assert c("model.layers.1.mlp.gate.weight") is WeightOwner.ATTENTION
    # Layer 3 is past num_layers: the MTP (draft) layer. The FFN role serves its experts; its
    # other tensors belong to the Attention role's drafter, never to the target model.
    assert c("model.layers.3.mlp.experts.0.up_proj.weight") is WeightOwner.FFN
    assert c("model.layers.3.mlp.gate.weight") is WeightOwner.NONE  # the gate is on Attention
    assert c("model.layers.3.self_attn.o_proj.weight") is WeightOwner.NONE
    assert c("model.layers.3.eh_proj.weight") is WeightOwner.NONE
    assert c("model.layers.2.mlp.shared_experts.up_proj.weight") is WeightOwner.ATTENTION
    assert deepseek_classifier(False, 3)("model.layers.1.mlp.gate.weight") is WeightOwner.FFN


def test_filter_keeps_and_renames_a_ranks_experts_only() -> None:
    names = [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.experts.5.down_proj.weight",
        "model.layers.1.mlp.experts.2.up_proj.weight",
        "model.layers.1.mlp.experts.4.gate_proj.weight",
        "model.layers.1.mlp.experts.12.gate_proj.weight",  # two digits: not expert 1 or 2
        "model.layers.1.self_attn.o_proj.weight",
    ]
    weights = [(n, torch.zeros(2)) for n in names]

    def classify(name: str) -> WeightOwner:
        return classify_moe_weight(name, gate_on_attention=True)

    stats = FilterStats()
    kept = list(
        filter_role_weights(weights, AFDRole.FFN, classify, stats, local_experts=(4, 5, 12))
    )
    assert [n for n, _ in kept] == [
        "model.layers.1.mlp.experts.1.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.2.gate_proj.weight",
    ]
    assert (stats.kept, stats.dropped) == (3, 3)
    # The Attention role is untouched by an expert selection.
    att = list(filter_role_weights(weights, AFDRole.ATTENTION, classify, local_experts=(4,)))
    assert [n for n, _ in att] == [names[0], names[5]]
    fused = [("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(2))]
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj"):
        list(filter_role_weights(fused, AFDRole.FFN, classify, local_experts=(0,)))
