"""Per-layer, per-step cost terms of one decode step (one device each).

Every compute term is a roofline: ``t = max(bytes / bandwidth, flops / flop_rate) +
layer_overhead`` with the profile's effective rates (peak x efficiency), and says which side
bound it; with the profile's ``compute_overlaps_memory`` false (one CPU core) the two sides
add. Every transfer term is ``messages * message_overhead + link_latency + bytes /
link_rate``. Symbols: ``H`` hidden size, ``k`` top-k, ``E`` routed experts, ``b`` tokens (decode
sequences) of one micro-batch on one Attention rank, ``A`` / ``F`` Attention / FFN ranks.

* :func:`attention_time`: one layer's attention on an Attention rank at ``b`` sequences and
  context ``c``: reads the attention weights once and each sequence's KV cache (MLA: the
  compressed latent of the attended tokens; DSA: also the indexer keys of all ``c`` tokens);
  FLOPs ``b * flops_per_token(c)`` (:meth:`AttentionShape.flops_per_token`).
* :func:`mlp_time`: a dense MLP or the shared experts on the Attention side at ``b`` tokens.
* :func:`expert_time`: the routed experts of one FFN rank (or one colocated EP rank) serving
  ``n`` tokens: token-expert pairs ``p = n * k / R * skew`` over ``R`` ranks; experts hit
  (weights read) ``uniform: E_loc * (1 - (1 - k/E)^n)``, ``balanced: min(E_loc, p)``;
  bytes ``hit * 3 * H * I * wbytes``, FLOPs ``p * 2 * 3 * H * I``.
* :func:`fanout`: FFN ranks one token reaches: ``R * (1 - (1 - 1/R)^k)`` (its ``k`` experts
  fall on independent, uniformly placed ranks).
* :func:`transfer_time`: one direction of one layer's exchange, the slower of the two ends:
  an Attention rank sends ``b * fanout * H * act_bytes`` in ``F`` messages; an FFN rank
  receives ``A * b * fanout / F * H * act_bytes`` in ``A`` messages (their software:
  :func:`message_costs`). The reply is the same size (a partial sum per token and FFN rank).
* :func:`lm_head_time`: the LM head once per step on the Attention side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from afd_plan.hardware import HardwareProfile
from afd_plan.shape import AttentionShape, ModelShape
from afd_plan.workload import Workload, gemm_dtype, weight_bytes

__all__ = [
    "Term",
    "all_to_all_time",
    "attention_time",
    "expert_time",
    "experts_hit",
    "fanout",
    "lm_head_time",
    "message_costs",
    "mlp_time",
    "roofline",
    "transfer_time",
]


@dataclass(frozen=True)
class Term:
    """One cost term: seconds, the bytes and FLOPs (compute) or bytes (transfer) behind it, and
    what bound it (``"memory"``, ``"compute"`` or ``"link"``)."""

    seconds: float
    bytes: float
    flops: float
    bound: str

    def __add__(self, other: Term) -> Term:
        bound = self.bound if self.seconds >= other.seconds else other.bound
        return Term(
            self.seconds + other.seconds, self.bytes + other.bytes, self.flops + other.flops, bound
        )


ZERO = Term(0.0, 0.0, 0.0, "memory")


def roofline(
    nbytes: float, flops: float, hw: HardwareProfile, dtype: str, kv_bytes: float = 0.0
) -> Term:
    """``max(nbytes / bandwidth + kv_bytes / kv_bandwidth, flops / flop_rate(dtype)) +
    layer_overhead`` (the sum of the two instead of their max when the profile's
    ``compute_overlaps_memory`` is false); ``bytes`` of the term counts both."""
    t_mem = nbytes / hw.bandwidth + kv_bytes / hw.kv_bandwidth
    t_flop = flops / hw.flops(dtype)
    bound = "compute" if t_flop > t_mem else "memory"
    t = max(t_mem, t_flop) if hw.compute_overlaps_memory else t_mem + t_flop
    return Term(t + hw.layer_overhead, nbytes + kv_bytes, flops, bound)


def attention_time(
    shape: ModelShape,
    work: Workload,
    hw: HardwareProfile,
    batch: float,
    context: float,
    att: AttentionShape | None = None,
) -> Term:
    """One layer's attention (projections + core) at ``batch`` sequences of ``context`` tokens;
    ``att`` defaults to the model's (full) attention.

    bytes = attention weights (``dense_quant``) + ``batch * (attended * kv_elems * kv_bytes +
    context * index_bytes + 2 * state_bytes)`` (a linear-attention state is read and written);
    FLOPs = ``batch * flops_per_token(context)``; GEMMs in the dense scheme's dtype (the core
    products run in the same dtype, a simplification).
    """
    if batch <= 0:
        return ZERO
    att = shape.attention if att is None else att
    h = shape.hidden_size
    weights = att.weight_params(h) * weight_bytes(work.dense_quant, shape)
    kv = att.attended_tokens(context) * att.kv_elems_per_token() * work.kv_bytes(shape)
    kv += context * att.index_bytes_per_token() + 2 * att.state_bytes(shape.dtype_bytes)
    flops = batch * att.flops_per_token(h, context)
    return roofline(weights, flops, hw, gemm_dtype(work.dense_quant, shape), kv_bytes=batch * kv)


def mlp_time(
    shape: ModelShape, work: Workload, hw: HardwareProfile, tokens: float, intermediate: int
) -> Term:
    """A gated MLP of ``intermediate`` on the Attention side at ``tokens``: bytes
    ``3 * H * I * wbytes(dense_quant)``, FLOPs ``tokens * 2 * 3 * H * I``; 0 when ``I == 0``."""
    if tokens <= 0 or intermediate == 0:
        return ZERO
    params = 3 * shape.hidden_size * intermediate
    return roofline(
        params * weight_bytes(work.dense_quant, shape),
        tokens * 2.0 * params,
        hw,
        gemm_dtype(work.dense_quant, shape),
    )


def experts_hit(shape: ModelShape, work: Workload, tokens: float, ranks: int) -> float:
    """Expected distinct routed experts (of ``E_loc = ceil(E / ranks)``) that ``tokens`` tokens
    touch on one rank: ``uniform``: ``E_loc * (1 - (1 - k/E)^tokens)``; ``balanced``:
    ``min(E_loc, tokens * k / ranks)`` (each expert receives ``tokens * k / E`` tokens)."""
    e_loc = math.ceil(shape.num_experts / ranks)
    if tokens <= 0:
        return 0.0
    if work.routing == "balanced":
        return min(float(e_loc), tokens * shape.top_k / ranks * work.expert_skew)
    return e_loc * (1.0 - (1.0 - shape.top_k / shape.num_experts) ** tokens)


def expert_time(
    shape: ModelShape,
    work: Workload,
    hw: HardwareProfile,
    tokens: float,
    ranks: int,
    expert_quant: str,
) -> Term:
    """The routed experts of the busiest of ``ranks`` ranks that together serve ``tokens``
    tokens (pairs ``tokens * k / ranks * expert_skew``; weights of :func:`experts_hit`)."""
    if tokens <= 0:
        return ZERO
    pairs = tokens * shape.top_k / ranks * work.expert_skew
    nbytes = experts_hit(shape, work, tokens, ranks) * shape.expert_params()
    nbytes *= weight_bytes(expert_quant, shape)
    flops = pairs * 2.0 * shape.expert_params()
    return roofline(nbytes, flops, hw, gemm_dtype(expert_quant, shape))


def fanout(shape: ModelShape, ranks: int) -> float:
    """Expected distinct ranks a token's ``k`` experts fall on: ``R * (1 - (1 - 1/R)^k)``."""
    return ranks * (1.0 - (1.0 - 1.0 / ranks) ** shape.top_k)


def transfer_time(
    shape: ModelShape, hw: HardwareProfile, batch: float, num_attention: int, num_ffn: int
) -> Term:
    """One direction of one MoE layer's Attention<->FFN exchange for a micro-batch of ``batch``
    tokens per Attention rank (formula in the module docstring); activations in the model's
    dtype. ``bytes`` is what one Attention rank sends."""
    if batch <= 0:
        return ZERO
    per_token = fanout(shape, num_ffn) * shape.hidden_size * shape.dtype_bytes
    sent = batch * per_token
    received = num_attention * batch * per_token / num_ffn
    m_attn, m_ffn = message_costs(hw, num_attention, num_ffn)
    t_attn_end = m_attn + hw.link_latency + sent / hw.link_rate
    t_ffn_end = m_ffn + hw.link_latency + received / hw.link_rate
    return Term(max(t_attn_end, t_ffn_end), sent, 0.0, "link")


def message_costs(hw: HardwareProfile, num_attention: int, num_ffn: int) -> tuple[float, float]:
    """The message software of one direction of one exchange at the Attention end and at the
    FFN end: one ``message_overhead`` per peer (``F`` and ``A``); with ``messages_use_compute``
    (a CPU host) one per direction, whatever the peers: the messages to (or from) every peer are
    in flight together and what a message costs there is the wake-up of the waiting side, paid
    once (on the calibration host 1 Attention : 2 FFN measured 1.4-1.5x the 1:1 pair, the
    share of a third engine on two cores, not twice the messages)."""
    if hw.messages_use_compute:
        return hw.message_overhead, hw.message_overhead
    return num_ffn * hw.message_overhead, num_attention * hw.message_overhead


def all_to_all_time(shape: ModelShape, hw: HardwareProfile, batch: float, ranks: int) -> Term:
    """One all-to-all (dispatch or combine) of colocated expert parallelism over ``ranks``
    devices, each holding ``batch`` tokens: a token goes to its :func:`fanout` ranks, the share
    ``(R - 1) / R`` of them remote; ``R - 1`` messages per device per all-to-all (0 at R = 1)."""
    if batch <= 0 or ranks == 1:
        return ZERO
    remote = fanout(shape, ranks) * (ranks - 1) / ranks
    sent = batch * remote * shape.hidden_size * shape.dtype_bytes
    t = (ranks - 1) * hw.message_overhead + hw.link_latency + sent / hw.link_rate
    return Term(t, sent, 0.0, "link")


def lm_head_time(shape: ModelShape, hw: HardwareProfile, batch: float) -> Term:
    """The LM head once per step on ``batch`` sequences (model dtype): bytes ``vocab * H *
    dtype_bytes``, FLOPs ``batch * 2 * vocab * H``."""
    params = shape.vocab_size * shape.hidden_size
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[shape.dtype]
    return roofline(params * shape.dtype_bytes, batch * 2.0 * params, hw, dtype)
