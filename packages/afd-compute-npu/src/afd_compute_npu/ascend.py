"""The Ascend backend: exact native calls of torch_npu and the vLLM-Ascend custom ops.

``torch_npu`` is imported lazily (only by :func:`load_ascend_native_ops`); tests pass any object
with the same op names. Weights are handed to the ops as the contract's tensors (references; the
FRACTAL_NZ cast, when wanted, is the loader's job on device).

Documented call sequences (``T`` tokens, ``K`` top-k, ``E`` experts, ``L`` = swiglu_limit with 0.0
meaning off, ``dt`` = compute dtype). Positional arguments are listed first, then keywords in the
order they are passed.

Layered, every scheme, step 1 (quantize + route)::

    npu_moe_init_routing_v2(x[T,H] dt, topk_ids[T,K] int32, active_num=T*K, expert_num=E,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, E],
        quant_mode=1, row_idx_type=0)
      -> (expanded_x int8 [T*K,H], expanded_row_idx int32 [T*K], counts int64 [E], scale fp32 [T*K])

Layered W8A8 step 2 (GEMM1 + SwiGLU + quant; cumulative group list, no bias)::

    grouped_matmul_swiglu_quant_weight_nz(expanded_x, w13 int8 [E,H,2I], w13_scale fp32 [E,2I],
        scale, group_list int64 [E] (cumsum), bias=None, swiglu_limit=L) -> (q_a int8, s_a fp32, _)

Layered W4A8 step 2 (``dequant_mode`` 0 per-channel, 1 per-group)::

    grouped_matmul_swiglu_quant_v2(expanded_x, [w13 int32], [w13_scale int64], scale, counts,
        weight_assist_matrix=[w13_bias fp32 [E,2I]], dequant_mode=0|1, group_list_type=1,
        swiglu_limit=L) -> (q_a int8, s_a fp32)

Layered step 3 (GEMM2; W8A8 bias = the workspace's int32 zero bias ``[E,H]``, W4A8 bias =
w2_bias fp32; a per-channel W4A8 scale is passed as the ``[E,1,H]`` view)::

    npu_grouped_matmul([q_a], [w2], bias=[bias], scale=[w2_scale], per_token_scale=[s_a],
        group_list=counts, split_item=2, group_type=0, group_list_type=1, output_dtype=dt) -> [y]

Layered step 4 (combine with router weights cast to ``dt``)::

    npu_moe_token_unpermute(y, expanded_row_idx, probs=topk_weights[T,K] dt) -> [T,H] dt

Mega, W8A8 and W4A8 per-channel (no per-group: the fused kernel has none). W8A8 scales are
encoded to int64 fp32 bits once at preparation; W8A8 passes **empty** bias lists::

    dispatch_ffn_combine(x, [w13], [w2], topk_ids int32, [scale1 int64 [E,2I]],
        [scale2 int64 [E,H]], bias1 ([] | [w13_bias]), bias2 ([] | [w2_bias]),
        probs fp32 [T,K], group_name, max_output_size, out[T,H] dt, expert_token_nums int32 [E],
        x_active_mask=None, swiglu_limit=L)

with ``max_output_size = max_tokens * top_k * world_size``; ``topk_ids`` are global over the group
(expert ``e`` on group rank ``e // E_local``). A rank with no tokens of its own still calls it
(a collective): with one zero row and ``x_active_mask = [False]``. Both paths multiply the
``[T, H]`` result in place by ``routed_scaling_factor`` when it is not 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from afd_weights import ExpertLayerTensors, QuantizedExpertWeights, QuantScheme, encode_scale_int64

from afd_compute_npu.backend import ComputeBackend, ComputeKind
from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.errors import BackendUnavailableError
from afd_compute_npu.workspace import ComputeWorkspace

__all__ = [
    "ASCEND_DTYPES",
    "AscendBackend",
    "AscendNativeOps",
    "MegaLayerArgs",
    "load_ascend_native_ops",
]

ASCEND_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)


class AscendNativeOps(Protocol):
    """The native callables the Ascend backend uses (attribute names are the op names)."""

    @property
    def npu_moe_init_routing_v2(self) -> Callable[..., Any]: ...

    @property
    def grouped_matmul_swiglu_quant_weight_nz(self) -> Callable[..., Any]: ...

    @property
    def grouped_matmul_swiglu_quant_v2(self) -> Callable[..., Any]: ...

    @property
    def npu_grouped_matmul(self) -> Callable[..., Any]: ...

    @property
    def npu_moe_token_unpermute(self) -> Callable[..., Any]: ...

    @property
    def dispatch_ffn_combine(self) -> Callable[..., Any]: ...


@dataclass
class _NativeOps:
    npu_moe_init_routing_v2: Any
    grouped_matmul_swiglu_quant_weight_nz: Any
    grouped_matmul_swiglu_quant_v2: Any
    npu_grouped_matmul: Any
    npu_moe_token_unpermute: Any
    dispatch_ffn_combine: Any


def load_ascend_native_ops() -> AscendNativeOps:
    """Import torch_npu and resolve the vLLM-Ascend custom ops (``torch.ops._C_ascend``)."""
    try:
        import torch_npu
    except ImportError as exc:
        raise BackendUnavailableError(
            "torch_npu is not importable; install afd-compute-npu[ascend] on an Ascend host"
        ) from exc
    try:
        custom = torch.ops._C_ascend
        return _NativeOps(
            npu_moe_init_routing_v2=torch_npu.npu_moe_init_routing_v2,
            grouped_matmul_swiglu_quant_weight_nz=custom.grouped_matmul_swiglu_quant_weight_nz,
            grouped_matmul_swiglu_quant_v2=custom.grouped_matmul_swiglu_quant_v2,
            npu_grouped_matmul=torch_npu.npu_grouped_matmul,
            npu_moe_token_unpermute=torch_npu.npu_moe_token_unpermute,
            dispatch_ffn_combine=custom.dispatch_ffn_combine,
        )
    except (AttributeError, RuntimeError) as exc:
        raise BackendUnavailableError(f"vLLM-Ascend custom ops are not registered: {exc}") from exc


@dataclass(frozen=True, eq=False)
class MegaLayerArgs:
    """The per-layer native arguments Mega owns (int64 scales, bias lists)."""

    w13: torch.Tensor
    w2: torch.Tensor
    scale1: torch.Tensor
    scale2: torch.Tensor
    bias1: tuple[torch.Tensor, ...]
    bias2: tuple[torch.Tensor, ...]


class AscendBackend(ComputeBackend):
    """Native Ascend compute. ``native`` defaults to :func:`load_ascend_native_ops` (lazy)."""

    name = "ascend"

    def __init__(self, native: AscendNativeOps | None = None) -> None:
        self._native = native

    @property
    def native(self) -> AscendNativeOps:
        """The native op namespace, loaded on first use."""
        if self._native is None:
            self._native = load_ascend_native_ops()
        return self._native

    def unsupported_reason(
        self, kind: ComputeKind, weights: QuantizedExpertWeights, config: ComputeConfig
    ) -> str | None:
        if config.dtype not in ASCEND_DTYPES:
            return f"dtype={config.dtype} is not one of {ASCEND_DTYPES}"
        if kind == "mega" and weights.scheme is QuantScheme.W4A8_PER_GROUP:
            return "the fused Mega kernel has no per-group W4A8 (use w8a8 or w4a8_per_channel)"
        for name, t in weights.layers[0].tensors().items():
            if name in ("w13", "w2") and t is not None and not t.is_contiguous():
                return f"{name} must be contiguous for the native grouped matmuls"
        return None

    def prepare(self, kind: ComputeKind, weights: QuantizedExpertWeights) -> Mapping[int, object]:
        if kind == "layered":
            return {layer.layer_id: layer for layer in weights.layers}
        return {layer.layer_id: self._mega_args(weights.scheme, layer) for layer in weights.layers}

    @staticmethod
    def _mega_args(scheme: QuantScheme, layer: ExpertLayerTensors) -> MegaLayerArgs:
        if scheme is QuantScheme.W8A8:
            return MegaLayerArgs(
                w13=layer.w13,
                w2=layer.w2,
                scale1=encode_scale_int64(layer.w13_scale.float()),
                scale2=encode_scale_int64(layer.w2_scale.float()),
                bias1=(),
                bias2=(),
            )
        assert layer.w13_bias is not None and layer.w2_bias is not None
        return MegaLayerArgs(
            w13=layer.w13,
            w2=layer.w2,
            scale1=layer.w13_scale,
            scale2=layer.w2_scale,
            bias1=(layer.w13_bias,),
            bias2=(layer.w2_bias,),
        )

    def run_layered(
        self,
        layer_args: object,
        weights: QuantizedExpertWeights,
        ws: ComputeWorkspace,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        assert isinstance(layer_args, ExpertLayerTensors)
        layer = layer_args
        ops = self.native
        t, k = topk_ids.shape
        e = weights.geometry.num_experts
        ids = ws.topk_ids[:t]
        ids.copy_(topk_ids)
        probs = ws.topk_weights[:t]
        probs.copy_(topk_weights)
        limit = float(weights.swiglu_limit)
        expanded_x, expanded_row_idx, counts, x_scale = ops.npu_moe_init_routing_v2(
            hidden_states,
            ids,
            active_num=t * k,
            expert_num=e,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[0, e],
            quant_mode=1,
            row_idx_type=0,
        )
        scheme = weights.scheme
        if scheme is QuantScheme.W8A8:
            torch.cumsum(counts, 0, out=ws.group_list)
            q_a, s_a, _ = ops.grouped_matmul_swiglu_quant_weight_nz(
                expanded_x,
                layer.w13,
                layer.w13_scale,
                x_scale,
                ws.group_list,
                bias=None,
                swiglu_limit=limit,
            )
            assert ws.zero_bias is not None
            bias = ws.zero_bias
            w2_scale = layer.w2_scale
        else:
            assert layer.w13_bias is not None and layer.w2_bias is not None
            q_a, s_a = ops.grouped_matmul_swiglu_quant_v2(
                expanded_x,
                [layer.w13],
                [layer.w13_scale],
                x_scale,
                counts,
                weight_assist_matrix=[layer.w13_bias],
                dequant_mode=1 if scheme.is_per_group else 0,
                group_list_type=1,
                swiglu_limit=limit,
            )
            bias = layer.w2_bias
            w2_scale = layer.w2_scale if scheme.is_per_group else layer.w2_scale.unsqueeze(1)
        (y,) = ops.npu_grouped_matmul(
            [q_a],
            [layer.w2],
            bias=[bias],
            scale=[w2_scale],
            per_token_scale=[s_a],
            group_list=counts,
            split_item=2,
            group_type=0,
            group_list_type=1,
            output_dtype=ws.out.dtype,
        )
        combined = ops.npu_moe_token_unpermute(y, expanded_row_idx, probs=probs)
        out = ws.out[:t]
        out.copy_(combined)
        if weights.routed_scaling_factor != 1.0:
            out.mul_(weights.routed_scaling_factor)

    def run_mega(
        self,
        layer_args: object,
        weights: QuantizedExpertWeights,
        ws: ComputeWorkspace,
        comm: MegaCommParams,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> None:
        assert isinstance(layer_args, MegaLayerArgs)
        a = layer_args
        t, k = topk_ids.shape
        active = None
        if t == 0:
            # A rank with no tokens still joins the group's dispatch and combine: one zero row,
            # marked inactive (as afd-plugin clamps an idle peer to one token).
            t = 1
            hidden_states = torch.zeros_like(ws.out[:1])
            topk_ids = torch.zeros(1, k, dtype=torch.int32, device=hidden_states.device)
            topk_weights = torch.zeros(1, k, dtype=torch.float32, device=hidden_states.device)
            active = torch.zeros(1, dtype=torch.bool, device=hidden_states.device)
        ids = ws.topk_ids[:t]
        ids.copy_(topk_ids)
        probs = ws.topk_weights[:t]
        probs.copy_(topk_weights)
        out = ws.out[:t]
        max_output_size = ws.out.shape[0] * k * comm.world_size
        self.native.dispatch_ffn_combine(
            hidden_states,
            [a.w13],
            [a.w2],
            ids,
            [a.scale1],
            [a.scale2],
            list(a.bias1),
            list(a.bias2),
            probs,
            comm.group_name,
            max_output_size,
            out,
            ws.expert_token_nums,
            x_active_mask=active,
            swiglu_limit=float(weights.swiglu_limit),
        )
        if weights.routed_scaling_factor != 1.0:
            out.mul_(weights.routed_scaling_factor)
