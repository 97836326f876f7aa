"""Worker for the end-to-end test against afd-core's real P2PConnector (not a test module).

World: ``A`` Attention ranks then ``F`` FFN ranks. Attention ranks drive the afd_remote proxies
(the full forward and the two-stage dispatch/receive split; token ids with the rows); FFN ranks
run the service loop by hand: receive control, then per layer and stage receive every served
payload, check it, reply ``hidden * 2 + layer``. Each rank returns a report of plain Python values.

The ``overlapped`` variant runs the stages as serving does with ``num_stages=2``: afd-core's
ping-pong (the runtime's executor, stood in for by :func:`afd_core.testing.run_stages_in_turns`), each stage a full forward over the layers
through the proxy's send -> yield -> receive, with random delays before every layer's attention
and before every FFN reply. Attention rank 1's second stage is empty, so it runs stage 0 alone and
its proxy carries stage 1 as zero-token transfers (with ``check_sequence``, so their headers are
on the wire).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_core.metadata import AFDControlMessage, AFDPayloadSpec
from afd_core.testing import run_stages_in_turns
from afd_core.topology import AFDTopology
from afd_remote import AFDAttentionFusedMoE, RemoteFFNTransfer, softmax_topk

HIDDEN = 8
EXPERTS = 6
TOP_K = 2
LAYERS = 2
STAGES = 2

# variant -> (gate on attention, spec kwargs, use the dispatch/receive split)
VARIANTS: dict[str, tuple[bool, dict[str, Any], bool]] = {
    "gate_on_ffn_forward": (False, {}, False),
    "router_logits_forward": (True, {"router_logits_width": EXPERTS}, False),
    "topk_split": (True, {"top_k": TOP_K}, True),
    # token-id routing (DeepSeek-V4 hash layers): the ids travel with the rows, gate on FFN
    "input_ids_forward": (False, {"input_ids": True}, False),
    "overlapped": (True, {"router_logits_width": EXPERTS}, False),
}
#: Upper bound of every injected delay (seconds) in the ``overlapped`` variant.
MAX_DELAY_S = 0.02


def counts(arank: int) -> tuple[int, int]:
    """Tokens per stage of Attention rank ``arank`` (rank 1's second stage is empty)."""
    return (5 + arank, 0 if arank == 1 else 3)


def hidden_input(arank: int, stage: int) -> torch.Tensor:
    n = counts(arank)[stage]
    return torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN) + 100 * arank + stage


def logits_for(arank: int, layer: int, stage: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(arank * 100 + layer * 10 + stage)
    return torch.randn(counts(arank)[stage], EXPERTS, generator=gen)


def ids_for(arank: int, stage: int) -> torch.Tensor:
    """Token ids of Attention rank ``arank``'s stage (distinct per rank and stage)."""
    return torch.arange(counts(arank)[stage], dtype=torch.int64) * 3 + 1000 * arank + stage


def _attention(
    conn: P2PConnector, arank: int, gate: bool, split: bool, ids: bool = False
) -> list[str]:
    problems: list[str] = []
    layers = [
        AFDAttentionFusedMoE(layer, gate_on_attention=gate, top_k=TOP_K) for layer in range(LAYERS)
    ]
    conn.send_control(AFDControlMessage(tuple((c,) for c in counts(arank))))
    x = {s: hidden_input(arank, s) for s in range(STAGES)}
    expected = dict(x)
    for layer in range(LAYERS):
        for s in range(STAGES):
            expected[s] = expected[s] * 2 + layer

    def call_args(layer: int, stage: int) -> dict[str, torch.Tensor]:
        args = {"router_logits": logits_for(arank, layer, stage)} if gate else {}
        if ids:
            args["input_ids"] = ids_for(arank, stage)
        return args

    if not split:
        for layer, moe in enumerate(layers):
            for s in range(STAGES):
                meta = AFDForwardMetadata(connector=conn, stage_idx=s, num_stages=STAGES)
                with set_afd_forward_metadata(meta):
                    x[s] = moe(x[s], **call_args(layer, s))
    else:
        pending: dict[int, RemoteFFNTransfer] = {}
        for layer, moe in enumerate(layers):
            for s in range(STAGES):
                meta = AFDForwardMetadata(connector=conn, stage_idx=s, num_stages=STAGES)
                with set_afd_forward_metadata(meta):
                    other = 1 - s
                    if other in pending:
                        x[other] = moe.receive(pending.pop(other))
                    pending[s] = moe.dispatch_experts(x[s], **call_args(layer, s))
        for s, transfer in pending.items():
            x[s] = layers[-1].receive(transfer)
    for s in range(STAGES):
        if not torch.equal(x[s], expected[s]):
            problems.append(f"attention {arank} stage {s}: output differs")
    conn.send_control(AFDControlMessage.shutdown_message())
    return problems


def _overlapped(conn: P2PConnector, arank: int) -> list[str]:
    layers = [AFDAttentionFusedMoE(layer, gate_on_attention=True) for layer in range(LAYERS)]
    stage_counts = counts(arank)
    conn.send_control(AFDControlMessage(tuple((c,) for c in stage_counts)))
    order: list[tuple[int, int]] = []

    def stage(s: int) -> Any:
        rng = random.Random(arank * 10 + s)

        def run() -> torch.Tensor:
            meta = AFDForwardMetadata(
                connector=conn, stage_idx=s, num_stages=STAGES, num_tokens=stage_counts
            )
            x = hidden_input(arank, s)
            with set_afd_forward_metadata(meta):
                for layer, moe in enumerate(layers):
                    time.sleep(rng.uniform(0, MAX_DELAY_S))  # this stage's "attention"
                    order.append((layer, s))
                    x = moe(x, router_logits=logits_for(arank, layer, s))
            return x

        return run

    active = [s for s in range(STAGES) if stage_counts[s]]
    outputs = run_stages_in_turns([stage(s) for s in active], timeout_s=60)
    problems = []
    for s, out in zip(active, outputs, strict=True):
        expected = hidden_input(arank, s)
        for layer in range(LAYERS):
            expected = expected * 2 + layer
        if not torch.equal(out, expected):
            problems.append(f"attention {arank} stage {s}: output differs")
    want = [(layer, s) for layer in range(LAYERS) for s in active]
    if order != want:
        problems.append(f"attention {arank}: stage order {order}, expected {want}")
    conn.send_control(AFDControlMessage.shutdown_message())
    return problems


def _ffn(conn: P2PConnector, topo: AFDTopology, ffn_rank: int, variant: str) -> list[str]:
    problems: list[str] = []
    rng = random.Random(ffn_rank)
    served = topo.attention_ranks_for(ffn_rank)
    ctl = conn.recv_control()
    if ctl.stage_token_counts != tuple(tuple(counts(a)[s] for a in served) for s in range(STAGES)):
        problems.append(f"control counts {ctl.stage_token_counts}")
    for layer in range(LAYERS):
        for s in range(STAGES):
            meta, payloads = conn.recv_dispatch(layer, s)
            if meta.num_tokens != ctl.transfer_metadata(layer, s).num_tokens:
                problems.append(f"dispatch counts {meta.num_tokens} l{layer} s{s}")
            for arank, payload in zip(served, payloads, strict=True):
                logits = logits_for(arank, layer, s)
                if variant in ("router_logits_forward", "overlapped") and not torch.equal(
                    payload.router_logits, logits
                ):
                    problems.append(f"router_logits a{arank} l{layer} s{s}")
                if variant == "input_ids_forward" and not torch.equal(
                    payload.input_ids, ids_for(arank, s)
                ):
                    problems.append(f"input_ids a{arank} l{layer} s{s}")
                if variant == "topk_split":
                    weights, ids = softmax_topk(logits, TOP_K, True)
                    if not (
                        torch.equal(payload.topk_ids, ids)
                        and torch.equal(payload.topk_weights, weights)
                    ):
                        problems.append(f"topk a{arank} l{layer} s{s}")
            if variant == "overlapped":
                time.sleep(rng.uniform(0, MAX_DELAY_S))
            conn.send_combine([p.hidden_states * 2 + layer for p in payloads], meta)
    if not conn.recv_control().shutdown:
        problems.append("no shutdown message")
    return problems


def run(rank: int, port: int, a: int, f: int) -> dict[str, Any]:
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    report: dict[str, Any] = {"role": str(role), "problems": [], "variants": 0}
    for variant, (gate, spec_kwargs, split) in VARIANTS.items():
        cfg = AFDConfig(
            role=role,
            port=port,
            num_attention_ranks=a,
            num_ffn_ranks=f,
            compute_gate_on_attention=gate,
            timeout_s=60.0,
            # With sequence headers an empty stage still has bytes on the wire (its headers):
            # the overlapped variant checks they are sent in order.
            connector_extra_config={"check_sequence": variant == "overlapped"},
        )
        spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32, **spec_kwargs)
        conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=LAYERS)
        conn.init()
        try:
            if role is AFDRole.ATTENTION and variant == "overlapped":
                problems = _overlapped(conn, role_rank)
            elif role is AFDRole.ATTENTION:
                ids = bool(spec_kwargs.get("input_ids"))
                problems = _attention(conn, role_rank, gate, split, ids)
            else:
                problems = _ffn(conn, topo, role_rank, variant)
        finally:
            conn.close()
        report["problems"].extend(f"{variant}: {p}" for p in problems)
        report["variants"] += 1
    return report
