"""QuantizedExpertWeights validation: references, homogeneity, exact error fields."""

import dataclasses

import pytest
import torch
from afd_weights import (
    ExpertLayerTensors,
    QuantizedExpertWeights,
    QuantScheme,
    WeightLayoutError,
    WeightsError,
    export_fused_moe_tensors,
)

E, H, INTER = 2, 16, 8


def _layer(
    layer_id: int, scheme: QuantScheme = QuantScheme.W8A8, group: int = 0, seed: int = 0
) -> ExpertLayerTensors:
    g = torch.Generator().manual_seed(seed + layer_id)
    return export_fused_moe_tensors(
        torch.randn(E, 2 * INTER, H, generator=g),
        torch.randn(E, H, INTER, generator=g),
        layer_id=layer_id,
        scheme=scheme,
        group_size=group,
    )


def _replace(layer: ExpertLayerTensors, **kw: object) -> ExpertLayerTensors:
    return dataclasses.replace(layer, **kw)  # type: ignore[arg-type]


def test_holds_references_and_keeps_layer_order() -> None:
    layers = (_layer(7), _layer(2), _layer(5))
    w = QuantizedExpertWeights(scheme=QuantScheme.W8A8, layers=layers)
    assert w.layer_ids == (7, 2, 5)
    for mine, given in zip(w.layers, layers, strict=True):
        assert mine is given
        assert mine.w13 is given.w13 and mine.w2_scale is given.w2_scale
    assert w.slot_of(2) == 1
    assert w.layer(5) is layers[2]
    geo = w.geometry
    assert (geo.num_layers, geo.num_experts, geo.hidden_size, geo.intermediate_size) == (
        3,
        E,
        H,
        INTER,
    )
    assert geo.group_size == 0 and geo.w13_num_groups == 1


def test_per_group_geometry() -> None:
    w = QuantizedExpertWeights(
        scheme=QuantScheme.W4A8_PER_GROUP,
        layers=(_layer(0, QuantScheme.W4A8_PER_GROUP, 4),),
        group_size=4,
    )
    assert (w.geometry.w13_num_groups, w.geometry.w2_num_groups) == (H // 4, INTER // 4)


def test_heterogeneous_layer_names_layer_tensor_expected_and_actual() -> None:
    good = _layer(0)
    bad = _layer(3)
    bad = _replace(bad, w2_scale=bad.w2_scale.to(torch.bfloat16))
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(scheme=QuantScheme.W8A8, layers=(good, bad))
    err = info.value
    assert (err.layer_id, err.tensor, err.prop) == (3, "w2_scale", "dtype")
    assert (err.expected, err.actual) == (torch.float32, torch.bfloat16)
    assert "layer 3" in str(err) and "w2_scale" in str(err)


def test_heterogeneous_strides_rejected() -> None:
    good, other = _layer(0), _layer(1)
    transposed = other.w13_scale.t().contiguous().t()
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(
            scheme=QuantScheme.W8A8, layers=(good, _replace(other, w13_scale=transposed))
        )
    err = info.value
    assert (err.layer_id, err.tensor, err.prop) == (1, "w13_scale", "stride")
    assert err.expected == (2 * INTER, 1) and err.actual == (1, E)


def test_first_layer_checked_against_scheme_spec() -> None:
    layer = _layer(4)
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(
            scheme=QuantScheme.W8A8, layers=(_replace(layer, w2=layer.w2[:, :-1]),)
        )
    assert (info.value.layer_id, info.value.tensor, info.value.prop) == (4, "w2", "shape")
    assert info.value.expected == (E, INTER, H)
    assert info.value.actual == (E, INTER - 1, H)


def test_w8a8_with_bias_and_w4a8_without_bias_rejected() -> None:
    layer = _layer(0)
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(
            scheme=QuantScheme.W8A8,
            layers=(_replace(layer, w13_bias=torch.zeros(E, 2 * INTER)),),
        )
    assert (info.value.tensor, info.value.prop) == ("w13_bias", "presence")
    int4 = _layer(0, QuantScheme.W4A8_PER_CHANNEL)
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(
            scheme=QuantScheme.W4A8_PER_CHANNEL, layers=(_replace(int4, w2_bias=None),)
        )
    assert (info.value.tensor, info.value.prop, info.value.expected) == (
        "w2_bias",
        "presence",
        "present",
    )


def test_wrong_weight_dtype_for_scheme() -> None:
    with pytest.raises(WeightLayoutError) as info:
        QuantizedExpertWeights(scheme=QuantScheme.W4A8_PER_CHANNEL, layers=(_layer(0),))
    assert (info.value.tensor, info.value.prop) == ("w13", "dtype")
    assert info.value.expected == torch.int32 and info.value.actual == torch.int8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layers": ()}, "layers"),
        ({"layers": "abc"}, "layers[0]"),
        ({"layers": (_layer(1), _layer(1))}, "layers.layer_id"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"swiglu_limit": float("nan")}, "swiglu_limit"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
        ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor"),
        ({"group_size": 4}, "group_size"),
        ({"scheme": "w8a8"}, "scheme"),
    ],
)
def test_scalar_and_collection_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"scheme": QuantScheme.W8A8, "layers": (_layer(0),)}
    args.update(kwargs)
    with pytest.raises(WeightsError) as info:
        QuantizedExpertWeights(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_per_group_requires_group_size_dividing_sizes() -> None:
    layer = _layer(0, QuantScheme.W4A8_PER_GROUP, 4)
    with pytest.raises(WeightsError) as info:
        QuantizedExpertWeights(scheme=QuantScheme.W4A8_PER_GROUP, layers=(layer,), group_size=0)
    assert info.value.field == "group_size"
    with pytest.raises(WeightsError) as info:
        QuantizedExpertWeights(scheme=QuantScheme.W4A8_PER_GROUP, layers=(layer,), group_size=3)
    assert info.value.field == "group_size"


def test_unknown_layer_and_bad_layer_id() -> None:
    w = QuantizedExpertWeights(scheme=QuantScheme.W8A8, layers=(_layer(0),))
    with pytest.raises(WeightsError) as info:
        w.slot_of(3)
    assert info.value.field == "layer_id" and info.value.value == 3
    with pytest.raises(WeightsError) as info:
        ExpertLayerTensors(-1, *(torch.zeros(1),) * 4)
    assert info.value.field == "layer_id"
    with pytest.raises(WeightsError) as info:
        bad: object = "x"
        ExpertLayerTensors(0, torch.zeros(1), bad, torch.zeros(1), torch.zeros(1))  # type: ignore[arg-type]
    assert info.value.field == "w2"


def test_nbytes_counts_every_tensor() -> None:
    w = QuantizedExpertWeights(scheme=QuantScheme.W8A8, layers=(_layer(0), _layer(1)))
    per_layer = E * H * 2 * INTER + E * INTER * H + 4 * E * 2 * INTER + 4 * E * H
    assert w.nbytes() == 2 * per_layer


def test_errors_share_the_afd_core_base() -> None:
    from afd_core.errors import AFDError

    with pytest.raises(AFDError):
        QuantizedExpertWeights(scheme=QuantScheme.W8A8, layers=())
