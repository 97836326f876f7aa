"""Benchmark: the P2P connector against raw torch.distributed gloo send/recv (same run).

Two processes on one host (Attention world rank 0, FFN world rank 1, gloo on CPU). Payload:
``hidden_states`` of ``[tokens, 1024]`` float32 (4 KiB per token). The traffic has the shape of
serving: a *step* is one control message and then ``LAYERS`` layers, one transfer each way per
layer (one stage). Every connector kind and the raw baselines run in each of ``--repeats`` (33)
interleaved repeats (the order rotates per repeat):

* Same process groups: each connector kind's raw baseline runs on that connector's own gloo
  groups (data on its data group, the step-aligning sync on its control group), so a compared
  pair shares sockets and gloo I/O threads. Two gloo groups of one process can differ by tens
  of percent for identical code (where the kernel places each group's I/O thread), which a
  baseline on a separate group would attribute to the connector.
* round-trip latency per layer: the Attention side sends, the FFN side sends the same bytes back.
  P2P: ``send_dispatch`` + ``recv_combine`` / ``recv_dispatch`` + ``send_combine``;
  raw: ``send`` + ``recv``, each receive posted when the call is made,
  into one preallocated buffer per side that every layer overwrites (the straightforward use of
  the API, the baseline of the targets). Reference "raw, connector pattern": the FFN side posts
  each receive a layer early and both sides receive into two buffers in turn, as the connector
  must (it may not overwrite a tensor its caller still holds); the difference to it is the
  connector's own cost.
* one-way throughput: the Attention side sends a whole step back to back; the FFN side times
  from the start of the step (P2P: before ``recv_control``, so the control message is paid) until
  every layer arrived (16 steps timed together per repeat up to 256 KiB, 4 up to 4 MiB, 2
  above), with one blocking receive call per transfer (the service-loop pattern: P2P payloads
  are dropped once received, raw receives land in buffers allocated once); replies go back
  untimed. Reference "raw pipelined": every receive posted at once.

Connector kinds: ``p2p`` (defaults: recycled receive buffers, receives posted ahead),
``p2p_reuse`` (``reuse_buffers``: kept buffers) and ``p2p_late`` (``recv_ahead`` off). Their raw
baselines: ``raw`` (with the references ``raw_ahead`` and ``rawpipe``) on ``p2p``'s groups,
``raw_reuse`` and ``raw_late`` on the other two connectors' groups.

Also measured in-process (no I/O, free of scheduler noise): the connector's own cost per call
(``send_dispatch`` + ``recv_combine`` and ``recv_dispatch`` + ``send_combine``
against a null process group, minus the same null ``send``/``recv`` calls plus the receive-buffer
allocation the raw path also needs).

Interleaved pairs (the latency verdict): in a kind of its own, every layer makes one P2P round
trip and one raw round trip on the same groups, which goes first alternating, and the raw one
receives into the buffer the connector handed out last on that side (same memory: the pair then
differs only in the connector's code and posting order). The control kind ``placement`` pairs two
raw round trips on different buffers the same way; its median difference is what a different
buffer alone moves a pair by. Pairs run four times the blocks' steps above 1 MiB.

Reported: median of the per-repeat medians and P99 over all samples (latency); median and minimum
over repeats (throughput); for the paired figures (interleaved pairs, throughput ratios) a 95 %
bootstrap interval that resamples whole repeats (seeded). Block comparisons are paired by repeat
(the kinds of one repeat ran back to back), which cancels the machine's slow drift: the added
round-trip time is the median over repeats of (RTT_p2p - RTT_raw), the throughput ratio the median
of (MB/s_p2p / MB/s_raw). A round trip makes four calls on each path (P2P:
``send_dispatch``, ``recv_dispatch``, ``send_combine``, ``recv_combine``; raw: two
sends, two receives), so the added latency per call is the added RTT / 4; per transfer (one
direction, a send and a receive call) it is twice that.

Usage: ``python bench_p2p.py --out results.json [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.testing import free_ports, run_world
from afd_core.topology import AFDTopology

HIDDEN = 1024
BYTES_PER_TOKEN = HIDDEN * 4
LAYERS = 48  # Qwen3-30B-A3B's layer count: one step's control message is amortised as in serving
FULL_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
QUICK_SIZES = [4 << 10, 64 << 10]
RAW_TAG, RAW_TAG_BACK = 11, 12
CONNECTOR_EXTRA: dict[str, dict[str, bool]] = {
    "p2p": {},
    "p2p_reuse": {"reuse_buffers": True},
    "p2p_late": {"recv_ahead": False},
}
#: Each connector kind's raw baseline, measured on that connector's own process groups.
RAW_BASE = {"p2p": "raw", "p2p_reuse": "raw_reuse", "p2p_late": "raw_late"}
#: kind -> the connector whose groups it runs on (the raw kinds included).
GROUP_OF = {
    "raw": "p2p",
    "raw_ahead": "p2p",
    **{kind: kind for kind in CONNECTOR_EXTRA},
    **{raw: kind for kind, raw in RAW_BASE.items() if raw != "raw"},
}
KINDS = ("raw", "raw_ahead", "p2p", "raw_reuse", "p2p_reuse", "raw_late", "p2p_late")
#: Also in the rotation: ``p2p`` and ``raw`` round trips interleaved pair by pair (same memory),
#: and the control: two raw round trips on different buffers interleaved pair by pair.
ROTATION = (*KINDS, "interleaved", "placement")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


def _sync(pg: Any, rank: int) -> None:
    """A tiny round trip (on the measured connector's control group): both sides leave
    together (roughly)."""
    t = torch.zeros(1)
    if rank == 0:
        pg.send([t], 1, 99).wait()
        pg.recv([t], 1, 98).wait()
    else:
        pg.recv([t], 0, 99).wait()
        pg.send([t], 0, 98).wait()


def _raw_rtt(
    groups: tuple[Any, Any],
    rank: int,
    x: torch.Tensor,
    bufs: list[torch.Tensor],
    steps: int,
    ahead: bool,
) -> list[float]:
    """``steps`` x ``LAYERS`` raw round trips on ``groups`` (data, sync); ``ahead``: the
    connector's pattern (the FFN side posts each receive a layer early, both sides receive into
    two buffers in turn)."""
    pg, sync_pg = groups
    samples = []
    for _ in range(steps):
        _sync(sync_pg, rank)
        if rank == 0:
            for layer in range(LAYERS):
                y = bufs[layer % 2] if ahead else bufs[0]
                t0 = time.perf_counter()
                pg.send([x], 1, RAW_TAG).wait()
                pg.recv([y], 1, RAW_TAG_BACK).wait()
                samples.append(time.perf_counter() - t0)
        elif ahead:
            work = pg.recv([bufs[0]], 0, RAW_TAG)
            for layer in range(LAYERS):
                y = bufs[layer % 2]
                work.wait()
                if layer + 1 < LAYERS:
                    work = pg.recv([bufs[(layer + 1) % 2]], 0, RAW_TAG)
                pg.send([y], 0, RAW_TAG_BACK).wait()
        else:
            y = bufs[0]
            for _ in range(LAYERS):
                pg.recv([y], 0, RAW_TAG).wait()
                pg.send([y], 0, RAW_TAG_BACK).wait()
    return samples


def _p2p_rtt(conn: P2PConnector, rank: int, x: torch.Tensor, steps: int) -> list[float]:
    n = x.shape[0]
    samples = []
    payload = AFDPayload(x)
    for _ in range(steps):
        _sync(_groups(conn)[1], rank)
        if rank == 0:
            conn.send_control(AFDControlMessage(((n,),)))
            for layer in range(LAYERS):
                meta = AFDTransferMetadata(layer, 0, (n,))
                t0 = time.perf_counter()
                handle = conn.send_dispatch([payload], meta)
                conn.recv_combine(handle)
                samples.append(time.perf_counter() - t0)
        else:
            conn.recv_control()
            for layer in range(LAYERS):
                meta, (p,) = conn.recv_dispatch(layer, 0)
                conn.send_combine([p.hidden_states], meta)
                # A service loop is done with a payload once it replied: released, its buffer
                # is the next receive's (still in cache), as raw overwrites its one buffer.
                del p
    return samples


def _interleaved_rtt(
    conn: P2PConnector, rank: int, x: torch.Tensor, bufs: list[torch.Tensor], steps: int
) -> tuple[list[float], list[float]]:
    """``steps`` x ``LAYERS`` pairs of round trips, one through ``conn`` and one raw on its
    groups right after or before it (alternating per layer): the two of a pair run within a few
    ms of each other, so the machine's drift, which moves whole repeats by 10-30 %, cancels in
    their difference. Returns (P2P samples, raw samples), pair ``i`` at index ``i``.

    Same memory: each side's raw round trip receives into the buffer the connector handed out
    last on that side (before the first, ``bufs[0]``), so the two of a pair differ only in the
    connector's code and posting order, not in which pages back the receive buffer
    (:func:`_placement_rtt` measures what that alone moves a pair by). The raw side drops its
    reference before the connector's next call, so the connector's pool can hand that buffer
    out again."""
    pg, sync_pg = _groups(conn)
    n = x.shape[0]
    payload = AFDPayload(x)
    p2p_samples: list[float] = []
    raw_samples: list[float] = []
    last: torch.Tensor | None = None  # what the connector handed out last on this side
    for _ in range(steps):
        _sync(sync_pg, rank)
        if rank == 0:
            conn.send_control(AFDControlMessage(((n,),)))
        ctl = conn.recv_control() if rank == 1 else None
        for layer in range(LAYERS):
            for first in (layer % 2 == 0, layer % 2 == 1):
                if first:  # the connector's round trip
                    last = None
                    if rank == 0:
                        t0 = time.perf_counter()
                        last = conn.recv_combine(
                            conn.send_dispatch([payload], AFDTransferMetadata(layer, 0, (n,)))
                        )[0]
                        p2p_samples.append(time.perf_counter() - t0)
                    else:
                        assert ctl is not None
                        meta, (p,) = conn.recv_dispatch(layer, 0)
                        conn.send_combine([p.hidden_states], meta)
                        last = p.hidden_states
                        del p
                else:  # the raw round trip, as in _raw_rtt, into the connector's buffer
                    y = bufs[0] if last is None else last
                    sample = _raw_round_trip(pg, rank, x, y)
                    if rank == 0:
                        raw_samples.append(sample)
                    del y  # else it would keep the pool from handing the buffer out again
    return p2p_samples, raw_samples


def _placement_rtt(
    groups: tuple[Any, Any], rank: int, x: torch.Tensor, bufs: list[torch.Tensor], steps: int
) -> tuple[list[float], list[float]]:
    """Control for :func:`_interleaved_rtt`: pairs of two *raw* round trips that differ only
    in the receive buffer (``bufs[1]`` and ``bufs[0]``, the order alternating per layer).
    Identical code, so the median difference is what buffer placement alone moves a pair by:
    the error a comparison on different memory would make. Returns (``bufs[1]`` samples,
    ``bufs[0]`` samples)."""
    pg, sync_pg = groups
    a_samples: list[float] = []
    b_samples: list[float] = []
    for _ in range(steps):
        _sync(sync_pg, rank)
        for layer in range(LAYERS):
            for first in (layer % 2 == 0, layer % 2 == 1):
                sample = _raw_round_trip(pg, rank, x, bufs[1] if first else bufs[0])
                if rank == 0:
                    (a_samples if first else b_samples).append(sample)
    return a_samples, b_samples


def _raw_round_trip(pg: Any, rank: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One raw round trip (the Attention side sends ``x`` and receives into ``y``; the FFN
    side receives into ``y`` and sends it back); its time on the Attention side, else 0.0."""
    if rank == 0:
        t0 = time.perf_counter()
        pg.send([x], 1, RAW_TAG).wait()
        pg.recv([y], 1, RAW_TAG_BACK).wait()
        return time.perf_counter() - t0
    pg.recv([y], 0, RAW_TAG).wait()
    pg.send([y], 0, RAW_TAG_BACK).wait()
    return 0.0


def _raw_oneway(
    groups: tuple[Any, Any],
    rank: int,
    x: torch.Tensor,
    bufs: list[torch.Tensor],
    pipelined: bool,
    steps: int,
) -> float:
    """Seconds the FFN side took to receive ``steps`` steps (0.0 on the Attention side)."""
    return sum(_raw_oneway_step(groups, rank, x, bufs, pipelined) for _ in range(steps))


def _raw_oneway_step(
    groups: tuple[Any, Any], rank: int, x: torch.Tensor, bufs: list[torch.Tensor], pipelined: bool
) -> float:
    pg, sync_pg = groups
    _sync(sync_pg, rank)
    if rank == 0:
        works = [pg.send([x], 1, 200 + i) for i in range(LAYERS)]
        for w in works:
            w.wait()
        for i in range(LAYERS):
            pg.recv([bufs[i]], 1, 300 + i).wait()
        return 0.0
    t0 = time.perf_counter()
    if pipelined:
        works = [pg.recv([bufs[i]], 0, 200 + i) for i in range(LAYERS)]
        for w in works:
            w.wait()
    else:
        for i in range(LAYERS):
            pg.recv([bufs[i]], 0, 200 + i).wait()
    elapsed = time.perf_counter() - t0
    for i in range(LAYERS):
        pg.send([bufs[i]], 0, 300 + i).wait()
    return elapsed


def _p2p_oneway(conn: P2PConnector, rank: int, x: torch.Tensor, steps: int) -> float:
    """Seconds the FFN side took to receive ``steps`` steps (0.0 on the Attention side)."""
    return sum(_p2p_oneway_step(conn, rank, x) for _ in range(steps))


def _p2p_oneway_step(conn: P2PConnector, rank: int, x: torch.Tensor) -> float:
    n = x.shape[0]
    _sync(_groups(conn)[1], rank)
    if rank == 0:
        conn.send_control(AFDControlMessage(((n,),)))
        payload = AFDPayload(x)
        handles = [
            conn.send_dispatch([payload], AFDTransferMetadata(layer, 0, (n,)))
            for layer in range(LAYERS)
        ]
        for h in handles:
            conn.recv_combine(h)
        return 0.0
    t0 = time.perf_counter()
    ctl = conn.recv_control()
    for layer in range(LAYERS):
        # Dropped once received, as a service loop drops a payload once it computed on it.
        conn.recv_dispatch(layer, 0)
    elapsed = time.perf_counter() - t0
    for layer in range(LAYERS):
        conn.send_combine([x], ctl.transfer_metadata(layer, 0))
    return elapsed


def _groups(conn: P2PConnector) -> tuple[Any, Any]:
    """The connector's (data, control) gloo groups: its raw baseline runs on the same ones.
    The sync's tags (98, 99) and the raw tags lie outside the tags a one-stage step uses."""
    return conn._data_pg, conn._ctl_pg


def _steps_for(size: int, quick: bool) -> int:
    """Round-trip steps per repeat: ``LAYERS`` samples each, fewer for the largest payloads."""
    if quick:
        return 1
    return 2 if size <= 1 << 20 else 1


def _pair_steps_for(size: int, quick: bool) -> int:
    """Interleaved-pair steps per repeat (P2P against raw, and the placement control): the
    latency verdict rests on them, and above 1 MiB a pair's difference spreads over hundreds
    of µs, so they get four times the blocks' steps there (the median's interval narrows with
    the square root of the pairs)."""
    steps = _steps_for(size, quick)
    return steps if quick or size <= 1 << 20 else 4 * steps


def _tp_steps_for(size: int, quick: bool) -> int:
    """One-way steps per repeat (timed together): a step of small payloads lasts only a few ms,
    too short for one timing to mean much on a shared host (with 4 steps per repeat the paired
    ratio's interquartile range at 4-64 KiB spanned about 0.7-1.5 on this 2-core VM)."""
    if quick:
        return 1
    if size <= 256 << 10:
        return 16
    return 4 if size <= 4 << 20 else 2


def bench_rank(
    rank: int, ports: tuple[int, ...], sizes: list[int], repeats: int, quick: bool
) -> Any:
    torch.set_num_threads(1)
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)
    conns: dict[str, P2PConnector] = {}
    # One session (store port) per connector: the FFN rank of a live session beats a heartbeat,
    # and a second claimant of that rank on the same store is refused (as a stray FFN would be).
    for (kind, extra), port in zip(CONNECTOR_EXTRA.items(), ports, strict=True):
        cfg = AFDConfig(
            role=role,
            port=port,
            timeout_s=120.0,
            startup_timeout_s=60.0,  # a failed start surfaces well inside the test's bound
            connector_extra_config=extra,
        )
        conns[kind] = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=LAYERS)
        conns[kind].init()
    # As vLLM does after engine start-up (vllm.utils.gc_utils.freeze_gc_heap): objects that live
    # for the whole run leave the collector's scans, so a collection pauses for what is new.
    gc.collect()
    gc.freeze()
    out: dict[str, Any] = {}
    for size in sizes:
        n = size // BYTES_PER_TOKEN
        x = torch.randn(n, HIDDEN)
        steps = _steps_for(size, quick)
        pair_steps = _pair_steps_for(size, quick)
        tp_steps = _tp_steps_for(size, quick)
        # The raw baselines receive into buffers allocated (and paged in) once per size.
        bufs = [torch.zeros_like(x) for _ in range(LAYERS)]
        rec: dict[str, Any] = {f"{k}_{m}": [] for k in (*KINDS, "rawpipe") for m in ("rtt", "tp")}
        for name in ("interleaved_p2p", "interleaved_raw", "placement_a", "placement_b"):
            rec[f"{name}_rtt"] = []
        for conn in conns.values():  # warm-up every path
            _raw_rtt(_groups(conn), rank, x, bufs, 1, False)
            _p2p_rtt(conn, rank, x, 1)
        for rep in range(repeats):
            order = ROTATION[rep % len(ROTATION) :] + ROTATION[: rep % len(ROTATION)]
            for kind in order:
                if kind == "interleaved":
                    p2p_s, raw_s = _interleaved_rtt(conns["p2p"], rank, x, bufs, pair_steps)
                    rec["interleaved_p2p_rtt"].append(p2p_s)
                    rec["interleaved_raw_rtt"].append(raw_s)
                    continue
                if kind == "placement":
                    a_s, b_s = _placement_rtt(_groups(conns["p2p"]), rank, x, bufs, pair_steps)
                    rec["placement_a_rtt"].append(a_s)
                    rec["placement_b_rtt"].append(b_s)
                    continue
                conn = conns[GROUP_OF[kind]]
                if kind == "raw_ahead":
                    groups = _groups(conn)
                    rec["raw_ahead_rtt"].append(_raw_rtt(groups, rank, x, bufs, steps, True))
                    rec["rawpipe_tp"].append(_raw_oneway(groups, rank, x, bufs, True, tp_steps))
                elif kind.startswith("raw"):
                    groups = _groups(conn)
                    rec[f"{kind}_rtt"].append(_raw_rtt(groups, rank, x, bufs, steps, False))
                    rec[f"{kind}_tp"].append(_raw_oneway(groups, rank, x, bufs, False, tp_steps))
                else:
                    rec[f"{kind}_rtt"].append(_p2p_rtt(conn, rank, x, steps))
                    rec[f"{kind}_tp"].append(_p2p_oneway(conn, rank, x, tp_steps))
        rec["tp_steps"] = tp_steps
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
        conn._data_pg = conn._ctl_pg = _NullGroup()
    x = torch.randn(tokens, HIDDEN)
    meta = AFDTransferMetadata(0, 0, (tokens,))
    # One step's control message announces the count every measured call uses (the null group
    # delivers nothing, so the FFN side is given the message it would have received).
    control = AFDControlMessage(((tokens,),))
    attn.send_control(control)
    ffn._control = control
    payload = AFDPayload(x)
    null = _NullGroup()

    def attn_pair() -> None:
        attn.recv_combine(attn.send_dispatch([payload], meta))

    def ffn_pair() -> None:
        _, (p,) = ffn.recv_dispatch(0, 0)
        ffn.send_combine([p.hidden_states], meta)

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


P2P_KINDS = tuple(CONNECTOR_EXTRA)
TABLE_KINDS = ("p2p", "p2p_reuse")  # p2p_late (recv_ahead off) is in the JSON only
# One-way: raw_ahead's slot measures the reference with every receive posted at once.
TP_KINDS = tuple("rawpipe" if k == "raw_ahead" else k for k in KINDS)
RTT_KINDS = KINDS
LATENCY_TARGET_US = 20.0
CALLS_PER_RTT = 4
THROUGHPUT_TARGET = 0.9


def paired_added_us(row: dict[str, Any], kind: str, base: str) -> float:
    """Median over repeats of the round-trip time ``kind`` added over ``base`` (µs)."""
    return statistics.median(
        p - b
        for p, b in zip(
            row[f"{kind}_rtt_us_per_repeat"], row[f"{base}_rtt_us_per_repeat"], strict=True
        )
    )


def paired_ratio(row: dict[str, Any], kind: str, base: str) -> tuple[float, float, float]:
    """Median over repeats of ``kind``'s one-way throughput relative to ``base``, and its 95 %
    bootstrap interval (over repeats)."""
    ratios = [
        [p / b]
        for p, b in zip(
            row[f"{kind}_oneway_MBps_per_repeat"],
            row[f"{base}_oneway_MBps_per_repeat"],
            strict=True,
        )
    ]
    return _median_ci(ratios)


def _pair_diffs_us(first: list[list[float]], second: list[list[float]]) -> list[list[float]]:
    """Per repeat, the differences (µs) of interleaved pairs (``first[r][i] - second[r][i]``)."""
    return [
        [(p - r) * 1e6 for p, r in zip(ps, rs, strict=True)]
        for ps, rs in zip(first, second, strict=True)
    ]


def _median_ci(per_repeat: list[list[float]], resamples: int = 400) -> tuple[float, float, float]:
    """Median over all pairs, and its 95 % bootstrap interval: repeats are resampled whole
    (pairs within a repeat are not independent), seeded, so a result file reproduces."""
    flat = [v for rep in per_repeat for v in rep]
    rng = random.Random(0)
    medians = sorted(
        statistics.median(v for rep in rng.choices(per_repeat, k=len(per_repeat)) for v in rep)
        for _ in range(resamples)
    )
    return (
        statistics.median(flat),
        medians[int(0.025 * (resamples - 1))],
        medians[int(0.975 * (resamples - 1))],
    )


def summarize(attn: dict[str, Any], ffn: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for size_text in attn:
        size = int(size_text)
        a, f = attn[size_text], ffn[size_text]
        row: dict[str, Any] = {"size_bytes": size}
        for kind in RTT_KINDS:
            per_rep = [statistics.median(s) * 1e6 for s in a[f"{kind}_rtt"]]
            flat = [v for s in a[f"{kind}_rtt"] for v in s]
            row[f"{kind}_rtt_us_per_repeat"] = per_rep
            row[f"{kind}_rtt_us_median"] = statistics.median(per_rep)
            row[f"{kind}_rtt_us_p99"] = _percentile(flat, 99) * 1e6
        for kind in TP_KINDS:
            tps = [size * LAYERS * f["tp_steps"] / t / 1e6 for t in f[f"{kind}_tp"]]
            row[f"{kind}_oneway_MBps_per_repeat"] = tps
            row[f"{kind}_oneway_MBps_median"] = statistics.median(tps)
            row[f"{kind}_oneway_MBps_min"] = min(tps)
        for name, first, second in (
            ("p2p", "interleaved_p2p", "interleaved_raw"),
            ("placement", "placement_a", "placement_b"),
        ):
            per_repeat = _pair_diffs_us(a[f"{first}_rtt"], a[f"{second}_rtt"])
            median, low, high = _median_ci(per_repeat)
            row[f"{name}_added_us_per_call_interleaved"] = median / CALLS_PER_RTT
            row[f"{name}_added_us_per_call_interleaved_ci95"] = [
                low / CALLS_PER_RTT,
                high / CALLS_PER_RTT,
            ]
        for kind in ("interleaved_p2p", "interleaved_raw"):
            flat = [v * 1e6 for s in a[f"{kind}_rtt"] for v in s]
            row[f"{kind}_rtt_us_median"] = statistics.median(flat)
            row[f"{kind}_rtt_us_p99"] = _percentile(flat, 99)
        row["interleaved_pairs"] = sum(len(s) for s in a["interleaved_p2p_rtt"])
        for kind in P2P_KINDS:
            base = RAW_BASE[kind]
            added_rtt = paired_added_us(row, kind, base)
            row[f"{kind}_added_us_per_call"] = added_rtt / CALLS_PER_RTT
            row[f"{kind}_added_us_per_transfer"] = added_rtt / 2
            row[f"{kind}_added_us_per_call_vs_raw_ahead"] = (
                paired_added_us(row, kind, "raw_ahead") / CALLS_PER_RTT
            )
            ratio, low, high = paired_ratio(row, kind, base)
            row[f"{kind}_throughput_ratio"] = ratio
            row[f"{kind}_throughput_ratio_ci95"] = [low, high]
            row[f"{kind}_throughput_ratio_vs_pipelined"] = paired_ratio(row, kind, "rawpipe")[0]
        rows.append(row)
    return rows


def targets_met(rows: list[dict[str, Any]], overhead: dict[str, Any]) -> dict[str, Any]:
    """Per connector kind: every size within both targets (against the raw baseline)."""
    out: dict[str, Any] = {
        "throughput_ratio_min": THROUGHPUT_TARGET,
        "added_latency_us_per_call_max": LATENCY_TARGET_US,
        "latency_met_no_io": max(
            overhead["attention_added_us_per_call"], overhead["ffn_added_us_per_call"]
        )
        <= LATENCY_TARGET_US,
    }
    out["p2p_latency_met_interleaved"] = all(
        r["p2p_added_us_per_call_interleaved"] <= LATENCY_TARGET_US for r in rows
    )
    for kind in P2P_KINDS:
        out[f"{kind}_throughput_met"] = all(
            r[f"{kind}_throughput_ratio"] >= THROUGHPUT_TARGET for r in rows
        )
        out[f"{kind}_latency_met"] = all(
            r[f"{kind}_added_us_per_call"] <= LATENCY_TARGET_US for r in rows
        )
    return out


def _fmt_size(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _markdown(title: str, header: list[str], body: list[list[str]]) -> list[str]:
    """A titled markdown table (the lines, then a blank one between tables)."""
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _median_p99(r: dict[str, Any], kind: str) -> str:
    return f"{r[f'{kind}_rtt_us_median']:.0f} / {r[f'{kind}_rtt_us_p99']:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    rtt = _markdown(
        "Round-trip latency per layer, µs (median / P99); added per call = (P2P − raw) / 4, each"
        " connector kind against raw on its own process groups (the raw column: the default"
        " connector's):",
        [
            "size",
            "raw",
            "raw, connector pattern (ref.)",
            "P2P",
            "added",
            "P2P reuse_buffers",
            "added",
        ],
        [
            [_fmt_size(r["size_bytes"]), _median_p99(r, "raw"), _median_p99(r, "raw_ahead")]
            + [
                cell
                for kind in TABLE_KINDS
                for cell in (_median_p99(r, kind), f"{r[f'{kind}_added_us_per_call']:+.1f}")
            ]
            for r in rows
        ],
    )

    def ci(r: dict[str, Any], name: str) -> str:
        low, high = r[f"{name}_added_us_per_call_interleaved_ci95"]
        return f"{r[f'{name}_added_us_per_call_interleaved']:+.1f} [{low:+.1f}, {high:+.1f}]"

    pairs = _markdown(
        "Round trips interleaved pair by pair (P2P, then raw on the same groups into the buffer"
        " the connector handed out last, or the other way round): µs (median / P99); added per"
        " call = median over pairs of (P2P − raw) / 4 [95 % bootstrap interval]; control: two"
        " raw round trips on different buffers, interleaved the same way:",
        ["size", "raw", "P2P", "added", "pairs", "control: raw vs raw, other buffer"],
        [
            [
                _fmt_size(r["size_bytes"]),
                _median_p99(r, "interleaved_raw"),
                _median_p99(r, "interleaved_p2p"),
                ci(r, "p2p"),
                str(r["interleaved_pairs"]),
                ci(r, "placement"),
            ]
            for r in rows
        ],
    )

    def mbps(r: dict[str, Any], kind: str) -> str:
        return f"{r[f'{kind}_oneway_MBps_median']:.0f} / {r[f'{kind}_oneway_MBps_min']:.0f}"

    def ratio(r: dict[str, Any], kind: str) -> str:
        low, high = r[f"{kind}_throughput_ratio_ci95"]
        return f"{r[f'{kind}_throughput_ratio']:.2f} [{low:.2f}, {high:.2f}]"

    oneway = _markdown(
        "One-way throughput, MB/s (median / min over repeats); ratio = P2P / raw (each kind"
        " against raw on its own process groups) [95 % bootstrap interval]:",
        ["size", "raw", "raw pipelined (ref.)", "P2P", "ratio", "P2P reuse_buffers", "ratio"],
        [
            [_fmt_size(r["size_bytes"]), mbps(r, "raw"), mbps(r, "rawpipe")]
            + [cell for kind in TABLE_KINDS for cell in (mbps(r, kind), ratio(r, kind))]
            for r in rows
        ],
    )
    return "\n".join([*rtt, "", *pairs, "", *oneway])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="tiny run (harness check)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--sizes",
        default=None,
        help="comma-separated payload sizes in bytes (default: 4 KiB-16 MiB)",
    )
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    if args.sizes:
        sizes = [int(v) for v in args.sizes.split(",")]
        if any(v < BYTES_PER_TOKEN or v % BYTES_PER_TOKEN for v in sizes):
            parser.error(f"--sizes: each size must be a positive multiple of {BYTES_PER_TOKEN}")
    repeats = args.repeats or (2 if args.quick else 33)
    ports = free_ports(len(CONNECTOR_EXTRA))
    results = run_world(bench_rank, 2, ports, sizes, repeats, args.quick, timeout_s=1800)
    for rank, outcome in results.items():
        if outcome[0] != "ok":
            print(f"rank {rank} failed: {outcome}", file=sys.stderr)
            return 1
    rows = summarize(results[0][1], results[1][1])
    overhead = overhead_us(iters=2000 if args.quick else 20000, repeats=2 if args.quick else 7)
    targets = targets_met(rows, overhead)
    doc = {
        "benchmark": "afd-core P2P connector vs raw gloo send/recv",
        "config": {
            "sizes_bytes": sizes,
            "repeats": repeats,
            "layers_per_step": LAYERS,
            "rtt_steps_per_repeat": {str(s): _steps_for(s, args.quick) for s in sizes},
            "pair_steps_per_repeat": {str(s): _pair_steps_for(s, args.quick) for s in sizes},
            "oneway_steps_per_repeat": {str(s): _tp_steps_for(s, args.quick) for s in sizes},
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
        "p2p, round trips interleaved with raw: added latency <= "
        f"{LATENCY_TARGET_US:g} µs/call: {targets['p2p_latency_met_interleaved']}"
    )
    for kind in P2P_KINDS:
        print(
            f"{kind}: throughput >= {THROUGHPUT_TARGET}x raw: {targets[f'{kind}_throughput_met']}; "
            f"added latency <= {LATENCY_TARGET_US:g} µs/call: {targets[f'{kind}_latency_met']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
