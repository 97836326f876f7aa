"""Benchmark: the P2P connector against raw torch.distributed gloo send/recv (same run).

Two processes on one host (Attention world rank 0, FFN world rank 1, gloo on CPU). For each
payload size (``hidden_states`` of ``[tokens, 1024]`` float32, 4 KiB per token) and each of
``--repeats`` interleaved repeats (the order raw/P2P alternates per repeat):

* round-trip latency: Attention sends the payload, FFN sends the same bytes back.
  P2P: ``send_attn_output`` + ``recv_ffn_output`` / ``recv_attn_output`` + ``send_ffn_output``;
  raw: ``send``+``recv`` on a ProcessGroupGloo with preallocated buffers.
* one-way throughput: Attention issues ``--inflight`` transfers back to back (distinct stages,
  so distinct tags), the FFN side times until all arrived (bytes / time), replies untimed. The
  FFN side of the connector receives one transfer per blocking ``recv_attn_output`` call (the
  service-loop pattern), so the baseline ("raw") does the same: one blocking ``recv`` per
  transfer. A second baseline ("raw pipelined") posts every receive at once; it is reported for
  reference (the connector API has no equivalent).

Also measured in-process (no I/O, so free of scheduler noise): the connector's own cost per call,
i.e. ``send_attn_output`` + ``recv_ffn_output`` and ``recv_attn_output`` + ``send_ffn_output``
against a null process group, minus the same number of null ``send``/``recv`` calls plus the
receive-buffer allocation the raw path also needs.

Reported: median of the per-repeat medians and P99 over all samples (latency); median and
minimum over repeats (throughput); added latency per connector call = (RTT_p2p - RTT_raw) / 2.

Usage: ``python bench_p2p.py --out results.json [--quick]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from afd_core.config import AFDConfig, AFDRole
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.p2p import P2PConnector
from afd_core.startup import open_tcp_store
from afd_core.testing import free_port, run_world
from afd_core.topology import AFDTopology

HIDDEN = 1024
BYTES_PER_TOKEN = HIDDEN * 4
FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 64 << 10]
RAW_TAG, RAW_TAG_BACK = 11, 12


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def _sync(pg: Any, rank: int) -> None:
    """A tiny round trip on the raw group: both sides leave together (roughly)."""
    t = torch.zeros(1)
    if rank == 0:
        pg.send([t], 1, 99).wait()
        pg.recv([t], 1, 98).wait()
    else:
        pg.recv([t], 0, 99).wait()
        pg.send([t], 0, 98).wait()


def _raw_rtt(pg: Any, rank: int, x: torch.Tensor, y: torch.Tensor, iters: int) -> list[float]:
    samples = []
    for _ in range(iters):
        if rank == 0:
            t0 = time.perf_counter()
            pg.send([x], 1, RAW_TAG).wait()
            pg.recv([y], 1, RAW_TAG_BACK).wait()
            samples.append(time.perf_counter() - t0)
        else:
            pg.recv([y], 0, RAW_TAG).wait()
            pg.send([y], 0, RAW_TAG_BACK).wait()
    return samples


def _p2p_rtt(conn: P2PConnector, rank: int, x: torch.Tensor, iters: int) -> list[float]:
    n = x.shape[0]
    samples = []
    if rank == 0:
        conn.send_control(AFDControlMessage(((n,),)))
        meta = AFDTransferMetadata(0, 0, (n,))
        payload = AFDPayload(x)
        for _ in range(iters):
            t0 = time.perf_counter()
            handle = conn.send_attn_output(payload, meta)
            conn.recv_ffn_output(handle)
            samples.append(time.perf_counter() - t0)
    else:
        ctl = conn.recv_control()
        meta = ctl.transfer_metadata(0, 0)
        for _ in range(iters):
            (p,) = conn.recv_attn_output(meta)
            conn.send_ffn_output([p.hidden_states], meta)
    return samples


def _raw_oneway(pg: Any, rank: int, x: torch.Tensor, inflight: int, pipelined: bool) -> float:
    bufs = [torch.empty_like(x) for _ in range(inflight)]
    _sync(pg, rank)
    if rank == 0:
        works = [pg.send([x], 1, 200 + i) for i in range(inflight)]
        for w in works:
            w.wait()
        for i in range(inflight):
            pg.recv([bufs[i]], 1, 300 + i).wait()
        return 0.0
    t0 = time.perf_counter()
    if pipelined:
        works = [pg.recv([bufs[i]], 0, 200 + i) for i in range(inflight)]
        for w in works:
            w.wait()
    else:
        for i in range(inflight):
            pg.recv([bufs[i]], 0, 200 + i).wait()
    elapsed = time.perf_counter() - t0
    for i in range(inflight):
        pg.send([bufs[i]], 0, 300 + i).wait()
    return elapsed


def _p2p_oneway(conn: P2PConnector, pg: Any, rank: int, x: torch.Tensor, inflight: int) -> float:
    n = x.shape[0]
    if rank == 0:
        conn.send_control(AFDControlMessage(tuple((n,) for _ in range(inflight))))
        _sync(pg, rank)
        payload = AFDPayload(x)
        handles = [
            conn.send_attn_output(payload, AFDTransferMetadata(0, s, (n,))) for s in range(inflight)
        ]
        for h in handles:
            conn.recv_ffn_output(h)
        return 0.0
    ctl = conn.recv_control()
    _sync(pg, rank)
    t0 = time.perf_counter()
    got = [conn.recv_attn_output(ctl.transfer_metadata(0, s)) for s in range(inflight)]
    elapsed = time.perf_counter() - t0
    for s, (p,) in enumerate(got):
        conn.send_ffn_output([p.hidden_states], ctl.transfer_metadata(0, s))
    return elapsed


KINDS = ("raw", "p2p", "p2p_reuse")


def bench_rank(
    rank: int, port: int, sizes: list[int], repeats: int, iters: int, inflight: int
) -> Any:
    torch.set_num_threads(1)
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)
    conns: dict[str, P2PConnector] = {}
    for kind, extra in (("p2p", {}), ("p2p_reuse", {"reuse_buffers": True})):
        cfg = AFDConfig(role=role, port=port, timeout_s=120.0, connector_extra_config=extra)
        conns[kind] = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
        conns[kind].init()
    store = open_tcp_store("127.0.0.1", port, is_master=rank == 0, timeout_s=60.0)
    raw = dist.ProcessGroupGloo(
        dist.PrefixStore("bench/raw", store), rank, 2, timedelta(seconds=120)
    )
    out: dict[str, Any] = {}
    for size in sizes:
        n = size // BYTES_PER_TOKEN
        x = torch.randn(n, HIDDEN)
        y = torch.empty_like(x)
        rec: dict[str, Any] = {f"{k}_{m}": [] for k in (*KINDS, "rawpipe") for m in ("rtt", "tp")}
        _raw_rtt(raw, rank, x, y, 3)  # warm-up every path
        for conn in conns.values():
            _p2p_rtt(conn, rank, x, 3)
        for rep in range(repeats):
            order = KINDS[rep % len(KINDS) :] + KINDS[: rep % len(KINDS)]
            for kind in order:
                if kind == "raw":
                    rec["raw_rtt"].append(_raw_rtt(raw, rank, x, y, iters))
                    rec["raw_tp"].append(_raw_oneway(raw, rank, x, inflight, False))
                    rec["rawpipe_tp"].append(_raw_oneway(raw, rank, x, inflight, True))
                else:
                    rec[f"{kind}_rtt"].append(_p2p_rtt(conns[kind], rank, x, iters))
                    rec[f"{kind}_tp"].append(_p2p_oneway(conns[kind], raw, rank, x, inflight))
        out[str(size)] = rec
    for conn in conns.values():
        if rank == 0:
            conn.send_control(AFDControlMessage.shutdown_message())
        else:
            conn.recv_control()
        conn.close()
    return out


class _NullWork:
    def wait(self, *args: Any) -> bool:
        return True


class _NullGroup:
    """Stands in for a process group: every send/recv completes at once, moving nothing."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _NullWork:
        return _NullWork()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _NullWork:
        return _NullWork()


def overhead_us(tokens: int = 16, iters: int = 20000, repeats: int = 7) -> dict[str, Any]:
    """Per-call connector cost with a null group (median over repeats), and the raw equivalent."""
    torch.set_num_threads(1)
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)
    attn = P2PConnector(AFDConfig(role=AFDRole.ATTENTION), payload_spec=spec, num_layers=1)
    ffn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec, num_layers=1)
    for conn in (attn, ffn):  # bypass init: only the Python path is measured
        conn._initialized = True
        conn._data_pg = _NullGroup()
    x = torch.randn(tokens, HIDDEN)
    meta = AFDTransferMetadata(0, 0, (tokens,))
    payload = AFDPayload(x)
    null = _NullGroup()

    def attn_pair() -> None:
        attn.recv_ffn_output(attn.send_attn_output(payload, meta))

    def ffn_pair() -> None:
        (p,) = ffn.recv_attn_output(meta)
        ffn.send_ffn_output([p.hidden_states], meta)

    def raw_pair() -> None:
        buf = torch.empty(tokens, HIDDEN)
        null.send([x], 1, 1).wait()
        null.recv([buf], 1, 2).wait()

    samples: dict[str, list[float]] = {"attention": [], "ffn": [], "raw": []}
    for _ in range(repeats):
        for name, fn in (("raw", raw_pair), ("attention", attn_pair), ("ffn", ffn_pair)):
            for _ in range(200):
                fn()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "tokens": tokens,
        "attention_pair_us": med["attention"],
        "ffn_pair_us": med["ffn"],
        "raw_pair_us": med["raw"],
        # Two connector calls per pair on each side.
        "attention_added_us_per_call": (med["attention"] - med["raw"]) / 2,
        "ffn_added_us_per_call": (med["ffn"] - med["raw"]) / 2,
    }


def summarize(attn: dict[str, Any], ffn: dict[str, Any], inflight: int) -> list[dict[str, Any]]:
    rows = []
    for size_text in attn:
        size = int(size_text)
        a, f = attn[size_text], ffn[size_text]
        row: dict[str, Any] = {"size_bytes": size}
        for kind in KINDS:
            per_rep = [statistics.median(s) for s in a[f"{kind}_rtt"]]
            flat = [v for s in a[f"{kind}_rtt"] for v in s]
            row[f"{kind}_rtt_us_median"] = statistics.median(per_rep) * 1e6
            row[f"{kind}_rtt_us_p99"] = _percentile(flat, 99) * 1e6
            tps = [size * inflight / t / 1e6 for t in f[f"{kind}_tp"]]
            row[f"{kind}_oneway_MBps_median"] = statistics.median(tps)
            row[f"{kind}_oneway_MBps_min"] = min(tps)
        pipe = [size * inflight / t / 1e6 for t in f["rawpipe_tp"]]
        row["rawpipe_oneway_MBps_median"] = statistics.median(pipe)
        for kind, suffix in (("p2p", ""), ("p2p_reuse", "_reuse")):
            row[f"added_latency_us_per_call{suffix}"] = (
                row[f"{kind}_rtt_us_median"] - row["raw_rtt_us_median"]
            ) / 2
            row[f"throughput_ratio{suffix}"] = (
                row[f"{kind}_oneway_MBps_median"] / row["raw_oneway_MBps_median"]
            )
        rows.append(row)
    return rows


def _fmt_size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "Round-trip latency, µs (median / P99); added = (P2P − raw) / 2 per call:",
        "",
        "| size | raw | P2P | added µs/call | P2P reuse_buffers | added µs/call |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_fmt_size(r['size_bytes'])} "
            f"| {r['raw_rtt_us_median']:.0f} / {r['raw_rtt_us_p99']:.0f} "
            f"| {r['p2p_rtt_us_median']:.0f} / {r['p2p_rtt_us_p99']:.0f} "
            f"| {r['added_latency_us_per_call']:+.1f} "
            f"| {r['p2p_reuse_rtt_us_median']:.0f} / {r['p2p_reuse_rtt_us_p99']:.0f} "
            f"| {r['added_latency_us_per_call_reuse']:+.1f} |"
        )
    lines += [
        "",
        "One-way throughput, MB/s (median / min over repeats); ratio = P2P / raw:",
        "",
        "| size | raw | P2P | ratio | P2P reuse_buffers | ratio | raw pipelined (ref.) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {_fmt_size(r['size_bytes'])} "
            f"| {r['raw_oneway_MBps_median']:.0f} / {r['raw_oneway_MBps_min']:.0f} "
            f"| {r['p2p_oneway_MBps_median']:.0f} / {r['p2p_oneway_MBps_min']:.0f} "
            f"| {r['throughput_ratio']:.2f} "
            f"| {r['p2p_reuse_oneway_MBps_median']:.0f} / {r['p2p_reuse_oneway_MBps_min']:.0f} "
            f"| {r['throughput_ratio_reuse']:.2f} "
            f"| {r['rawpipe_oneway_MBps_median']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="tiny run (harness check)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--inflight", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    repeats = args.repeats or (2 if args.quick else 7)
    iters = args.iters or (5 if args.quick else 60)
    results = run_world(
        bench_rank, 2, free_port(), sizes, repeats, iters, args.inflight, timeout_s=1800
    )
    for rank, outcome in results.items():
        if outcome[0] != "ok":
            print(f"rank {rank} failed: {outcome}", file=sys.stderr)
            return 1
    rows = summarize(results[0][1], results[1][1], args.inflight)
    overhead = overhead_us(iters=2000 if args.quick else 20000, repeats=2 if args.quick else 7)
    targets = {
        "throughput_ratio_min": 0.9,
        "added_latency_us_per_call_max": 20.0,
        "throughput_met": all(r["throughput_ratio"] >= 0.9 for r in rows),
        "latency_met": all(r["added_latency_us_per_call"] <= 20.0 for r in rows),
        "throughput_met_reuse": all(r["throughput_ratio_reuse"] >= 0.9 for r in rows),
        "latency_met_reuse": all(r["added_latency_us_per_call_reuse"] <= 20.0 for r in rows),
        "latency_met_no_io": max(
            overhead["attention_added_us_per_call"], overhead["ffn_added_us_per_call"]
        )
        <= 20.0,
    }
    doc = {
        "benchmark": "afd-core P2P connector vs raw gloo send/recv",
        "config": {
            "sizes_bytes": sizes,
            "repeats": repeats,
            "iters_per_repeat": iters,
            "inflight": args.inflight,
            "hidden": HIDDEN,
            "dtype": "float32",
            "quick": args.quick,
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "platform": platform.platform(),
        },
        "rows": rows,
        "overhead_no_io": overhead,
        "targets": targets,
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(table(rows))
    print(
        f"\nconnector cost per call without I/O ({overhead['tokens']} tokens): Attention "
        f"{overhead['attention_added_us_per_call']:.1f} µs, FFN "
        f"{overhead['ffn_added_us_per_call']:.1f} µs (raw null send+recv pair "
        f"{overhead['raw_pair_us']:.1f} µs)"
    )
    print(
        f"\nthroughput >= 0.9x raw: {targets['throughput_met']} "
        f"(reuse_buffers: {targets['throughput_met_reuse']}); "
        f"added latency <= 20 µs/call: {targets['latency_met']} "
        f"(reuse_buffers: {targets['latency_met_reuse']}; no I/O: {targets['latency_met_no_io']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
