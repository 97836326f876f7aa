"""Plain-PyTorch reference of the Ascend quantized MoE expert math (CPU and CUDA).

Every step is a pure function of tensors. :func:`reference_moe` composes them; the Layered path
calls the steps one by one, the Mega path calls :func:`reference_moe` once. Both therefore produce
bit-identical results.

Rounding, step by step (``T`` tokens, ``K`` top-k, ``E`` experts, ``H`` hidden, ``I`` intermediate):

1. **Token quantization** (:func:`dynamic_quant_int8`), per row, symmetric, in fp32:
   ``amax = max|x|``; ``inv = fp32(127 / amax)``; ``q = clamp(rint(fp32(x * inv)), -127, 127)``
   with round-half-even; ``scale = fp32(1 / inv)``. Both quotients are true divisions correctly
   rounded to fp32 (formed in float64 and cast, which rounds correctly for fp32 operands; not
   PyTorch's ``127.0 / t`` = ``t.reciprocal() * 127``, which rounds twice). A row with
   ``amax == 0`` gets ``q = 0, scale = 1``; every other row has a code of ±127, so a row's codes
   are all zero iff the row is all zero (a padding row).
   (The CANN DynamicQuant plain kernel; its double-buffer variant may differ by 1 ulp in ``scale``.)
2. **Routing** (:func:`route`): a stable sort of the flattened ``topk_ids``; expanded row ``i`` is
   flat entry ``order[i]`` (token ``order[i] // K``); ``expanded_row_idx[order[i]] = i``; per-expert
   counts by ``bincount``.
3. **GEMM1** per expert: exact int32 accumulation (:func:`int_gemm`).
   W8A8: ``h = fp32(fp32(acc * s_x) * s_w)``.
   W4A8 (the MSD split the int4 kernels use): ``q = 16*q_hi + q_lo + 8`` with
   ``q_hi = floor(q / 16)``, ``q_lo = (q & 15) - 8``; ``C_* = fp32(sum q_* W) * s_w`` (per group,
   summed over groups in ascending order, when per-group); ``h = (16*C_hi + C_lo + B) * s_x``.
   The NPU rounds ``C_*`` to fp16 in the fixpipe; the reference keeps fp32 (documented deviation).
   A row with all-zero codes gives ``h = 0`` exactly in every scheme (W8A8: ``acc = 0``; W4A8:
   ``16*C_hi + C_lo + B`` is set to 0, dropping the fp32 residue of ``C_lo + B`` that the split
   leaves when ``q_lo = -8``). Such a row then stays exactly 0 through steps 4-8.
4. **Clamp and SwiGLU** in fp32: gate ``g = h[:, :I]``, up ``u = h[:, I:]``; when ``L > 0``:
   ``g = min(g, L)``, ``u = clamp(u, -L, L)``; ``a = g / (1 + exp(-g)) * u``.
5. **Requantization**: :func:`dynamic_quant_int8` of ``a`` (the fused NPU kernels round through
   fp16 first, so ``q_a`` may differ from the device by 1 on rare elements).
6. **GEMM2**: W8A8 ``y = out_dtype(fp32(acc2 * s2) * s_a)``; W4A8
   ``y = out_dtype((16*D_hi + D_lo + B2) * s_a)`` (0 for all-zero code rows, as in step 3); the
   cast rounds to nearest even.
7. **Combine**: ``p = fp32(out_dtype(topk_weights))``; ``acc = y_0 * p_0``, then
   ``acc += y_k * p_k``
   for ``k = 1..K-1`` in order, skipping ``p == 0``; cast to ``out_dtype``.
8. **Routed scaling**: when ``factor != 1`` the ``out_dtype`` result is multiplied in place
   (``out_dtype(out * factor)``).
"""

from __future__ import annotations

import torch
from afd_weights import LayerCodes

__all__ = [
    "combine",
    "dynamic_quant_int8",
    "expert_gemm1_swiglu_quant",
    "expert_gemm2",
    "int_gemm",
    "reference_moe",
    "route",
    "swiglu",
]


def _fp32_quotient(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """``fp32(numerator / denominator)``, correctly rounded, for an fp32 ``denominator``.

    PyTorch evaluates ``scalar / tensor`` as ``tensor.reciprocal() * scalar``: for ``127 / amax``
    that is two roundings, 1 ulp off on about a quarter of the values (for ``1 / inv`` the
    reciprocal is a single rounding already; both go through here for uniformity). Here the true
    quotient is formed in float64 (a tensor / tensor division, correctly rounded) and cast to
    fp32. For fp32 operands (``numerator`` is 127 or 1, exact) that double rounding is innocuous:
    the float64 quotient rounded to fp32 is the correctly rounded fp32 quotient, because float64's
    53 significand bits >= 2 * 24 + 2.
    """
    d = denominator.double()
    return (torch.full_like(d, numerator) / d).float()


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric dynamic int8 quantization: ``(codes int8 [R, C], scale fp32 [R])``.

    ``inv = fp32(127 / amax)`` and ``scale = fp32(1 / inv)`` are correctly rounded divisions (see
    :func:`_fp32_quotient`); a row with ``amax == 0`` gets codes 0 and scale 1.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
    nonzero = amax > 0
    inv = torch.where(nonzero, _fp32_quotient(127.0, torch.where(nonzero, amax, 1.0)), 0.0)
    q = torch.clamp(torch.round(xf * inv.unsqueeze(-1)), -127, 127).to(torch.int8)
    scale = torch.where(nonzero, _fp32_quotient(1.0, torch.where(nonzero, inv, 1.0)), 1.0)
    return q, scale


def route(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable expert-major permutation of the ``T*K`` (token, slot) pairs.

    Returns ``(order, expanded_row_idx, counts)``: ``order[i]`` is the flat (token*K + slot) index
    of expanded row ``i``; ``expanded_row_idx[f]`` is the expanded row of flat index ``f``;
    ``counts`` int64 ``[E]`` rows per expert.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    _, order = torch.sort(flat, stable=True)
    expanded_row_idx = torch.empty_like(order)
    expanded_row_idx[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, expanded_row_idx, counts


def int_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 -> int32 matrix product ``[M, K] @ [K, N]``.

    CPU uses ``torch._int_mm``. Elsewhere (CUDA, whose ``_int_mm`` needs M > 16 and 8-aligned
    sizes) the product runs in float64, which is exact while ``K * 127 * 127 < 2**53``.
    """
    if a.device.type == "cpu":
        return torch._int_mm(a, b)
    return _int_gemm_float64(a, b)


def _int_gemm_float64(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() @ b.double()).to(torch.int32)


def _split_hi_lo(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q16 = q.to(torch.int16)
    hi = torch.div(q16, 16, rounding_mode="floor").to(torch.int8)
    lo = ((q16 & 15) - 8).to(torch.int8)
    return hi, lo


def _int4_dequant(
    q: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``16*C_hi + C_lo + B`` for rows ``q`` [r, K] against int4 codes [K, N], scale [G, N].

    A row whose codes are all zero gives exactly 0 (its product ``q W`` is exactly 0; the split
    would leave the fp32 residue of ``C_lo + B``, since ``q_lo = -8`` there).
    """
    hi, lo = _split_hi_lo(q)
    groups = scale.shape[0]
    gsize = codes.shape[0] // groups
    c_hi = torch.zeros(q.shape[0], codes.shape[1], dtype=torch.float32, device=q.device)
    c_lo = torch.zeros_like(c_hi)
    for g in range(groups):
        sl = slice(g * gsize, (g + 1) * gsize)
        w = codes[sl]
        c_hi = c_hi + int_gemm(hi[:, sl].contiguous(), w).float() * scale[g]
        c_lo = c_lo + int_gemm(lo[:, sl].contiguous(), w).float() * scale[g]
    d = 16.0 * c_hi + c_lo + bias
    zero_rows = ~q.any(dim=-1, keepdim=True)
    return torch.where(zero_rows, 0.0, d)


def swiglu(h: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Clamped SwiGLU over ``[gate | up]`` halves in fp32 (see module docstring step 4)."""
    inter = h.shape[-1] // 2
    g = h[:, :inter]
    u = h[:, inter:]
    if swiglu_limit > 0:
        g = torch.clamp(g, max=swiglu_limit)
        u = torch.clamp(u, -swiglu_limit, swiglu_limit)
    return g / (1.0 + torch.exp(-g)) * u


def expert_gemm1_swiglu_quant(
    q_x: torch.Tensor,
    s_x: torch.Tensor,
    expert: int,
    codes: LayerCodes,
    int4: bool,
    swiglu_limit: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 + dequant + clamp/SwiGLU + requant for the rows of one expert."""
    w = codes.w13_codes[expert]
    if int4:
        assert codes.w13_bias is not None
        h = _int4_dequant(q_x, w, codes.w13_scale[expert], codes.w13_bias[expert])
        h = h * s_x.unsqueeze(-1)
    else:
        acc = int_gemm(q_x, w).float()
        h = (acc * s_x.unsqueeze(-1)) * codes.w13_scale[expert, 0]
    return dynamic_quant_int8(swiglu(h, swiglu_limit))


def expert_gemm2(
    q_a: torch.Tensor,
    s_a: torch.Tensor,
    expert: int,
    codes: LayerCodes,
    int4: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """GEMM2 + dequant for the rows of one expert, rounded to ``out_dtype``."""
    w = codes.w2_codes[expert]
    if int4:
        assert codes.w2_bias is not None
        d = _int4_dequant(q_a, w, codes.w2_scale[expert], codes.w2_bias[expert])
        y = d * s_a.unsqueeze(-1)
    else:
        acc = int_gemm(q_a, w).float()
        y = (acc * codes.w2_scale[expert, 0]) * s_a.unsqueeze(-1)
    return y.to(out_dtype)


def combine(
    expert_out: torch.Tensor,
    expanded_row_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Weighted sum of each token's expert rows in slot order (module docstring step 7)."""
    t, k = topk_weights.shape
    p = topk_weights.to(out_dtype).float()
    rows = expanded_row_idx.reshape(t, k)
    acc = torch.zeros(t, expert_out.shape[1], dtype=torch.float32, device=expert_out.device)
    for slot in range(k):
        pk = p[:, slot : slot + 1]
        term = torch.where(pk != 0, expert_out.index_select(0, rows[:, slot]).float() * pk, 0.0)
        acc = term if slot == 0 else acc + term
    return acc.to(out_dtype)


def run_experts(
    q_rows: torch.Tensor,
    s_rows: torch.Tensor,
    counts: torch.Tensor,
    codes: LayerCodes,
    int4: bool,
    swiglu_limit: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Both GEMMs for expert-sorted rows; ``counts`` gives the rows of each expert in order."""
    out = torch.empty(
        q_rows.shape[0], codes.w2_codes.shape[-1], dtype=out_dtype, device=q_rows.device
    )
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        sl = slice(start, start + n)
        q_a, s_a = expert_gemm1_swiglu_quant(
            q_rows[sl], s_rows[sl], expert, codes, int4, swiglu_limit
        )
        out[sl] = expert_gemm2(q_a, s_a, expert, codes, int4, out_dtype)
        start += n
    return out


def reference_moe(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    codes: LayerCodes,
    int4: bool,
    swiglu_limit: float,
    routed_scaling_factor: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The whole routed-expert FFN for one layer: ``[T, H]`` in ``out_dtype`` (steps 1-8)."""
    k = topk_ids.shape[1]
    q_x, s_x = dynamic_quant_int8(hidden_states)
    order, expanded_row_idx, counts = route(topk_ids, codes.w13_codes.shape[0])
    src = torch.div(order, k, rounding_mode="floor")
    y = run_experts(
        q_x.index_select(0, src),
        s_x.index_select(0, src),
        counts,
        codes,
        int4,
        swiglu_limit,
        out_dtype,
    )
    out = combine(y, expanded_row_idx, topk_weights, out_dtype)
    if routed_scaling_factor != 1.0:
        out = out * routed_scaling_factor
    return out
