"""``afd bench --profile``: measure this host's costs and write a profile ``afd plan`` reads.

What is measured (each a median over repeats; the GEMM and memory rates on one torch thread,
what each role gets under ``afd bench``'s placement):

* **GEMM rate** at the decode shapes of a MoE expert (``tokens x hidden`` by ``hidden x inter``,
  fp32) for several token counts. The largest achieved FLOP/s is the profile's ``peak_flops.fp32``
  (efficiency 1: it is already an achieved rate). These weights (2 MiB) stay in cache: the
  1-token GEMM's weight reads are recorded as the cache-resident rate, not used as memory
  bandwidth.
* **Memory bandwidth**: a copy of a buffer far larger than any cache (256 MiB; read + write
  bytes over the time): ``memory_bandwidth``, what a real model's weight and KV reads see.
* **Link**: raw gloo send/recv round trips between two spawned processes over loopback (what
  the P2P connector's data group is on one host): half the small-message round trip is
  ``link_latency``; the large message's extra time gives ``link_bandwidth``.
* **Wake-up**: a thread handing an event to another and waiting for the answer (what a stage
  turn and an FFN service reply cost beyond the bytes): half its round trip, the profile's
  ``message_overhead`` when the engine runs below are skipped.
* ``memory_bytes``: this host's RAM.
* ``messages_use_compute``: true (a message's software runs on the cores of the role that sends
  or receives it).
* ``compute_overlaps_memory``: false (one core streams a layer's weights and computes on them
  in turn: a decode GEMM's time is about the two added, not the larger).
* **Engine software** (:func:`measure_engine`, unless ``--no-engine``): vLLM itself on the
  tiny Qwen3-MoE, with the thread placement ``afd bench`` uses: plain vLLM at batch 1 and 16
  and an AFD pair (1:1, gate on FFN) at batch 1, each a median TPOT. What the model's layer
  terms (on the rates above) do not explain is the engine's: the plain runs give
  ``step_overhead`` (per decode step) and ``sequence_overhead`` (per sequence per step), the
  pair's excess over plain gives ``message_overhead`` (the software cost of one message of the
  AFD exchange: the proxy, the connector, the FFN service loop and the wake-ups of both roles;
  two per MoE layer at 1:1).
  On a host with fewer than three cores, AFD 1:2 (gate on Attention) at batch 1 too: three
  engines on the cores, its stretch over the model's unshared step gives
  ``oversubscription_cost`` (afd-plan's time sharing; ``host_cores`` is this host's CPUs).

The written profile validates with :func:`afd_plan.profile_from_mapping` before it is written;
``afd plan`` uses the file at :func:`afd_plan.calibrated_profile_path` by default.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch

__all__ = [
    "ENGINE_BATCHES",
    "Calibration",
    "EngineCalibration",
    "GemmPoint",
    "calibrate",
    "engine_overheads",
    "measure_engine",
    "measure_gemm",
    "measure_link",
    "measure_memory_bandwidth",
    "measure_wakeup",
    "profile_mapping",
    "write_profile",
]

#: The decode GEMM of the tiny wide checkpoint's experts (hidden 1024, moe_intermediate 512).
GEMM_SHAPE = (1024, 512)
GEMM_TOKENS = (1, 4, 16, 64, 256)
LINK_SIZES = (4 << 10, 4 << 20)


@dataclass(frozen=True)
class GemmPoint:
    tokens: int
    seconds: float
    flops_per_s: float
    weight_bytes_per_s: float


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured (all rates achieved, not peak)."""

    gemm: tuple[GemmPoint, ...]
    memory_bandwidth: float
    link_rtt_s: dict[int, float]
    link_latency_s: float
    link_bandwidth: float
    wakeup_s: float
    memory_bytes: int
    threads: int


def _median_time(fn: Callable[[], object], repeats: int, inner: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def measure_gemm(
    tokens: Sequence[int] = GEMM_TOKENS,
    shape: tuple[int, int] = GEMM_SHAPE,
    *,
    repeats: int = 5,
    inner: int = 20,
) -> tuple[GemmPoint, ...]:
    """fp32 ``x[t, h] @ w[h, i]`` per token count ``t``: time, FLOP/s, weight bytes/s."""
    hidden, inter = shape
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(hidden, inter, generator=gen)
    points = []
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, hidden, generator=gen)
            out = torch.empty(t, inter)
            seconds = _median_time(functools.partial(torch.mm, x, weight, out=out), repeats, inner)
            points.append(
                GemmPoint(
                    tokens=t,
                    seconds=seconds,
                    flops_per_s=2.0 * t * hidden * inter / seconds,
                    weight_bytes_per_s=weight.numel() * weight.element_size() / seconds,
                )
            )
    return tuple(points)


def measure_memory_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5) -> float:
    """Bytes read plus written per second by a copy of ``nbytes`` (B/s)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), repeats, 1)
    return 2.0 * nbytes / seconds


def _link_rank(rank: int, port: int, sizes: Sequence[int], repeats: int) -> dict[int, float]:
    """One side of the raw gloo round trips (spawned by :func:`measure_link`)."""
    import torch.distributed as dist
    from afd_core.connector.p2p.groups import make_process_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    group = make_process_group("gloo", store, rank, 2, timedelta(seconds=60))
    peer = 1 - rank
    out: dict[int, float] = {}
    for size in sizes:
        buf = torch.zeros(size // 4)
        samples = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            if rank == 0:
                group.send([buf], peer, 0).wait()
                group.recv([buf], peer, 1).wait()
            else:
                group.recv([buf], peer, 0).wait()
                group.send([buf], peer, 1).wait()
            if i:  # the first is the warm-up
                samples.append(time.perf_counter() - t0)
        out[size] = statistics.median(samples)
    return out


def measure_link(
    sizes: Sequence[int] = LINK_SIZES, *, repeats: int = 50
) -> tuple[dict[int, float], float, float]:
    """Round trip per message size between two processes; (rtts, latency s, bandwidth B/s)."""
    from afd_core.testing import free_port, run_world

    results = run_world(_link_rank, 2, free_port(), tuple(sizes), repeats, timeout_s=300)
    outcome = results[0]
    if outcome[0] != "ok":
        raise RuntimeError(f"link measurement failed: {outcome} / {results[1]}")
    rtts: dict[int, float] = outcome[1]
    small, large = min(rtts), max(rtts)
    latency = rtts[small] / 2
    extra = max(rtts[large] / 2 - latency, 1e-9)
    return rtts, latency, (large - small) / extra


def measure_wakeup(repeats: int = 2000) -> float:
    """Half the round trip of a turn handed to another thread and handed back (s)."""
    ping, pong = threading.Event(), threading.Event()

    def answer() -> None:
        for _ in range(repeats):
            ping.wait()
            ping.clear()
            pong.set()

    helper = threading.Thread(target=answer, daemon=True)
    helper.start()
    t0 = time.perf_counter()
    for _ in range(repeats):
        ping.set()
        pong.wait()
        pong.clear()
    elapsed = time.perf_counter() - t0
    helper.join(10)
    return elapsed / repeats / 2


#: Batches of the plain engine runs (one step-bound, one with many sequences).
ENGINE_BATCHES: Final[tuple[int, int]] = (1, 16)


#: The deployment whose TPOT prices a host's oversubscription: AFD 1:2 (gate on Attention) at
#: batch 1, three engines (one Attention rank, two FFN ranks).
SHARED_HOST_ENGINES: Final[int] = 3


@dataclass(frozen=True)
class EngineCalibration:
    """Median TPOTs (s) of vLLM on the tiny checkpoint ``model``: plain by batch, the AFD 1:1
    pair (gate on FFN) at batch 1, and, on a host with fewer cores than
    :data:`SHARED_HOST_ENGINES`, AFD 1:2 (gate on Attention) at batch 1 (``shared_tpot_s``;
    ``None`` when not measured); ``max_tokens`` per request."""

    model: str
    max_tokens: int
    plain_tpot_s: dict[int, float]
    afd_tpot_s: float
    shared_tpot_s: float | None = None


def measure_engine(
    *,
    cache_dir: Path | None,
    log_dir: Path,
    quick: bool = False,
    progress: Callable[[str], None] = print,
) -> EngineCalibration:
    """Plain vLLM at :data:`ENGINE_BATCHES`, an AFD 1:1 pair at batch 1 and, with fewer
    cores than :data:`SHARED_HOST_ENGINES`, AFD 1:2 (gate on Attention) at batch 1, as
    ``afd bench`` starts them (one thread per role, passive waits)."""
    from afd_models.demo.bench import (
        PLACEMENT_ENV,
        BenchConfig,
        bench_options,
        run_setup,
        setup_name,
    )
    from afd_models.demo.servers import afd_servers, plain_server
    from afd_models.demo.tiny import TinySpec, ensure_tiny_checkpoint

    cfg = BenchConfig(
        batch_sizes=ENGINE_BATCHES,
        repeats=1 if quick else 3,
        quantized=False,
        stages=False,
        log_dir=log_dir,
        cache_dir=cache_dir,
    )
    model = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), cache_dir)
    options = bench_options(cfg, PLACEMENT_ENV)
    progress("calibrating: plain vLLM (engine step and per-sequence costs)")
    plain = plain_server(model, log_dir=log_dir, options=options, name="profile-plain")
    rows = run_setup([plain], plain, ENGINE_BATCHES, cfg, "plain")

    def afd_tpot_s(num_ffn_ranks: int, gate_on_attention: bool, prefix: str) -> float:
        """TPOT (s) at batch 1 of an AFD ``1:num_ffn_ranks`` deployment."""
        attention, ffns = afd_servers(
            model,
            log_dir=log_dir,
            options=options,
            num_attention_ranks=1,
            num_ffn_ranks=num_ffn_ranks,
            gate_on_attention=gate_on_attention,
            prefix=prefix,
        )
        setup = setup_name(1, num_ffn_ranks, gate_on_attention)
        (row,) = run_setup([attention, *ffns], attention, (1,), cfg, setup)
        return row.tpot_ms / 1e3

    progress("calibrating: an AFD 1:1 pair (the exchange's per-message cost)")
    afd = afd_tpot_s(1, False, "profile-1a1f")
    shared: float | None = None
    if (os.cpu_count() or 1) < SHARED_HOST_ENGINES:
        progress("calibrating: AFD 1:2, three engines on this host's cores (oversubscription)")
        shared = afd_tpot_s(2, True, "profile-1a2f")
    return EngineCalibration(
        model=str(model),
        max_tokens=cfg.max_tokens,
        plain_tpot_s={r.batch: r.tpot_ms / 1e3 for r in rows},
        afd_tpot_s=afd,
        shared_tpot_s=shared,
    )


def engine_overheads(base: Mapping[str, Any], eng: EngineCalibration) -> dict[str, float]:
    """``step_overhead``, ``sequence_overhead`` and ``message_overhead`` (s) from ``eng``: what
    afd-plan's layer terms on the ``base`` profile leave of the measured TPOTs (each at least 0);
    with ``eng.shared_tpot_s`` on a host of ``base["host_cores"]`` fewer than three, also
    ``oversubscription_cost``.

    Plain at batches ``lo < hi``: ``TPOT(b) - model(b) = step + b * sequence``, two equations.
    The 1:1 pair at batch 1, priced with those and no per-message cost, falls short of its
    measurement by ``2 * L_moe`` messages (one each way per MoE layer). The 1:2 deployment,
    priced with all three and no time sharing (``T0``), measured ``T``: the stretch
    ``T / T0 = 1 + cost * (3 - cores) / cores`` gives the cost (at least 0)."""
    from afd_plan import Candidate, Workload, load_model_shape, predict, profile_from_mapping

    from afd_models.demo.bench_plan import PROMPT_TOKENS

    shape = load_model_shape(eng.model)
    work = Workload(input_len=PROMPT_TOKENS, output_len=eng.max_tokens)
    hw = profile_from_mapping({**base, "message_overhead": 0.0}, origin="calibration")
    lo, hi = min(eng.plain_tpot_s), max(eng.plain_tpot_s)
    left = {
        b: eng.plain_tpot_s[b] - predict(shape, work, hw, Candidate(1, 0, 1, b)).tpot_s
        for b in (lo, hi)
    }
    sequence = max((left[hi] - left[lo]) / (hi - lo), 0.0)
    step = max(left[lo] - lo * sequence, 0.0)
    hw = hw.with_overrides(step_overhead=step, sequence_overhead=sequence)
    afd = predict(shape, work, hw, Candidate(1, 1, 1, 1)).tpot_s
    message = max((eng.afd_tpot_s - afd) / (2 * shape.num_moe_layers), 0.0)
    out = {"step_overhead": step, "sequence_overhead": sequence, "message_overhead": message}
    cores = int(base.get("host_cores", 0))
    if eng.shared_tpot_s is not None and 0 < cores < SHARED_HOST_ENGINES:
        alone = hw.with_overrides(message_overhead=message, host_cores=0)
        t0 = predict(shape, work, alone, Candidate(1, 2, 1, 1)).tpot_s
        extra = (SHARED_HOST_ENGINES - cores) / cores
        out["oversubscription_cost"] = max((eng.shared_tpot_s / t0 - 1.0) / extra, 0.0)
    return out


#: Torch threads of the rate measurements: one, as ``afd bench`` places every role (one
#: OpenMP thread per worker), so a profile "device" is what one role gets.
CALIBRATION_THREADS: Final[int] = 1


def calibrate(*, quick: bool = False, progress: Callable[[str], None] = print) -> Calibration:
    """Run every measurement of the module docstring (``quick``: fewer repeats); the GEMM and
    memory rates on :data:`CALIBRATION_THREADS` torch thread(s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CALIBRATION_THREADS)
    try:
        progress("calibrating: GEMM rate")
        gemm = measure_gemm(repeats=3 if quick else 7, inner=5 if quick else 20)
        progress("calibrating: memory bandwidth")
        bandwidth_mem = measure_memory_bandwidth(
            (64 if quick else 256) << 20, repeats=3 if quick else 7
        )
    finally:
        torch.set_num_threads(threads)
    progress("calibrating: gloo round trips between two processes")
    rtts, latency, bandwidth = measure_link(repeats=10 if quick else 100)
    progress("calibrating: thread wake-up")
    wakeup = measure_wakeup(200 if quick else 5000)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Calibration(
        gemm=gemm,
        memory_bandwidth=bandwidth_mem,
        link_rtt_s=rtts,
        link_latency_s=latency,
        link_bandwidth=bandwidth,
        wakeup_s=wakeup,
        memory_bytes=int(memory),
        threads=CALIBRATION_THREADS,
    )


def profile_mapping(cal: Calibration, *, name: str = "calibrated") -> dict[str, Any]:
    """The :mod:`afd_plan.hardware` profile of ``cal`` (achieved rates, efficiencies 1)."""
    peak = max(p.flops_per_s for p in cal.gemm)
    hidden, inter = GEMM_SHAPE
    return {
        "name": name,
        "source": (
            f"afd bench --profile on this host ({os.cpu_count()} CPUs, {cal.threads} torch "
            f"thread(s)): fp32 GEMM {hidden}x{inter} at {[p.tokens for p in cal.gemm]} tokens, "
            f"a large copy, gloo loopback round trips {sorted(cal.link_rtt_s)} bytes, thread wake-up"
        ),
        "description": (
            f"measured {time.strftime('%Y-%m-%d %H:%M:%S')}; rates are achieved ones "
            "(efficiencies 1); memory bandwidth of a copy larger than any cache"
        ),
        "peak_flops": {"fp32": peak},
        "memory_bandwidth": cal.memory_bandwidth,
        "memory_bytes": float(cal.memory_bytes),
        "link_bandwidth": cal.link_bandwidth,
        "link_latency": cal.link_latency_s,
        "message_overhead": cal.wakeup_s,
        "compute_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "link_efficiency": 1.0,
        # The cores that compute also run the exchange's software (proxy, connector, service
        # loop, wake-ups): stages cannot hide it (afd-plan's messages_use_compute).
        "messages_use_compute": True,
        # One core streams the weights and computes on them in turn (afd-plan adds the two).
        "compute_overlaps_memory": False,
        # Every role's engine runs on this host's cores (afd-plan's time sharing).
        "host_cores": os.cpu_count() or 1,
    }


def write_profile(
    cal: Calibration, out: Path, engine: EngineCalibration | None = None
) -> dict[str, Any]:
    """Validate ``cal``'s profile (with ``engine``'s overheads, :func:`engine_overheads`) with
    afd-plan, write it to ``out`` (JSON; the raw measurements beside it in
    ``<stem>.measurements.json``), return it."""
    from afd_plan import profile_from_mapping

    profile = profile_mapping(cal)
    if engine is not None:
        profile.update(engine_overheads(profile, engine))
        profile["source"] += (
            f"; vLLM on {Path(engine.model).name}: plain at batches "
            f"{sorted(engine.plain_tpot_s)}, AFD 1:1 at batch 1 (engine and exchange overheads)"
            + (
                ""
                if engine.shared_tpot_s is None
                else ", AFD 1:2 gate on Attention at batch 1 (oversubscription)"
            )
        )
    profile_from_mapping(profile, origin="calibration")  # refuses before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    raw = out.with_name(out.stem + ".measurements.json")
    measured = {**asdict(cal), "engine": None if engine is None else asdict(engine)}
    raw.write_text(json.dumps(measured, indent=2, default=str) + "\n")
    return profile
