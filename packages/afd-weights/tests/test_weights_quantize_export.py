"""Quantizers, the int4 scale bias and the vLLM fused-MoE exporters."""

from types import SimpleNamespace

import pytest
import torch
from afd_weights import (
    QuantizationError,
    QuantScheme,
    decode_scale_int64,
    dequantize_layer,
    export_fused_moe_layer,
    export_fused_moe_tensors,
    export_quantized_expert_weights,
    int4_scale_bias,
    layer_codes,
    quantize_int4_per_channel,
    quantize_int4_per_group,
    quantize_int8_per_channel,
    unpack_int4_from_int32,
)

E, H, INTER = 3, 32, 16


def _w(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g)


def test_int8_per_channel_codes_and_error_bound() -> None:
    w, _ = _w()
    codes, scale = quantize_int8_per_channel(w)
    assert codes.dtype == torch.int8 and scale.shape == (E, 2 * INTER)
    assert int(codes.abs().max()) == 127
    assert torch.equal(codes.abs().amax(-1), torch.full((E, 2 * INTER), 127, dtype=torch.int8))
    err = (codes.float() * scale.unsqueeze(-1) - w).abs()
    assert bool((err <= scale.unsqueeze(-1) / 2 + 1e-7).all())


def test_zero_channel_gets_unit_scale_and_zero_codes() -> None:
    w = torch.zeros(1, 2, 4)
    w[0, 1] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    codes, scale = quantize_int8_per_channel(w)
    assert scale[0, 0].item() == 1.0 and bool((codes[0, 0] == 0).all())
    assert codes[0, 1].tolist() == [64, -127, 32, 0]  # 63.5 rounds half to even -> 64


def test_int4_per_channel_and_per_group() -> None:
    w, _ = _w(1)
    codes, scale = quantize_int4_per_channel(w)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert bool(
        (codes.float() * scale.unsqueeze(-1) - w).abs().le(scale.unsqueeze(-1) / 2 + 1e-6).all()
    )
    gcodes, gscale = quantize_int4_per_group(w, 8)
    assert gscale.shape == (E, 2 * INTER, H // 8)
    assert torch.equal(gscale.to(torch.float16).float(), gscale)  # fp16-representable
    deq = gcodes.float() * gscale.repeat_interleave(8, -1)
    # per-group is at least as accurate as per-channel here
    assert (deq - w).abs().mean() < (codes.float() * scale.unsqueeze(-1) - w).abs().mean()


def test_int4_scale_bias_formula() -> None:
    codes = torch.tensor([[[1, -2, 3, 7], [0, 0, -8, 1]]], dtype=torch.int8)
    scale = torch.tensor([[0.5, 0.25]])
    assert int4_scale_bias(codes, scale).tolist() == [[8 * 0.5 * 9, 8 * 0.25 * -7]]
    gscale = torch.tensor([[[1.0, 2.0], [0.5, 0.5]]])
    assert int4_scale_bias(codes, gscale).tolist() == [[8 * (1 * -1 + 2 * 10), 8 * 0.5 * -7]]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: quantize_int8_per_channel(torch.zeros(2, 2, dtype=torch.int8)), "weight.dtype"),
        (lambda: quantize_int8_per_channel(torch.zeros(2, 2)), "weight.shape"),
        (lambda: quantize_int8_per_channel(torch.full((1, 1, 2), float("nan"))), "weight"),
        (
            lambda: quantize_int8_per_channel(torch.zeros(1, 1, 2), scale_dtype=torch.float16),
            "scale_dtype",
        ),
        (lambda: quantize_int4_per_group(torch.zeros(1, 1, 6), 4), "group_size"),
        (lambda: quantize_int4_per_group(torch.zeros(1, 1, 8), 0), "group_size"),
        (
            lambda: int4_scale_bias(torch.zeros(1, 2, 4, dtype=torch.int8), torch.ones(1, 3)),
            "scale.shape",
        ),
    ],
)
def test_quantizer_errors(call: object, field: str) -> None:
    with pytest.raises(QuantizationError) as info:
        call()  # type: ignore[operator]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("scheme", "group"),
    [(QuantScheme.W8A8, 0), (QuantScheme.W4A8_PER_CHANNEL, 0), (QuantScheme.W4A8_PER_GROUP, 8)],
)
def test_export_layout_and_exact_codes(scheme: QuantScheme, group: int) -> None:
    w13, w2 = _w(2)
    layer = export_fused_moe_tensors(w13, w2, layer_id=5, scheme=scheme, group_size=group)
    for t in layer.tensors().values():
        assert t is None or t.is_contiguous()
    weights = export_quantized_expert_weights(
        {5: (w13, w2)}, scheme=scheme, group_size=group, swiglu_limit=10.0
    )
    codes = layer_codes(weights, 5)
    # The exporter's codes equal the quantizer's, transposed to K-major.
    if scheme is QuantScheme.W8A8:
        ref13, s13 = quantize_int8_per_channel(w13)
        assert torch.equal(codes.w13_codes, ref13.transpose(1, 2))
        assert torch.equal(codes.w13_scale[:, 0], s13)
    elif scheme is QuantScheme.W4A8_PER_CHANNEL:
        ref13, s13 = quantize_int4_per_channel(w13)
        assert torch.equal(unpack_int4_from_int32(layer.w13), ref13.transpose(1, 2))
        assert torch.equal(decode_scale_int64(layer.w13_scale), s13)
        assert torch.equal(layer.w13_bias, int4_scale_bias(ref13, s13))  # type: ignore[arg-type]
    else:
        ref13, s13 = quantize_int4_per_group(w13, group)
        assert torch.equal(codes.w13_codes, ref13.transpose(1, 2))
        assert torch.equal(codes.w13_scale, s13.transpose(1, 2))
        assert torch.equal(layer.w13_bias, int4_scale_bias(ref13, s13))  # type: ignore[arg-type]
    # Gate rows stay first, up rows second: dequantized weights track the originals.
    d13, d2 = dequantize_layer(weights, 5)
    tol = 0.02 if scheme is QuantScheme.W8A8 else 0.4
    assert (d13 - w13.transpose(1, 2)).abs().max() < tol * w13.abs().max()
    assert (d2 - w2.transpose(1, 2)).abs().max() < tol * w2.abs().max()


def test_export_from_objects_with_attributes() -> None:
    w13, w2 = _w(3)
    plain = SimpleNamespace(w13_weight=w13, w2_weight=w2)
    module = torch.nn.Module()
    module.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    module.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    a = export_fused_moe_layer(plain, layer_id=0, scheme=QuantScheme.W4A8_PER_CHANNEL)
    b = export_fused_moe_layer(module, layer_id=0, scheme=QuantScheme.W4A8_PER_CHANNEL)
    for name, t in a.tensors().items():
        assert torch.equal(t, b.tensors()[name]), name  # type: ignore[arg-type]
    weights = export_quantized_expert_weights(
        [(9, plain), (4, module)], scheme=QuantScheme.W8A8, w2_scale_dtype=torch.bfloat16
    )
    assert weights.layer_ids == (9, 4)
    assert weights.layers[0].w2_scale.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"w13_weight": torch.zeros(E, 2 * INTER, H, dtype=torch.int8)}, "w13_weight.dtype"),
        ({"w2_weight": torch.zeros(E, H, INTER + 1)}, "w2_weight.shape"),
        ({"w13_weight": torch.zeros(E, 3, H)}, "w13_weight.shape"),
        ({"scheme": "w8a8"}, "scheme"),
        ({"scheme": QuantScheme.W4A8_PER_GROUP, "group_size": 0}, "group_size"),
        ({"scheme": QuantScheme.W4A8_PER_GROUP, "group_size": 5}, "group_size"),
        ({"scheme": QuantScheme.W8A8, "group_size": 8}, "group_size"),
        ({"w2_scale_dtype": torch.float16}, "w2_scale_dtype"),
        (
            {"scheme": QuantScheme.W4A8_PER_CHANNEL, "w2_scale_dtype": torch.bfloat16},
            "w2_scale_dtype",
        ),
    ],
)
def test_export_errors(kwargs: dict[str, object], field: str) -> None:
    w13, w2 = _w()
    args: dict[str, object] = {
        "w13_weight": w13,
        "w2_weight": w2,
        "layer_id": 0,
        "scheme": QuantScheme.W8A8,
    }
    args.update(kwargs)
    with pytest.raises(QuantizationError) as info:
        export_fused_moe_tensors(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_export_rejects_object_without_attributes() -> None:
    with pytest.raises(QuantizationError) as info:
        export_fused_moe_layer(SimpleNamespace(w13_weight=1), layer_id=0, scheme=QuantScheme.W8A8)
    assert info.value.field == "source" and "w2_weight" in info.value.allowed
