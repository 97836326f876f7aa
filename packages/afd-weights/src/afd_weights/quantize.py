"""Symmetric weight quantizers (float -> integer codes + fp32 scales) and the int4 scale bias.

All functions take weights in vLLM's ``[E, N_out, K_in]`` layout and quantize along ``K_in``.

Rounding (documented, deterministic):

* ``scale = amax / qmax`` in fp32, where ``amax`` is the max ``|w|`` of the channel (or group) and
  ``qmax`` is 127 for int8 and 7 for int4. An all-zero channel gets ``scale = 1.0`` (codes 0).
* If the scale is stored in a narrower dtype (bf16 for W8A8 ``w2_scale``, fp16-representable values
  for per-group int4), it is rounded first and the codes are computed with the rounded value, so
  ``codes * stored_scale`` is the dequantized weight.
* ``code = clamp(round_half_even(w / scale), qmin, qmax)`` with ``qmin = -127`` (int8) or ``-8``.
"""

from __future__ import annotations

import torch

from afd_weights.errors import QuantizationError

__all__ = [
    "int4_scale_bias",
    "quantize_int4_per_channel",
    "quantize_int4_per_group",
    "quantize_int8_per_channel",
]


def _check_weight(w: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(w, torch.Tensor):
        raise QuantizationError(name, type(w).__name__, "a torch.Tensor")
    if not w.is_floating_point():
        raise QuantizationError(f"{name}.dtype", w.dtype, "a floating dtype (bf16, fp16, fp32)")
    if w.dim() != 3:
        raise QuantizationError(f"{name}.shape", tuple(w.shape), "[E, N_out, K_in]")
    if w.numel() and not bool(torch.isfinite(w).all()):
        raise QuantizationError(name, "non-finite values", "finite values")


def _scale_from_amax(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    scale = amax / qmax
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _codes(w: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    return torch.clamp(torch.round(w / scale), qmin, qmax).to(torch.int8)


def quantize_int8_per_channel(
    weight: torch.Tensor, *, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[E, N, K]`` to int8 codes ``[E, N, K]`` and scales ``[E, N]`` of ``scale_dtype``.

    ``scale_dtype`` is ``torch.float32`` or ``torch.bfloat16``.
    """
    _check_weight(weight)
    if scale_dtype not in (torch.float32, torch.bfloat16):
        raise QuantizationError("scale_dtype", scale_dtype, "torch.float32 or torch.bfloat16")
    w = weight.float()
    scale = _scale_from_amax(w.abs().amax(dim=-1), 127).to(scale_dtype)
    codes = _codes(w, scale.float().unsqueeze(-1), -127, 127)
    return codes, scale


def quantize_int4_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[E, N, K]`` to int4 codes (int8 storage, ``[-8, 7]``), fp32 scales ``[E, N]``."""
    _check_weight(weight)
    w = weight.float()
    scale = _scale_from_amax(w.abs().amax(dim=-1), 7)
    return _codes(w, scale.unsqueeze(-1), -8, 7), scale


def quantize_int4_per_group(
    weight: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[E, N, K]`` with one scale per ``group_size`` inputs of each output channel.

    Returns int4 codes ``[E, N, K]`` and fp32 scales ``[E, N, K // group_size]``. Each scale is
    rounded through fp16 (the precision the per-group int4 kernels' scale encoding carries).
    """
    _check_weight(weight)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise QuantizationError("group_size", group_size, "a positive int")
    e, n, k = weight.shape
    if k % group_size != 0:
        raise QuantizationError("group_size", group_size, f"a divisor of K_in={k}")
    w = weight.float().reshape(e, n, k // group_size, group_size)
    amax = w.abs().amax(dim=-1)
    scale = _scale_from_amax(amax, 7).to(torch.float16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # fp16 underflow guard
    codes = _codes(w, scale.unsqueeze(-1), -8, 7).reshape(e, n, k)
    return codes, scale


def int4_scale_bias(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The W4A8 kernels' ``scale_bias``: ``B[e, n] = 8 * sum_k codes[e, n, k] * s[e, n, g(k)]``.

    Args:
        codes: int4 codes ``[E, N, K]`` (int8 storage).
        scale: fp32 ``[E, N]`` (per channel) or ``[E, N, K // G]`` (per group).

    Returns:
        fp32 ``[E, N]``, computed as ``8 * (codes.float() * s).sum(-1)`` in fp32.
    """
    if codes.dtype != torch.int8 or codes.dim() != 3:
        raise QuantizationError("codes", (codes.dtype, tuple(codes.shape)), "int8 [E, N, K]")
    if scale.dtype != torch.float32:
        raise QuantizationError("scale.dtype", scale.dtype, "torch.float32")
    e, n, k = codes.shape
    if scale.dim() == 2 and tuple(scale.shape) == (e, n):
        s = scale.unsqueeze(-1)
    elif (
        scale.dim() == 3
        and scale.shape[:2] == (e, n)
        and scale.shape[2]
        and k % scale.shape[2] == 0
    ):
        s = scale.repeat_interleave(k // scale.shape[2], dim=-1)
    else:
        raise QuantizationError("scale.shape", tuple(scale.shape), f"[{e}, {n}] or [{e}, {n}, G]")
    return 8.0 * (codes.float() * s).sum(dim=-1)
