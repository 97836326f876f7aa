"""The Ascend backend's native calls, recorded by a fake native module (no NPU needed)."""

import dataclasses
import importlib.util
import sys
from typing import Any

import pytest
import torch
from afd_compute_npu import (
    AscendBackend,
    BackendUnavailableError,
    ComputeConfig,
    ComputeConfigError,
    LayeredCompute,
    MegaCommParams,
    MegaCompute,
    load_ascend_native_ops,
)
from afd_weights import QuantizedExpertWeights, QuantScheme, export_quantized_expert_weights

E, H, INTER, K, T, MAX_T = 4, 32, 16, 2, 5, 8


def desc(v: object) -> object:
    """A value with tensors replaced by (dtype, shape)."""
    if isinstance(v, torch.Tensor):
        return ("T", v.dtype, tuple(v.shape))
    if isinstance(v, list | tuple):
        return [desc(x) for x in v]
    return v


class RecordingNative:
    """Same op names as the native module; records every call and returns shaped tensors."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.dtype = dtype

    def _rec(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append((name, args, kwargs))

    def npu_moe_init_routing_v2(self, x: torch.Tensor, ids: torch.Tensor, **kw: Any) -> Any:
        self._rec("npu_moe_init_routing_v2", (x, ids), kw)
        r = ids.numel()
        counts = torch.bincount(ids.reshape(-1).long(), minlength=kw["expert_num"])
        return (
            torch.ones(r, x.shape[1], dtype=torch.int8),
            torch.arange(r, dtype=torch.int32),
            counts,
            torch.ones(r, dtype=torch.float32),
        )

    def grouped_matmul_swiglu_quant_weight_nz(self, *args: Any, **kw: Any) -> Any:
        self._rec("grouped_matmul_swiglu_quant_weight_nz", args, kw)
        r = args[0].shape[0]
        inter = args[1].shape[-1] // 2
        return torch.ones(r, inter, dtype=torch.int8), torch.ones(r), torch.empty(0)

    def grouped_matmul_swiglu_quant_v2(self, *args: Any, **kw: Any) -> Any:
        self._rec("grouped_matmul_swiglu_quant_v2", args, kw)
        r = args[0].shape[0]
        inter = args[1][0].shape[-1] * 8 // 2
        return torch.ones(r, inter, dtype=torch.int8), torch.ones(r)

    def npu_grouped_matmul(self, *args: Any, **kw: Any) -> Any:
        self._rec("npu_grouped_matmul", args, kw)
        r = args[0][0].shape[0]
        return [torch.full((r, H), 2.0, dtype=kw["output_dtype"])]

    def npu_moe_token_unpermute(self, y: torch.Tensor, idx: torch.Tensor, **kw: Any) -> Any:
        self._rec("npu_moe_token_unpermute", (y, idx), kw)
        return torch.full((kw["probs"].shape[0], y.shape[1]), 1.5, dtype=y.dtype)

    def dispatch_ffn_combine(self, *args: Any, **kw: Any) -> None:
        self._rec("dispatch_ffn_combine", args, kw)
        args[11].fill_(1.5)


def make_weights(scheme: QuantScheme, clamp: float, rsf: float = 1.0) -> QuantizedExpertWeights:
    g = torch.Generator().manual_seed(0)
    src = {
        i: (torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g))
        for i in (3, 8)
    }
    group = 8 if scheme.is_per_group else 0
    return export_quantized_expert_weights(
        src, scheme=scheme, group_size=group, swiglu_limit=clamp, routed_scaling_factor=rsf
    )


def inputs(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    x = torch.randn(T, H).to(dtype)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]], dtype=torch.int64)
    w = torch.full((T, K), 0.5, dtype=torch.float32)
    return x, ids, w


def config(weights: QuantizedExpertWeights, dtype: torch.dtype = torch.bfloat16) -> ComputeConfig:
    return ComputeConfig(
        max_tokens=MAX_T,
        top_k=K,
        dtype=dtype,
        swiglu_limit=weights.swiglu_limit,
        routed_scaling_factor=weights.routed_scaling_factor,
    )


def recorded(native: RecordingNative) -> list[tuple[str, list[object], list[tuple[str, object]]]]:
    return [
        (n, [desc(a) for a in args], [(k, desc(v)) for k, v in kw.items()])
        for n, args, kw in native.calls
    ]


def routing_call(dt: torch.dtype) -> tuple[str, list[object], list[tuple[str, object]]]:
    return (
        "npu_moe_init_routing_v2",
        [("T", dt, (T, H)), ("T", torch.int32, (T, K))],
        [
            ("active_num", T * K),
            ("expert_num", E),
            ("expert_tokens_num_type", 1),
            ("expert_tokens_num_flag", True),
            ("active_expert_range", [0, E]),
            ("quant_mode", 1),
            ("row_idx_type", 0),
        ],
    )


@pytest.mark.parametrize("clamp", [0.0, 10.0])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_layered_w8a8_native_calls(clamp: float, dt: torch.dtype) -> None:
    weights = make_weights(QuantScheme.W8A8, clamp, rsf=2.0)
    native = RecordingNative(dt)
    comp = LayeredCompute(weights, config(weights, dt), AscendBackend(native))
    x, ids, w = inputs(dt)
    out = comp(8, x, ids, w)
    r = T * K
    assert recorded(native) == [
        routing_call(dt),
        (
            "grouped_matmul_swiglu_quant_weight_nz",
            [
                ("T", torch.int8, (r, H)),
                ("T", torch.int8, (E, H, 2 * INTER)),
                ("T", torch.float32, (E, 2 * INTER)),
                ("T", torch.float32, (r,)),
                ("T", torch.int64, (E,)),
            ],
            [("bias", None), ("swiglu_limit", clamp)],
        ),
        (
            "npu_grouped_matmul",
            [[("T", torch.int8, (r, INTER))], [("T", torch.int8, (E, INTER, H))]],
            [
                ("bias", [("T", torch.int32, (E, H))]),
                ("scale", [("T", torch.float32, (E, H))]),
                ("per_token_scale", [("T", torch.float32, (r,))]),
                ("group_list", ("T", torch.int64, (E,))),
                ("split_item", 2),
                ("group_type", 0),
                ("group_list_type", 1),
                ("output_dtype", dt),
            ],
        ),
        (
            "npu_moe_token_unpermute",
            [("T", dt, (r, H)), ("T", torch.int32, (r,))],
            [("probs", ("T", dt, (T, K)))],
        ),
    ]
    layer = weights.layer(8)
    _, g1_args, _ = native.calls[1]
    assert g1_args[1] is layer.w13 and g1_args[2] is layer.w13_scale
    # The cumulative group list of the counts the routing returned.
    assert g1_args[4] is comp.workspace.group_list
    assert g1_args[4].tolist() == [3, 5, 8, 10]
    _, g2_args, g2_kw = native.calls[2]
    assert g2_args[1][0] is layer.w2 and g2_kw["scale"][0] is layer.w2_scale
    zero = comp.workspace.zero_bias
    assert zero is not None and g2_kw["bias"][0] is zero
    assert not bool(zero.any())
    assert native.calls[0][1][1].tolist() == ids.tolist()
    assert torch.equal(native.calls[3][2]["probs"], w.to(dt))
    assert torch.equal(out, torch.full((T, H), 3.0, dtype=dt))  # 1.5 * routed_scaling_factor
    assert out.data_ptr() == comp.workspace.out.data_ptr()


@pytest.mark.parametrize("clamp", [0.0, 10.0])
@pytest.mark.parametrize("scheme", [QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP])
def test_layered_w4a8_native_calls(clamp: float, scheme: QuantScheme) -> None:
    weights = make_weights(scheme, clamp)
    native = RecordingNative(torch.bfloat16)
    comp = LayeredCompute(weights, config(weights), AscendBackend(native))
    x, ids, w = inputs()
    comp(3, x, ids, w)
    r, n13 = T * K, 2 * INTER
    per_group = scheme.is_per_group
    s13 = (E, H // 8, n13) if per_group else (E, n13)
    s2 = (E, INTER // 8, H) if per_group else (E, 1, H)
    assert recorded(native) == [
        routing_call(torch.bfloat16),
        (
            "grouped_matmul_swiglu_quant_v2",
            [
                ("T", torch.int8, (r, H)),
                [("T", torch.int32, (E, H, n13 // 8))],
                [("T", torch.int64, s13)],
                ("T", torch.float32, (r,)),
                ("T", torch.int64, (E,)),
            ],
            [
                ("weight_assist_matrix", [("T", torch.float32, (E, n13))]),
                ("dequant_mode", 1 if per_group else 0),
                ("group_list_type", 1),
                ("swiglu_limit", clamp),
            ],
        ),
        (
            "npu_grouped_matmul",
            [[("T", torch.int8, (r, INTER))], [("T", torch.int32, (E, INTER, H // 8))]],
            [
                ("bias", [("T", torch.float32, (E, H))]),
                ("scale", [("T", torch.int64, s2)]),
                ("per_token_scale", [("T", torch.float32, (r,))]),
                ("group_list", ("T", torch.int64, (E,))),
                ("split_item", 2),
                ("group_type", 0),
                ("group_list_type", 1),
                ("output_dtype", torch.bfloat16),
            ],
        ),
        (
            "npu_moe_token_unpermute",
            [("T", torch.bfloat16, (r, H)), ("T", torch.int32, (r,))],
            [("probs", ("T", torch.bfloat16, (T, K)))],
        ),
    ]
    layer = weights.layer(3)
    _, g1_args, g1_kw = native.calls[1]
    assert g1_args[1][0] is layer.w13 and g1_args[2][0] is layer.w13_scale
    assert g1_kw["weight_assist_matrix"][0] is layer.w13_bias
    assert g1_args[4].tolist() == [3, 2, 3, 2]  # per-expert counts, not cumulative
    _, g2_args, g2_kw = native.calls[2]
    assert g2_args[1][0] is layer.w2 and g2_kw["bias"][0] is layer.w2_bias
    assert g2_kw["scale"][0].data_ptr() == layer.w2_scale.data_ptr()  # a view, never a copy
    assert comp.workspace.zero_bias is None


@pytest.mark.parametrize("clamp", [0.0, 10.0])
@pytest.mark.parametrize("scheme", [QuantScheme.W8A8, QuantScheme.W4A8_PER_CHANNEL])
def test_mega_native_call(clamp: float, scheme: QuantScheme) -> None:
    weights = make_weights(scheme, clamp, rsf=2.0)
    native = RecordingNative(torch.bfloat16)
    mega = MegaCompute(weights, config(weights), AscendBackend(native))
    mega.bind(MegaCommParams(group_name="hccl_ffn_0", world_size=4, rank=1, peer_ranks=(0, 2)))
    x, ids, w = inputs()
    out = mega(8, x, ids, w)
    int4 = scheme.is_int4
    n13 = 2 * INTER
    wdt = torch.int32 if int4 else torch.int8
    bias1 = [("T", torch.float32, (E, n13))] if int4 else []
    bias2 = [("T", torch.float32, (E, H))] if int4 else []
    assert recorded(native) == [
        (
            "dispatch_ffn_combine",
            [
                ("T", torch.bfloat16, (T, H)),
                [("T", wdt, (E, H, n13 // 8 if int4 else n13))],
                [("T", wdt, (E, INTER, H // 8 if int4 else H))],
                ("T", torch.int32, (T, K)),
                [("T", torch.int64, (E, n13))],
                [("T", torch.int64, (E, H))],
                bias1,
                bias2,
                ("T", torch.float32, (T, K)),
                "hccl_ffn_0",
                MAX_T * K * 4,
                ("T", torch.bfloat16, (T, H)),
                ("T", torch.int32, (E,)),
            ],
            [("x_active_mask", None), ("swiglu_limit", clamp)],
        )
    ]
    args = native.calls[0][1]
    layer = weights.layer(8)
    assert args[0] is x and args[1][0] is layer.w13 and args[2][0] is layer.w2
    if int4:
        assert args[4][0] is layer.w13_scale and args[6][0] is layer.w13_bias
    else:
        # fp32 bits, zero-extended to int64, prepared once.
        assert torch.equal(args[4][0], layer.w13_scale.view(torch.int32).long() & 0xFFFFFFFF)
        assert args[4][0] is mega._prepared[8].scale1  # type: ignore[attr-defined]
    assert args[11].data_ptr() == mega.workspace.out.data_ptr()
    assert args[12] is mega.workspace.expert_token_nums
    assert torch.equal(out, torch.full((T, H), 3.0, dtype=torch.bfloat16))
    assert mega.workspace.zero_bias is None


def test_mega_rejects_per_group_and_fp32_on_ascend() -> None:
    pg = make_weights(QuantScheme.W4A8_PER_GROUP, 0.0)
    with pytest.raises(ComputeConfigError) as info:
        MegaCompute(pg, config(pg), AscendBackend(RecordingNative(torch.bfloat16)))
    assert info.value.field == "backend" and "per-group" in info.value.allowed
    w8 = make_weights(QuantScheme.W8A8, 0.0)
    with pytest.raises(ComputeConfigError) as info:
        LayeredCompute(w8, config(w8, torch.float32), AscendBackend(RecordingNative(torch.float32)))
    assert info.value.field == "backend" and "dtype" in info.value.allowed


def test_native_module_is_loaded_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    had_npu = "torch_npu" in sys.modules
    weights = make_weights(QuantScheme.W8A8, 0.0)
    comp = LayeredCompute(weights, config(weights), AscendBackend())
    assert ("torch_npu" in sys.modules) == had_npu
    if importlib.util.find_spec("torch_npu") is None:
        x, ids, w = inputs()
        with pytest.raises(BackendUnavailableError):
            comp(3, x, ids, w)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(BackendUnavailableError, match="torch_npu"):
        load_ascend_native_ops()


@pytest.mark.npu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scheme", [QuantScheme.W8A8, QuantScheme.W4A8_PER_CHANNEL])
def test_real_npu_layered_matches_reference(scheme: QuantScheme) -> None:
    pytest.importorskip("torch_npu")
    from afd_compute_npu import FP32_TOLERANCE, fp32_dequantized_moe

    weights = make_weights(scheme, 0.0)
    x, ids, w = inputs()
    ref = fp32_dequantized_moe(weights, 3, x, ids, w)
    npu_weights = QuantizedExpertWeights(
        scheme=weights.scheme,
        layers=tuple(
            dataclasses.replace(
                layer,
                **{n: t.to("npu") for n, t in layer.tensors().items() if t is not None},  # type: ignore[arg-type]
            )
            for layer in weights.layers
        ),
    )
    comp = LayeredCompute(npu_weights, config(npu_weights), AscendBackend())
    out = comp(3, x.to("npu"), ids.to("npu"), w.to("npu")).cpu().float()
    assert (out - ref).abs().max() <= FP32_TOLERANCE * ref.abs().max()
