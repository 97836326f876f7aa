"""Predictions for one deployment (AFD ``A:F`` with ``S`` stages, or colocated expert
parallelism over ``N`` devices), the memory check, and the search over candidates.

**AFD step time.** Per MoE layer, with ``S`` micro-batches of ``b / S`` sequences per Attention
rank (terms of :mod:`afd_plan.cost` at ``b / S``): ``t_a`` (attention + shared experts),
``t_f`` (the busiest FFN rank's experts for ``A * b / S`` tokens), ``t_c`` (one direction of the
exchange) and ``o = t_c - link_latency`` (how long one direction keeps a link end busy). The
layer's period is the cycle time of a ping-pong pipeline::

    P = max(S * t_a, S * t_f, S * o, t_a + t_f + 2 * t_c)

The first three are the busy time of each resource per period (each of the ``S`` micro-batches
passes each resource once per layer); the last is one micro-batch's own dependency chain
(attention -> send -> experts -> reply), which no schedule can shorten. With the profile's
``messages_use_compute`` (a CPU host: the cores that compute also post and complete the
messages) each role's busy time also holds its own messages both ways, ``S * (t_a + 2 m)``
and ``S * (t_f + 2 m)`` (``m`` = ``message_overhead``: once per direction there, the peers'
messages being in flight together, :func:`~afd_plan.cost.message_costs`), and the link only its
wire time ``S * (o - m)``: stages hide the wire, never the message software. ``S = 1`` gives the
serial sum ``t_a + t_f + 2 t_c``; ``S >= 2`` hides transfers and the other role's compute only
while the chain fits in the busiest resource's time (MegaScale-Infer's condition). Splitting is
not free: each micro-batch re-reads the weights, so a weight-bound ``t_f(b/S)`` is about
``t_f(b)`` and ``S * t_f`` grows with ``S``.

Dense layers run attention + MLP on the Attention rank: ``S * (t_a + t_mlp)`` at ``b / S``; the
LM head ``S * t_head(b / S)``. ``TPOT = L_dense * dense + L_moe * P + head + engine``, each
layer priced with its own attention (Qwen3.5-MoE mixes full and linear attention layers).

**Colocated baseline** (``N`` devices, attention data parallel, experts split ``E / N`` per
device, dispatch and combine all-to-all per MoE layer, as vLLM's expert parallelism): per
micro-batch ``c = t_a + t_experts(N * b / S tokens over N ranks)`` and ``m = 2 * t_a2a``;
``P = max(S * c, S * (m - 2 * link_latency), c + m)``.

**Engine software** (profile ``step_overhead``, ``sequence_overhead``; 0 in the shipped GPU/NPU
profiles, measured on a CPU host by ``afd bench --profile``): each decode step of the serving
engine (the Attention rank's, or the colocated device's) costs ``step_overhead + b *
sequence_overhead`` on top of the layers (scheduling, input preparation, sampling, output).

**Shared host** (profile ``host_cores`` > 0: every role's engine on one machine's cores): a
deployment of more engines (``A + F``; colocated ``N``) than cores stretches the whole step by
``1 + oversubscription_cost * (engines - host_cores) / host_cores`` (``engines / host_cores``
with the default cost 1), and the binding reads ``host cores``.

**Throughput.** ``tokens/s = A * b / TPOT`` (colocated ``N * b / TPOT``); per device divide by
``A + F`` (``N``).

**Memory** (per device, at the full context ``input_len + output_len``): Attention rank: the
embeddings and LM head, every layer's attention weights, the dense MLPs and shared experts, the
KV cache ``b * sum over layers (context * (kv_elems * kv_bytes + index_bytes) + state_bytes)``
and buffers (fp32 logits,
send and receive buffers); FFN rank: ``ceil(E / F) * L_moe`` experts and its receive / reply /
intermediate buffers; colocated: both on one device. A role over the profile's usable memory is
refused (:class:`AFDPlanMemoryError`, naming the role and the bytes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from afd_plan.cost import (
    Term,
    all_to_all_time,
    attention_time,
    expert_time,
    fanout,
    lm_head_time,
    message_costs,
    mlp_time,
    transfer_time,
)
from afd_plan.errors import AFDPlanError, AFDPlanMemoryError
from afd_plan.hardware import HardwareProfile
from afd_plan.shape import ModelShape
from afd_plan.workload import QUANT_SCHEMES, Workload, weight_bytes

__all__ = [
    "Candidate",
    "LayerTerms",
    "PlanResult",
    "Prediction",
    "check_memory",
    "memory_per_role",
    "predict",
    "search",
]

MAX_STAGES = 3


@dataclass(frozen=True)
class Candidate:
    """A deployment: ``num_ffn == 0`` is colocated expert parallelism over ``num_attention``
    devices; otherwise AFD ``num_attention : num_ffn``. ``batch`` is sequences per Attention
    (or colocated) rank; ``stages`` in ``1..3``; ``expert_quant`` in :data:`QUANT_SCHEMES`."""

    num_attention: int
    num_ffn: int
    stages: int
    batch: int
    expert_quant: str = "none"

    def __post_init__(self) -> None:
        if self.num_attention < 1:
            raise AFDPlanError("num_attention", self.num_attention, "an integer >= 1")
        if self.num_ffn < 0:
            raise AFDPlanError("num_ffn", self.num_ffn, "an integer >= 0 (0 = colocated)")
        if not 1 <= self.stages <= MAX_STAGES:
            raise AFDPlanError("stages", self.stages, f"1..{MAX_STAGES}")
        if self.batch < 1:
            raise AFDPlanError("batch", self.batch, "an integer >= 1")
        if self.expert_quant not in QUANT_SCHEMES:
            raise AFDPlanError("expert_quant", self.expert_quant, f"one of {QUANT_SCHEMES}")

    @property
    def colocated(self) -> bool:
        return self.num_ffn == 0

    @property
    def devices(self) -> int:
        return self.num_attention + self.num_ffn

    @property
    def label(self) -> str:
        if self.colocated:
            return f"EP{self.num_attention} b={self.batch} S={self.stages} {self.expert_quant}"
        return (
            f"{self.num_attention}A:{self.num_ffn}F b={self.batch} S={self.stages} "
            f"{self.expert_quant}"
        )


@dataclass(frozen=True)
class LayerTerms:
    """One MoE layer's terms for one micro-batch and the resulting period (seconds)."""

    attention: Term
    experts: Term
    transfer: Term
    period: float
    binding: str


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one candidate."""

    candidate: Candidate
    tpot_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    memory: dict[str, dict[str, float]]
    moe_layer: LayerTerms
    binding: str

    def to_json(self) -> dict[str, object]:
        c = self.candidate
        return {
            "kind": "colocated" if c.colocated else "afd",
            "attention_ranks": c.num_attention,
            "ffn_ranks": c.num_ffn,
            "devices": c.devices,
            "stages": c.stages,
            "batch_per_attention_rank": c.batch,
            "expert_quant": c.expert_quant,
            "tpot_ms": self.tpot_s * 1e3,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "memory_bytes": {role: sum(parts.values()) for role, parts in self.memory.items()},
            "memory_breakdown_bytes": self.memory,
            "binding": self.binding,
            "moe_layer_us": {
                "attention": self.moe_layer.attention.seconds * 1e6,
                "experts": self.moe_layer.experts.seconds * 1e6,
                "transfer_each_way": self.moe_layer.transfer.seconds * 1e6,
                "period": self.moe_layer.period * 1e6,
            },
        }


def memory_per_role(
    shape: ModelShape, work: Workload, cand: Candidate
) -> dict[str, dict[str, float]]:
    """Bytes per device by role and part (formulas in the module docstring)."""
    h = shape.hidden_size
    wd = weight_bytes(work.dense_quant, shape)
    we = weight_bytes(cand.expert_quant, shape)
    b = cand.batch
    kv_per_seq = sum(
        n
        * (
            work.max_context
            * (a.kv_elems_per_token() * work.kv_bytes(shape) + a.index_bytes_per_token())
            + a.state_bytes(shape.dtype_bytes)
        )
        for (a, _), n in shape.layer_groups().items()
    )
    peers = cand.num_ffn if not cand.colocated else cand.num_attention
    attention = {
        "embeddings": float(shape.embedding_params() * shape.dtype_bytes),
        "attention_weights": float(shape.attention_params() * wd),
        "dense_mlp_and_shared": float(
            (
                shape.num_dense_layers * shape.dense_mlp_params()
                + shape.num_moe_layers * shape.shared_params()
            )
            * wd
        ),
        "kv_cache": float(b * kv_per_seq),
        "buffers": float(
            b * shape.vocab_size * 4 + 2 * b * fanout(shape, peers) * h * shape.dtype_bytes
        ),
    }
    ranks = cand.num_ffn if not cand.colocated else cand.num_attention
    e_loc = math.ceil(shape.num_experts / ranks)
    tokens = cand.num_attention * b
    experts = {
        "expert_weights": float(e_loc * shape.num_moe_layers * shape.expert_params() * we),
        "buffers": float(
            2 * tokens * fanout(shape, ranks) / ranks * h * shape.dtype_bytes
            + tokens * shape.top_k / ranks * 2 * shape.moe_intermediate_size * shape.dtype_bytes
        ),
    }
    if cand.colocated:
        merged = dict(attention)
        merged["expert_weights"] = experts["expert_weights"]
        merged["buffers"] += experts["buffers"]
        return {"colocated": merged}
    return {"attention": attention, "ffn": experts}


def check_memory(
    shape: ModelShape, work: Workload, hw: HardwareProfile, cand: Candidate
) -> dict[str, dict[str, float]]:
    """:func:`memory_per_role`, or :class:`AFDPlanMemoryError` for the first role over
    ``hw.usable_memory``."""
    memory = memory_per_role(shape, work, cand)
    for role, parts in memory.items():
        needed = sum(parts.values())
        if needed > hw.usable_memory:
            raise AFDPlanMemoryError(
                role, needed, hw.usable_memory, parts, candidate=f"{cand.label} on {hw.name}"
            )
    return memory


def predict(shape: ModelShape, work: Workload, hw: HardwareProfile, cand: Candidate) -> Prediction:
    """The prediction for ``cand`` (raises :class:`AFDPlanMemoryError` if a role does not fit)."""
    memory = check_memory(shape, work, hw, cand)
    s = cand.stages
    mb = cand.batch / s
    dense_mlp = mlp_time(shape, work, hw, mb, shape.dense_intermediate_size)
    tpot = s * lm_head_time(shape, hw, mb).seconds
    tpot += hw.step_overhead + cand.batch * hw.sequence_overhead
    main: tuple[float, LayerTerms] | None = None
    for (att, is_moe), count in shape.layer_groups().items():
        t_attn = attention_time(shape, work, hw, mb, work.mean_context, att)
        if not is_moe:
            tpot += count * s * (t_attn + dense_mlp).seconds
            continue
        terms = _moe_layer(shape, work, hw, cand, t_attn)
        tpot += count * terms.period
        if main is None or count * terms.period > main[0]:
            main = (count * terms.period, terms)
    assert main is not None  # ModelShape guarantees a MoE layer
    moe_layer = main[1]
    binding = moe_layer.binding
    stretch = hw.time_sharing(cand.devices)
    if stretch > 1.0:
        tpot *= stretch
        binding = f"host cores ({cand.devices} engines on {hw.host_cores})"
    served = cand.num_attention * cand.batch
    return Prediction(
        candidate=cand,
        tpot_s=tpot,
        tokens_per_s=served / tpot,
        tokens_per_s_per_device=served / tpot / cand.devices,
        memory=memory,
        moe_layer=moe_layer,
        binding=binding,
    )


def _moe_layer(
    shape: ModelShape, work: Workload, hw: HardwareProfile, cand: Candidate, t_attn: Term
) -> LayerTerms:
    """One MoE layer's terms at ``b / S`` and its period (formulas in the module docstring)."""
    s = cand.stages
    mb = cand.batch / s
    t_a = t_attn + mlp_time(shape, work, hw, mb, shape.shared_intermediate_size)
    messages: dict[str, float] = {}  # a role's busy time spent on its messages
    if cand.colocated:
        n = cand.num_attention
        t_e = expert_time(shape, work, hw, n * mb, n, cand.expert_quant)
        a2a = all_to_all_time(shape, hw, mb, n)
        comm = a2a.seconds * 2
        c = t_a.seconds + t_e.seconds
        busy = {
            "compute": s * c,
            "link": s * max(comm - (2 * hw.link_latency if n > 1 else 0.0), 0.0),
        }
        chain = c + comm
        xfer = a2a
        roles = {"attention": t_a, "experts": t_e}
    else:
        a, f = cand.num_attention, cand.num_ffn
        t_e = expert_time(shape, work, hw, a * mb, f, cand.expert_quant)
        xfer = transfer_time(shape, hw, mb, a, f)
        occupancy = xfer.seconds - hw.link_latency
        busy = {"attention": s * t_a.seconds, "ffn": s * t_e.seconds, "link": s * occupancy}
        if hw.messages_use_compute:
            # Each role posts and completes its own messages, both ways, on its compute: the
            # link keeps only the wire time (the larger end's message software moves over).
            m_a, m_f = message_costs(hw, a, f)
            messages = {"attention": s * 2 * m_a, "ffn": s * 2 * m_f}
            busy["attention"] += messages["attention"]
            busy["ffn"] += messages["ffn"]
            busy["link"] = s * max(occupancy - max(m_a, m_f), 0.0)
        chain = t_a.seconds + t_e.seconds + 2 * xfer.seconds
        roles = {"attention": t_a, "ffn": t_e}
    period = max(*busy.values(), chain)
    return LayerTerms(t_a, t_e, xfer, period, _binding(busy, chain, s, roles, xfer, messages))


def _binding(
    busy: dict[str, float],
    chain: float,
    stages: int,
    roles: dict[str, Term],
    xfer: Term,
    messages: dict[str, float],
) -> str:
    """What sets a MoE layer's period: the busiest resource (a role with its roofline side,
    ``"memory"`` or ``"compute"``, or ``"messages"`` when most of its busy time is its message
    software; or ``link``) when its busy time is the period; otherwise one micro-batch's
    dependency chain is, and the largest part of that chain is named (with ``"chain: "`` in
    front when ``stages > 1``: the overlap could not hide it)."""
    top = max(busy, key=lambda k: busy[k])
    if chain > busy[top] * (1 + 1e-9):
        parts = {**{k: v.seconds for k, v in roles.items()}, "link": 2 * xfer.seconds}
        part = max(parts, key=lambda k: parts[k])
        what = "link" if part == "link" else f"{part} {roles[part].bound}"
        return f"chain: {what}" if stages > 1 else what
    if top in roles:
        if messages.get(top, 0.0) > busy[top] / 2:
            return f"{top} messages"
        return f"{top} {roles[top].bound}"
    if top == "compute":
        part = max(roles, key=lambda k: roles[k].seconds)
        return f"{part} {roles[part].bound}"
    return "link"


@dataclass(frozen=True)
class PlanResult:
    """The search's answer: feasible predictions best first (tokens/s per device), the best
    colocated baseline per device count, and the refused candidates' reasons."""

    candidates: tuple[Prediction, ...]
    baselines: dict[int, Prediction]
    refused_memory: tuple[AFDPlanMemoryError, ...] = field(default=())
    over_tpot: int = 0


DEFAULT_ATTENTION_RANKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_FFN_RANKS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def search(
    shape: ModelShape,
    work: Workload,
    hw: HardwareProfile,
    *,
    devices: int | None = None,
    tpot_target_s: float | None = None,
    attention_ranks: Iterable[int] = DEFAULT_ATTENTION_RANKS,
    ffn_ranks: Iterable[int] = DEFAULT_FFN_RANKS,
    stages: Sequence[int] = (1, 2, 3),
    batches: Sequence[int] = DEFAULT_BATCHES,
    expert_quants: Sequence[str] = QUANT_SCHEMES,
) -> PlanResult:
    """Every AFD candidate ``(A, F, S, b, quant)`` with ``A + F <= devices`` (if given) and
    ``F <= E``, and every colocated ``EP N`` (``N <= E``) at the same device counts; keeps those
    that fit memory and meet ``tpot_target_s`` (if given); best first by tokens/s per device."""
    if devices is not None and devices < 2:
        raise AFDPlanError("devices", devices, "an integer >= 2 (one Attention and one FFN rank)")
    if tpot_target_s is not None and tpot_target_s <= 0:
        raise AFDPlanError("tpot_target", tpot_target_s, "a time > 0")
    kept: list[Prediction] = []
    refused: list[AFDPlanMemoryError] = []
    over = 0
    sizes: set[int] = set()
    best_by_n: dict[int, Prediction] = {}

    def consider(cand: Candidate) -> Prediction | None:
        nonlocal over
        try:
            p = predict(shape, work, hw, cand)
        except AFDPlanMemoryError as e:
            refused.append(e)
            return None
        if tpot_target_s is not None and p.tpot_s > tpot_target_s:
            over += 1
            return None
        return p

    for a in attention_ranks:
        for f in ffn_ranks:
            if f > shape.num_experts or (devices is not None and a + f > devices):
                continue
            sizes.add(a + f)
            for s in stages:
                for b in batches:
                    if b < s:
                        continue
                    for q in expert_quants:
                        p = consider(Candidate(a, f, s, b, q))
                        if p is not None:
                            kept.append(p)
    for n in sorted(sizes):
        if n > shape.num_experts:
            continue
        for s in stages:
            for b in batches:
                if b < s:
                    continue
                for q in expert_quants:
                    p = consider(Candidate(n, 0, s, b, q))
                    if p is None:
                        continue
                    best = best_by_n.get(n)
                    if best is None or p.tokens_per_s_per_device > best.tokens_per_s_per_device:
                        best_by_n[n] = p
    kept.sort(key=lambda p: -p.tokens_per_s_per_device)
    return PlanResult(tuple(kept), best_by_n, tuple(refused), over)
