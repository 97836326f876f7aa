"""Benchmark: routed TP padding and the Attention-side proxy overhead (CPU, one process).

* ``padding`` rows: per-rank rows dispatched with and without routed TP padding, and the CPU time
  of ``slice_for_dispatch`` + ``restore_dispatched_output`` on the last TP rank (the all-gather
  returns a precomputed tensor, so the figure is the padding bookkeeping, not the collective).
* ``proxy`` rows: wall time of one ``RemoteFFNProxy`` / ``AFDAttentionFusedMoE`` call against a
  connector that returns its input (context lookup, checks, payload construction, top-k routing).

Run: ``python bench_remote.py --out results/remote.json [--quick]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import (
    AFDConnectorBase,
    AFDTransferHandle,
    register_connector,
    unregister_connector,
)
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_core.metadata import AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_remote import (
    AFDAttentionFusedMoE,
    RemoteFFNProxy,
    plan_routed_dispatch,
    restore_dispatched_output,
    slice_for_dispatch,
)

_NAME = "afd_remote_bench_echo"


class EchoConnector(AFDConnectorBase):
    """Attention-side connector whose "FFN" returns the hidden states unchanged."""

    name = _NAME

    def __init__(self, payload_spec: AFDPayloadSpec) -> None:
        # Registered only while the config validates it: the process registry is left unchanged.
        register_connector(_NAME, EchoConnector, replace=True)
        try:
            config = AFDConfig(role=AFDRole.ATTENTION, connector=_NAME)
        finally:
            unregister_connector(_NAME)
        super().__init__(config, None, 0, payload_spec=payload_spec, num_layers=1)

    def init(self) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def is_initialized(self) -> bool:
        return True

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        return AFDTransferHandle(metadata, [p.hidden_states for p in payloads], id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        handle.consume()
        result: list[torch.Tensor] = handle.state
        return result

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        raise NotImplementedError

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        raise NotImplementedError


def _time_us(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 2] * 1e6  # median


def bench_padding(tokens: int, tp_size: int, hidden: int, repeats: int) -> dict[str, object]:
    x = torch.randn(tokens, hidden)
    # The last rank: its slice is the short one (it zero-pads its output before the gather).
    lay = plan_routed_dispatch(tokens, tp_rank=tp_size - 1, tp_size=tp_size)
    gathered = torch.randn(lay.padded_tokens, hidden)  # stands in for the collective's result

    def step() -> torch.Tensor:
        local = slice_for_dispatch(x, lay)
        return restore_dispatched_output(local, lay, lambda _: gathered)

    return {
        "kind": "padding",
        "tokens": tokens,
        "tp_size": tp_size,
        "hidden": hidden,
        "rows_per_rank_unpadded": tokens,
        "rows_per_rank_routed": lay.local_tokens,
        "median_us": round(_time_us(step, repeats), 2),
    }


def bench_proxy(tokens: int, hidden: int, mode: str, repeats: int) -> dict[str, object]:
    experts, top_k = 64, 8
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    module: torch.nn.Module
    if mode == "dense":
        spec = AFDPayloadSpec(hidden_size=hidden, dtype=torch.float32)
        module = RemoteFFNProxy(0)
        call: Callable[[], object] = lambda: module(x)  # noqa: E731
    elif mode == "moe_logits":
        spec = AFDPayloadSpec(hidden_size=hidden, dtype=torch.float32, router_logits_width=experts)
        module = AFDAttentionFusedMoE(0, gate_on_attention=True, top_k=top_k)
        call = lambda: module(x, logits)  # noqa: E731
    else:
        spec = AFDPayloadSpec(hidden_size=hidden, dtype=torch.float32, top_k=top_k)
        module = AFDAttentionFusedMoE(0, gate_on_attention=True, top_k=top_k)
        call = lambda: module(x, logits)  # noqa: E731
    meta = AFDForwardMetadata(connector=EchoConnector(spec))
    with set_afd_forward_metadata(meta):
        us = _time_us(call, repeats)
    return {
        "kind": "proxy",
        "mode": mode,
        "tokens": tokens,
        "hidden": hidden,
        "median_us": round(us, 2),
    }


def _table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| kind | mode / TP | tokens | hidden | rows per rank (plain → routed) | median µs |",
        "| --- | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        if r["kind"] == "padding":
            mode = f"TP={r['tp_size']}"
            rows_col = f"{r['rows_per_rank_unpadded']} → {r['rows_per_rank_routed']}"
        else:
            mode, rows_col = str(r["mode"]), "—"
        lines.append(
            f"| {r['kind']} | {mode} | {r['tokens']} | {r['hidden']} | {rows_col} "
            f"| {r['median_us']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (harness test)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.quick:
        token_counts, tp_sizes, hidden, repeats = [1, 17], [1, 2], 16, 3
    else:
        token_counts, tp_sizes, hidden, repeats = [1, 64, 1024, 8192], [1, 2, 4, 8], 2048, 50
    rows: list[dict[str, object]] = []
    for tokens in token_counts:
        for tp in tp_sizes:
            rows.append(bench_padding(tokens, tp, hidden, repeats))
    for tokens in token_counts:
        for mode in ("dense", "moe_logits", "moe_topk"):
            rows.append(bench_proxy(tokens, hidden, mode, repeats))
    result = {
        "benchmark": "afd-remote",
        "quick": args.quick,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
