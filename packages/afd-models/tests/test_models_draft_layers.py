"""The draft-layer (DeepSeek MTP) weight policy, per role, on the tiny checkpoint's names.

One MTP layer follows the decoder layers (``model.layers.<num_hidden_layers>.*``). Its routed
experts belong to the FFN role, which serves them beside the target's; the Attention role's
target model loads none of that layer, its drafter loads the layer's attention, norms, shared
experts and MTP modules and never a routed expert. Bytes are summed per role from the
checkpoint's shapes.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from afd_core.config import AFDRole
from afd_models._weight_utils import WeightOwner
from afd_models.demo.tiny import TinySpec, model_config, tensor_shapes
from afd_models.models.deepseek_v2 import deepseek_classifier, deepseek_draft_classifier

CFG = model_config(TinySpec("deepseek_v3", mtp_layers=1), 128)
SHAPES = tensor_shapes(CFG)
N = CFG["num_hidden_layers"]
DRAFT = f"model.layers.{N}."


def _bytes(names: list[str]) -> int:
    return sum(4 * math.prod(SHAPES[n]) for n in names)


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("attention_routes", [False, True])
def test_draft_layer_experts_go_to_the_ffn_and_nothing_else_of_it_to_the_target(
    gate_on_attention: bool, attention_routes: bool
) -> None:
    target = deepseek_classifier(gate_on_attention, N, attention_routes)
    drafter = deepseek_draft_classifier(gate_on_attention, attention_routes)
    draft_names = [n for n in SHAPES if n.startswith(DRAFT)]
    experts = [n for n in draft_names if ".mlp.experts." in n]
    assert experts and len(experts) == 3 * CFG["n_routed_experts"]
    ffn = [n for n in SHAPES if target(n).kept_by(AFDRole.FFN)]
    attention_target = [n for n in SHAPES if target(n).kept_by(AFDRole.ATTENTION)]
    attention_drafter = [n for n in draft_names if drafter(n).kept_by(AFDRole.ATTENTION)]
    # The FFN role holds every routed expert of the draft layer (and the target's).
    assert set(experts) <= set(ffn)
    assert all(".mlp.experts." in n or ".mlp.gate." in n for n in ffn if n.startswith(DRAFT))
    # The Attention role holds none of them: its target model nothing of the draft layer, its
    # drafter the rest of the layer.
    assert not any(n.startswith(DRAFT) for n in attention_target)
    assert not any(".mlp.experts." in n for n in attention_drafter)
    assert {DRAFT + "eh_proj.weight", DRAFT + "shared_head.head.weight"} <= set(attention_drafter)
    assert DRAFT + "mlp.shared_experts.down_proj.weight" in attention_drafter
    # Every tensor of the draft layer is held by exactly one role.
    owners = {n: (n in ffn) + (n in attention_drafter) for n in draft_names}
    assert set(owners.values()) == {1}, owners
    # Bytes per role: the draft layer's experts weigh on the FFN role only.
    assert _bytes([n for n in ffn if n.startswith(DRAFT)]) >= _bytes(experts) > 0
    assert _bytes(attention_target) + _bytes(attention_drafter) + _bytes(ffn) == _bytes(
        list(SHAPES)
    )


def test_without_num_layers_every_layer_is_classified_alike() -> None:
    drafter = deepseek_draft_classifier(False)
    assert drafter(DRAFT + "mlp.experts.0.up_proj.weight") is WeightOwner.FFN
    assert drafter(DRAFT + "mlp.gate.weight") is WeightOwner.FFN
    assert drafter(DRAFT + "enorm.weight") is WeightOwner.ATTENTION
