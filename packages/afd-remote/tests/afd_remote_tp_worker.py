"""Worker for the multi-process routed TP padding tests (not a test module).

Each spawned rank joins a gloo group, runs every token count through the real proxies with a
recording connector and saves what it dispatched and what it got back to ``out_dir/rank<r>.pt``;
the test process does all the checking.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_remote import AFDAttentionFusedMoE, RemoteFFNProxy, RoutedTPPadding, softmax_topk
from afd_remote_testkit import Event, RecordingConnector, spec

NUM_EXPERTS = 5
TOP_K = 2
WIDTH = 3


def token_counts(tp_size: int) -> dict[str, int]:
    """The issue's token counts for one TP size."""
    return {"0": 0, "1": 1, "tp-1": tp_size - 1, "tp": tp_size, "tp+1": tp_size + 1, "17": 17}


def parent_hidden(rows: int, offset: int = 0) -> torch.Tensor:
    """Row i is (i + 1 + offset) * [1, 10, 100]: identifiable and non-zero."""
    base = torch.arange(1 + offset, rows + 1 + offset, dtype=torch.float32).unsqueeze(1)
    return base * torch.tensor([1.0, 10.0, 100.0])


def parent_logits(rows: int) -> torch.Tensor:
    """Token i prefers expert i % NUM_EXPERTS, then (i + 1) % NUM_EXPERTS."""
    logits = torch.zeros(rows, NUM_EXPERTS)
    idx = torch.arange(rows)
    logits[idx, idx % NUM_EXPERTS] = 4.0
    logits[idx, (idx + 1) % NUM_EXPERTS] = 2.0
    return logits


def _sent(log: list[Event]) -> dict[str, torch.Tensor]:
    sends = [e for e in log if e.kind == "send"]
    assert len(sends) == 1, sends
    return sends[0].tensors


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=150),
    )
    try:
        tp = RoutedTPPadding(dist.group.WORLD)
        sp = RoutedTPPadding(dist.group.WORLD, use_sequence_parallel=True)
        results: dict[int, dict[str, object]] = {}
        for n in sorted(set(token_counts(world_size).values())):
            res: dict[str, object] = {}
            # Plain TP, gate on FFN: hidden states only.
            log: list[Event] = []
            conn = RecordingConnector(spec(WIDTH), log)
            with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
                out = RemoteFFNProxy(0, tp_padding=tp)(parent_hidden(n))
            res["tp_sent"] = _sent(log)
            res["tp_out"] = out
            # Plain TP, gate on Attention with top-k and input ids: all fields stay aligned.
            log = []
            conn = RecordingConnector(spec(WIDTH, top_k=TOP_K, input_ids=True), log)
            moe = AFDAttentionFusedMoE(1, gate_on_attention=True, top_k=TOP_K, tp_padding=tp)
            with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
                out = moe(parent_hidden(n), parent_logits(n), torch.arange(n) + 1000)
            res["moe_sent"] = _sent(log)
            res["moe_out"] = out
            # Expert parallel (two FFN ranks, experts 0-1 | 2-4): this rank's slice is split by
            # the tokens' top-k; the combined slice outputs are all-gathered.
            log = []
            conn = RecordingConnector(spec(WIDTH, top_k=TOP_K), log, num_ffn_ranks=2)
            moe = AFDAttentionFusedMoE(3, gate_on_attention=True, tp_padding=tp)
            weights, ids = softmax_topk(parent_logits(n), TOP_K, True)
            with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
                transfer = moe.dispatch_routed(parent_hidden(n), weights, ids, NUM_EXPERTS)
                out = moe.receive(transfer)
            res["ep_sent"] = _sent(log)
            res["ep_counts"] = transfer.metadata.num_tokens
            res["ep_out"] = out
            # Sequence parallel: each rank holds its own shard and dispatches it unchanged.
            log = []
            conn = RecordingConnector(spec(WIDTH), log)
            local = parent_hidden(n, offset=100 * rank)
            with set_afd_forward_metadata(AFDForwardMetadata(connector=conn)):
                out = RemoteFFNProxy(2, tp_padding=sp)(local)
            res["sp_local"] = local
            res["sp_sent"] = _sent(log)
            res["sp_out"] = out
            results[n] = res
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
