"""Worker for the expert-parallel test against afd-core's connectors (not a test module).

World: ``A`` Attention ranks then ``F`` FFN ranks, one process each over the real P2P connector, or
one thread each over the in-process connector (``connector="inprocess"``). Toy experts: expert ``e`` is
``x * (e + 1)`` (exact in float32 for the small integers used), so FFN rank ``f``'s answer for a
token is ``sum over its own slots of w * x * (e + 1)`` and the Attention rank can check the
combined output against the whole sum, computed in the combine order (rank 0's part, then rank
1's, ...). Weights are multiples of 1/8 so every partial sum is exact: any order gives the same
bits, and a wrong row, slot or rank shows up exactly.

A second step runs two stages as serving does with ``num_stages=2`` (afd-core's ping-pong,
random delays before each layer's dispatch and each FFN reply): Attention rank 0 splits its
tokens 3 | rest, rank 1 runs one stage and its proxy carries stage 1 as empty dispatches (their
headers tell each FFN rank there is nothing to compute).
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnectorBase, create_connector
from afd_core.forward_context import AFDForwardMetadata, dbo_yield, set_afd_forward_metadata
from afd_core.metadata import AFDControlMessage, AFDPayloadSpec
from afd_core.testing import run_stages_in_turns
from afd_core.topology import AFDTopology
from afd_remote import AFDAttentionFusedMoE

HIDDEN = 8
EXPERTS = 6
TOP_K = 2
LAYERS = 3


def tokens(arank: int) -> int:
    return 5 + 2 * arank


def routing(arank: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden, top-k weights, top-k ids; at layer 1 every token uses experts 0 and 1 only (the
    FFN ranks holding none of them get an empty dispatch)."""
    n = tokens(arank)
    gen = torch.Generator().manual_seed(arank * 100 + layer)
    hidden = torch.randint(-8, 8, (n, HIDDEN), generator=gen).float()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(n)])
    if layer == 1:
        ids = torch.tensor([[0, 1]] * n)
    weights = torch.randint(1, 8, (n, TOP_K), generator=gen).float() / 8
    return hidden, weights, ids.to(torch.int32)


def toy_partial(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum over slots of ``w * x * (id + 1)``; slots with weight 0 add nothing."""
    out = torch.zeros_like(hidden)
    for k in range(ids.shape[1]):
        out += weights[:, k : k + 1] * hidden * (ids[:, k : k + 1].float() + 1)
    return out


def _attention(conn: AFDConnectorBase, topo: AFDTopology, arank: int) -> dict[str, Any]:
    moe = [AFDAttentionFusedMoE(layer, gate_on_attention=True) for layer in range(LAYERS)]
    conn.send_control(AFDControlMessage(((tokens(arank),),)))
    emap = topo.expert_map(EXPERTS)
    problems, counts = [], []
    for layer in range(LAYERS):
        hidden, weights, ids = routing(arank, layer)
        with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
            transfer = moe[layer].dispatch_routed(hidden, weights, ids, EXPERTS)
            out = moe[layer].receive(transfer)
        counts.append(transfer.metadata.num_tokens)
        expected = torch.zeros_like(hidden)
        for f in range(topo.num_ffn_ranks):
            w, i = emap.localise(f, weights, ids)
            glob = torch.tensor(emap.local_experts(f))[i.long()]
            expected += toy_partial(hidden, w, glob)
        if not torch.equal(out, expected):
            problems.append(f"attention {arank} layer {layer}: combined output differs")
    problems += _attention_staged(conn, topo, arank)
    conn.send_control(AFDControlMessage.shutdown_message())
    return {"problems": problems, "counts": counts}


def _expected(
    topo: AFDTopology, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    emap = topo.expert_map(EXPERTS)
    expected = torch.zeros_like(hidden)
    for f in range(topo.num_ffn_ranks):
        w, i = emap.localise(f, weights, ids)
        glob = torch.tensor(emap.local_experts(f))[i.long()]
        expected += toy_partial(hidden, w, glob)
    return expected


def stage_split(arank: int) -> tuple[int, int]:
    """Tokens per stage in the two-stage step (rank 1 and above: one stage)."""
    n = tokens(arank)
    return (3, n - 3) if arank == 0 else (n, 0)


def _attention_staged(conn: AFDConnectorBase, topo: AFDTopology, arank: int) -> list[str]:
    moe = [AFDAttentionFusedMoE(layer, gate_on_attention=True) for layer in range(LAYERS)]
    split = stage_split(arank)
    conn.send_control(AFDControlMessage(tuple((c,) for c in split)))
    problems: list[str] = []

    def stage(s: int) -> Any:
        rows = slice(0, split[0]) if s == 0 else slice(split[0], split[0] + split[1])
        rng = random.Random(arank * 10 + s)

        def run() -> None:
            meta = AFDForwardMetadata(connector=conn, stage_idx=s, num_stages=2, num_tokens=split)
            with set_afd_forward_metadata(meta):
                for layer in range(LAYERS):
                    hidden, weights, ids = (t[rows] for t in routing(arank, layer))
                    time.sleep(rng.uniform(0, 0.01))
                    transfer = moe[layer].dispatch_routed(hidden, weights, ids, EXPERTS)
                    dbo_yield()
                    out = moe[layer].receive(transfer)
                    if not torch.equal(out, _expected(topo, hidden, weights, ids)):
                        problems.append(f"attention {arank} stage {s} layer {layer} differs")

        return run

    run_stages_in_turns([stage(s) for s in range(2) if split[s]], timeout_s=60)
    return problems


def _ffn_staged(conn: AFDConnectorBase, topo: AFDTopology, ffn_rank: int) -> list[tuple[int, ...]]:
    emap = topo.expert_map(EXPERTS)
    mine = torch.tensor(emap.local_experts(ffn_rank))
    ctl = conn.recv_control()
    rng = random.Random(ffn_rank)
    received = []
    for layer in range(LAYERS):
        for stage in range(ctl.num_stages):
            meta, payloads = conn.recv_dispatch(layer, stage)
            received.append(meta.num_tokens)
            time.sleep(rng.uniform(0, 0.01))
            if not sum(meta.num_tokens):
                continue  # the service loop's rule: nothing routed here, nothing sent back
            outs = []
            for p in payloads:
                w, i = emap.localise(ffn_rank, p.topk_weights, p.topk_ids)
                outs.append(toy_partial(p.hidden_states, w, mine[i.long()]))
            conn.send_combine(outs, meta)
    return received


def _ffn(conn: AFDConnectorBase, topo: AFDTopology, ffn_rank: int) -> dict[str, Any]:
    emap = topo.expert_map(EXPERTS)
    mine = torch.tensor(emap.local_experts(ffn_rank))
    conn.recv_control()
    received = []
    for layer in range(LAYERS):
        meta, payloads = conn.recv_dispatch(layer, 0)
        received.append(meta.num_tokens)
        outs = []
        for p in payloads:
            w, i = emap.localise(ffn_rank, p.topk_weights, p.topk_ids)
            outs.append(toy_partial(p.hidden_states, w, mine[i.long()]))
        conn.send_combine(outs, meta)
    staged = _ffn_staged(conn, topo, ffn_rank)
    shutdown = conn.recv_control().shutdown
    return {
        "problems": [] if shutdown else ["no shutdown message"],
        "received": received,
        "staged": staged,
    }


def run(rank: int, port: int, a: int, f: int, connector: str = "p2p") -> dict[str, Any]:
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    cfg = AFDConfig(
        role=role,
        connector=connector,
        port=port,
        num_attention_ranks=a,
        num_ffn_ranks=f,
        ffn_rank=role_rank if role is AFDRole.FFN else 0,
        compute_gate_on_attention=True,
        timeout_s=60.0,
    )
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32, top_k=TOP_K)
    conn = create_connector(cfg, role_rank, payload_spec=spec, num_layers=LAYERS, topology=topo)
    conn.init()
    try:
        if role is AFDRole.ATTENTION:
            report = _attention(conn, topo, role_rank)
        else:
            report = _ffn(conn, topo, role_rank)
    finally:
        conn.close()
    report["role"] = str(role)
    return report


def run_home(rank: int, port: int, a: int, f: int) -> dict[str, Any]:
    """``expert_dispatch='ffn'`` over the in-process connector: each Attention rank's tokens all
    go to its home FFN rank (:meth:`AFDTopology.home_ffn_rank`), which answers each token's whole
    toy output (as Mega does after dispatching among the FFN ranks); the other FFN ranks get
    empty transfers. Reports what each FFN rank received per Attention rank and layer."""
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    ffn_side = {"ffn_compute": "mega", "expert_quant": "w8a8"} if role is AFDRole.FFN else {}
    cfg = AFDConfig(
        role=role,
        connector="inprocess",
        port=port,
        num_attention_ranks=a,
        num_ffn_ranks=f,
        ffn_rank=role_rank if role is AFDRole.FFN else 0,
        compute_gate_on_attention=True,
        expert_dispatch="ffn",
        timeout_s=60.0,
        **ffn_side,  # type: ignore[arg-type]
    )
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32, top_k=TOP_K)
    conn = create_connector(cfg, role_rank, payload_spec=spec, num_layers=LAYERS, topology=topo)
    conn.init()
    report: dict[str, Any] = {"problems": []}
    try:
        if role is AFDRole.ATTENTION:
            moe = [AFDAttentionFusedMoE(layer, gate_on_attention=True) for layer in range(LAYERS)]
            conn.send_control(AFDControlMessage(((tokens(role_rank),),)))
            for layer in range(LAYERS):
                hidden, weights, ids = routing(role_rank, layer)
                with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
                    transfer = moe[layer].dispatch_routed(hidden, weights, ids, EXPERTS)
                    out = moe[layer].receive(transfer)
                report.setdefault("counts", []).append(transfer.metadata.num_tokens)
                if not torch.equal(out, toy_partial(hidden, weights, ids)):
                    report["problems"].append(f"attention {role_rank} layer {layer}: output")
            conn.send_control(AFDControlMessage.shutdown_message())
        else:
            conn.recv_control()
            for layer in range(LAYERS):
                meta, payloads = conn.recv_dispatch(layer, 0)
                report.setdefault("received", []).append(meta.num_tokens)
                # Global ids as routed: the whole output of each token.
                outs = [toy_partial(p.hidden_states, p.topk_weights, p.topk_ids) for p in payloads]
                conn.send_combine(outs, meta)
            if not conn.recv_control().shutdown:
                report["problems"].append("no shutdown message")
    finally:
        conn.close()
    return report
