"""``afd bench``: steady-state decode speed of AFD against plain vLLM on the tiny Qwen3-MoE.

One run measures, on this host:

* the raw gloo round trip of a hidden-state-sized message (``[batch, hidden]`` float32) between
  two processes: the transfer floor of one MoE-layer hop;
* the time per output token (TPOT) of plain vLLM and of an AFD pair (1 Attention : 1 FFN, gate
  on FFN) at each decode batch size, and of 2 Attention : 1 FFN (gate on FFN) at the largest one;
* with the router gate on the Attention role, the TPOT of 1 Attention : F FFN ranks at each batch
  size for each F of :attr:`BenchConfig.ffn_ranks` (F > 1 is expert parallelism: each FFN rank
  holds ``1/F`` of the routed experts; F = 1 always runs as the reference), and the payload bytes
  the Attention role sent per step: the sum over the FFN ranks of each rank's received
  ``bytes / steps`` (its ``afd_received_bytes_total`` / ``afd_steps_total`` on ``/metrics``), over the deployment's whole run
  (warm-up rounds and every batch size: the same requests for every F), with its ratio to F = 1;
* unless :attr:`BenchConfig.stages` is off, the TPOT of 1 Attention : 1 FFN (gate on FFN) with
  ``num_stages=2`` at each batch size of at least 2 (a one-request step runs one stage), against
  the one-stage ``afd 1:1`` row: the share of the transfer hidden is
  ``(TPOT_1 - TPOT_2) / (L x raw round trip)`` (target on a 2-core host: >= 50 % at batch 16).
  The stage deployments set vLLM's DBO token thresholds to 1 (``SPLIT_EVERY_STEP_ARGS``) so these
  small batches split at all (serving's defaults keep steps under 32 decode tokens whole). The
  same pair of rows is measured on the *wide* Qwen3-MoE (hidden 1024, 96 MiB of experts per MoE
  layer: weight-bound like a real model) with its own one-stage row, raw round trip and plain
  vLLM rows (``plain wide`` on one thread, ``plain wide (vLLM default threads)`` on every core:
  what the AFD pair's two cores are up against);
* unless :attr:`BenchConfig.quantized` is off, the TPOT of 1 Attention : 1 FFN (gate on FFN) with
  the FFN rank's quantized computes (:data:`QUANTIZED_SETUPS`: Layered on W8A8 experts, Mega on
  W4A8 per-channel experts) at each batch size, against the native fp32 ``afd 1:1`` row and
  plain vLLM of the same batch size, with the expert bytes the FFN rank reported against the
  same experts in bf16 (its ``afd_ffn_quantized_*`` metrics; their absence fails the run: the
  rank did not compute quantized). Every counter is read from the servers' ``/metrics`` after the
  last measurement, before they stop.

With :attr:`BenchConfig.plan_profile` every TPOT row is also predicted by afd-plan on that
profile (:mod:`afd_models.demo.bench_plan`): the result's ``"plan"``, printed last.

TPOT of one request is ``(t_last - t_first) / (max_tokens - 1)`` over its streamed chunks (the
decode phase only: prefill is before the first chunk); ``batch`` requests start together and run
``max_tokens`` tokens each (``ignore_eos``), so the engine decodes a batch of ``batch``
throughout; no two requests of a batch share a prompt (:func:`bench_prompts`). Each row is the
median over its requests and repeats, after one warm-up batch;
with :attr:`BenchConfig.starts` > 1 every deployment is started that many times, in rounds
(each round starts every deployment once, :func:`run_deployments`), and the row is the median
of the per-start medians (each kept as ``start_tpot_ms``).

Derived per TPOT row: ``TPOT_afd / TPOT_plain``, and the AFD overhead per MoE layer hop
``(TPOT_afd - TPOT_plain) / L`` against the raw round trip of that batch. Targets on a 2-core
host (issue "one data path"): ratio <= 1.5, overhead <= 3 x round trip.

Placement: the AFD roles and the plain reference run with :data:`PLACEMENT_ENV`: one OpenMP
thread per worker and passive OpenMP waits, so a role waiting for the other does not spin on the
core the other needs. Plain vLLM with its own default CPU threading (one worker, every core) is
measured as well and reported for reference (on a 2-core host it was slower than one thread).
"""

from __future__ import annotations

import datetime
import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from afd_models.demo.servers import (
    DEFAULT_ENGINE_ENV,
    EngineOptions,
    FFNStats,
    QuantReport,
    VLLMServer,
    afd_servers,
    parse_ffn_stats,
    parse_quantized,
    plain_server,
    split_every_step,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, TinyWidth, ensure_tiny_checkpoint

Progress = Callable[[str], None]

#: Thread placement for two roles sharing a small host (see the module docstring).
PLACEMENT_ENV: Final[Mapping[str, str]] = {
    **DEFAULT_ENGINE_ENV,
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "KMP_BLOCKTIME": "0",
}
BATCH_SIZES: Final[tuple[int, ...]] = (1, 4, 16)
#: FFN rank counts of the gate-on-Attention ``1:F`` deployments (1 is the bytes reference).
FFN_RANKS: Final[tuple[int, ...]] = (1, 2)
#: The extra plain row: vLLM's own CPU threading (every core to the one worker), for reference.
DEFAULT_THREADS_SETUP: Final[str] = "plain (vLLM default threads)"
TARGET_RATIO: Final[float] = 1.5
TARGET_OVERHEAD_RT: Final[float] = 3.0
#: Two-stage overlap: the share of the MoE-layer round trips hidden at the largest batch.
TARGET_HIDDEN_SHARE: Final[float] = 0.5
#: The tiny checkpoint widths the two-stage rows run on (see ``afd_models.demo.tiny.TinySpec``).
STAGE_WIDTHS: Final[tuple[TinyWidth, ...]] = ("tiny", "wide")


@dataclass(frozen=True)
class QuantizedSetup:
    """One quantized FFN compute of the 1:1 (gate on FFN) deployment: the FFN-local AFD fields."""

    ffn_compute: str
    expert_quant: str
    group_size: int = 0

    @property
    def scheme(self) -> str:
        """afd-weights' scheme name: ``w8a8``, ``w4a8_per_channel`` or ``w4a8_per_group``."""
        if self.expert_quant != "w4a8":
            return self.expert_quant
        return "w4a8_per_group" if self.group_size else "w4a8_per_channel"

    @property
    def setup(self) -> str:
        """``afd 1:1 <compute> <scheme>`` (``... g<G>`` for per-group W4A8)."""
        name = f"{setup_name(1, 1, gate_on_attention=False)} {self.ffn_compute} {self.scheme}"
        return f"{name} g{self.group_size}" if self.group_size else name

    def ffn_extra(self) -> dict[str, Any]:
        """The FFN rank's FFN-local ``additional_config["afd"]`` fields."""
        return {
            "ffn_compute": self.ffn_compute,
            "expert_quant": self.expert_quant,
            "expert_quant_group_size": self.group_size,
        }


#: The quantized computes measured at 1:1 (gate on FFN) when :attr:`BenchConfig.quantized`.
QUANTIZED_SETUPS: Final[tuple[QuantizedSetup, ...]] = (
    QuantizedSetup("layered", "w8a8"),
    QuantizedSetup("mega", "w4a8"),
)


@dataclass(frozen=True)
class BenchConfig:
    """What ``afd bench`` runs (see the module docstring)."""

    batch_sizes: tuple[int, ...] = BATCH_SIZES
    ffn_ranks: tuple[int, ...] = FFN_RANKS
    max_tokens: int = 48
    repeats: int = 3
    #: Engine starts per deployment, in rounds over every deployment: a row is the median of
    #: its per-start medians. One setup's TPOT moves by up to a third between starts of the
    #: same engines on a small VM (and stays put within one), and the VM drifts over a run.
    starts: int = 1
    quantized: bool = True
    stages: bool = True
    out: Path | None = None
    log_dir: Path = Path("afd-bench-logs")
    cache_dir: Path | None = None
    startup_timeout_s: float = 900.0
    #: A hardware profile (file or shipped name): the TPOT rows are then compared with
    #: afd-plan's predictions on it (``"plan"`` in the result, see afd_models.demo.bench_plan).
    plan_profile: str | Path | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes={self.batch_sizes!r}: each must be >= 1")
        if not self.ffn_ranks or any(f < 1 for f in self.ffn_ranks):
            raise ValueError(f"ffn_ranks={self.ffn_ranks!r}: each must be >= 1")
        if self.max_tokens < 4:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be >= 4")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats!r} must be >= 1")
        if self.starts < 1:
            raise ValueError(f"starts={self.starts!r} must be >= 1")

    @property
    def gate_on_attention_ffn_ranks(self) -> tuple[int, ...]:
        """The gate-on-Attention deployments' FFN rank counts, in run order: 1 (the reference)
        first, then every other F of :attr:`ffn_ranks` ascending."""
        return (1, *sorted({f for f in self.ffn_ranks if f > 1}))


@dataclass(frozen=True)
class TPOTRow:
    """One measured deployment at one batch size (times in milliseconds)."""

    setup: str  # "plain", "afd 1:1", "afd 2:1", "afd 1:2 gate-attn", ...
    batch: int
    tpot_ms: float
    tpot_samples_ms: tuple[float, ...] = field(repr=False)
    #: With several engine starts: each start's median (``tpot_ms`` is their median).
    start_tpot_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class ComparedRow:
    """An AFD row against plain at the same batch size."""

    setup: str
    batch: int
    tpot_plain_ms: float
    tpot_afd_ms: float
    ratio: float
    overhead_per_layer_ms: float
    raw_round_trip_ms: float
    overhead_in_round_trips: float

    @property
    def meets_targets(self) -> bool:
        return self.ratio <= TARGET_RATIO and self.overhead_in_round_trips <= TARGET_OVERHEAD_RT


@dataclass(frozen=True)
class StageRow:
    """``num_stages=2`` against one stage (1:1, gate on FFN) at one batch size (milliseconds).

    ``hidden_share`` is ``(tpot_one_stage - tpot_two_stages) / (layers x raw_round_trip)``: the
    part of the step's ``L`` MoE-layer round trips the second stage's attention hid."""

    model: str  # the tiny checkpoint's width: "tiny" or "wide" (see afd_models.demo.tiny)
    batch: int
    tpot_one_stage_ms: float
    tpot_two_stages_ms: float
    layers: int
    raw_round_trip_ms: float
    hidden_share: float
    split_steps: float  # share of the FFN's steps that ran two non-empty stages


@dataclass(frozen=True)
class QuantizedRow:
    """A quantized-compute 1:1 row against the native fp32 ``afd 1:1`` row and plain vLLM at the
    same batch size (times in milliseconds); ``expert_bytes`` / ``bf16_bytes`` are what the FFN
    rank reported (its quantized routed experts, the same experts in bf16)."""

    setup: str
    ffn_compute: str
    scheme: str
    group_size: int
    batch: int
    tpot_ms: float
    tpot_native_ms: float
    ratio_vs_native: float
    tpot_plain_ms: float
    ratio_vs_plain: float
    expert_bytes: int
    bf16_bytes: int

    @property
    def bytes_ratio_vs_bf16(self) -> float:
        return self.expert_bytes / self.bf16_bytes if self.bf16_bytes else 0.0


@dataclass(frozen=True)
class TrafficRow:
    """What one gate-on-Attention deployment's FFN ranks received over its whole run (tuples
    per FFN rank). ``bytes_per_step`` is the sum over ranks of ``bytes / steps``, i.e. the
    payload bytes the Attention role sent per step; ``ratio_vs_one_rank`` divides it by the
    1-FFN-rank deployment's (None when that one sent nothing)."""

    setup: str
    num_ffn_ranks: int
    steps: tuple[int, ...]
    tokens: tuple[int, ...]
    bytes: tuple[int, ...]
    bytes_per_step: float
    ratio_vs_one_rank: float | None


# --------------------------------------------------------------------------------------------
# The transfer floor: raw gloo round trips between two processes


def _round_trip_rank(rank: int, port: int, shapes: Sequence[tuple[int, int]], iters: int) -> Any:
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    pg: Any = dist.ProcessGroupGloo(store, rank, 2, timeout)
    out: dict[str, float] = {}
    for rows, hidden in shapes:
        send = torch.randn(rows, hidden)
        recv = torch.empty(rows, hidden)
        samples = []
        for i in range(iters + 20):
            t0 = time.perf_counter()
            if rank == 0:
                pg.send([send], 1, 0).wait()
                pg.recv([recv], 1, 1).wait()
            else:
                pg.recv([recv], 0, 0).wait()
                pg.send([recv], 0, 1).wait()
            if i >= 20:
                samples.append(time.perf_counter() - t0)
        out[f"{rows}x{hidden}"] = statistics.median(samples) * 1e3
    return out


def raw_round_trip_ms(
    batch_sizes: Sequence[int], hidden: int, iters: int = 300
) -> dict[int, float]:
    """Median raw gloo round trip (ms) of a ``[batch, hidden]`` float32 message, per batch."""
    from afd_core.testing import free_port, run_world

    shapes = [(b, hidden) for b in batch_sizes]
    results = run_world(_round_trip_rank, 2, free_port(), shapes, iters, timeout_s=300)
    outcome = results[0]
    if outcome[0] != "ok":
        raise RuntimeError(f"raw round trip measurement failed: {outcome}")
    return {b: outcome[1][f"{b}x{hidden}"] for b in batch_sizes}


# --------------------------------------------------------------------------------------------
# Steady-state TPOT through the OpenAI API


def _stream_tpot(base_url: str, model: str, prompt: str, max_tokens: int) -> float:
    """TPOT (ms) of one streamed greedy completion of exactly ``max_tokens`` tokens."""
    import requests

    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    first = last = None
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
    if first is None or last is None or last <= first:
        raise RuntimeError(f"no streamed tokens from {base_url}")
    return (last - first) / (max_tokens - 1) * 1e3


def bench_prompts(batch: int) -> tuple[str, ...]:
    """One prompt per request of a batch, no two alike: the demo prompts, then numbered
    variants of them (``"<prompt> (n)"``).

    Why distinct: greedy requests with the same prompt decode the same tokens and route them to
    the same experts, so a batch that repeats prompts reads fewer expert weights than as many
    independent requests, which is what afd-plan prices (uniform routing). On the wide
    checkpoint, 16 requests over the six demo prompts touched 6.5 of the 8 experts a layer
    against 7.9 expected."""
    if batch < 1:
        raise ValueError(f"batch: {batch!r}, expected an int >= 1")
    n = len(DEMO_PROMPTS)
    return tuple(
        DEMO_PROMPTS[i % n] if i < n else f"{DEMO_PROMPTS[i % n]} ({i // n})" for i in range(batch)
    )


def _concurrent_tpot(
    base_url: str, model: str, batch: int, max_tokens: int
) -> list[float] | BaseException:
    """TPOT (ms) of ``batch`` requests started together, or the first error."""
    results: list[float] = [0.0] * batch
    errors: list[BaseException] = []
    start = threading.Barrier(batch)
    prompts = bench_prompts(batch)

    def one(i: int) -> None:
        try:
            start.wait(60)
            results[i] = _stream_tpot(base_url, model, prompts[i], max_tokens)
        except BaseException as exc:  # returned to the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors[0] if errors else results


def measure_tpot(server: VLLMServer, batch: int, cfg: BenchConfig, setup: str) -> TPOTRow:
    """Median TPOT (ms) of ``batch`` concurrent requests, ``cfg.repeats`` times, after a warm-up."""
    from afd_models.demo.client import served_model_id

    model = served_model_id(server.base_url)
    samples: list[float] = []
    for rep in range(cfg.repeats + 1):
        results = _concurrent_tpot(server.base_url, model, batch, cfg.max_tokens)
        server.check_alive()
        if isinstance(results, BaseException):
            raise RuntimeError(f"{setup} batch {batch}: {results}") from results
        if rep:  # the first round warms up
            samples.extend(results)
    return TPOTRow(setup, batch, statistics.median(samples), tuple(samples))


# --------------------------------------------------------------------------------------------


def bench_options(cfg: BenchConfig, env: Mapping[str, str]) -> EngineOptions:
    return EngineOptions(
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        startup_timeout_s=cfg.startup_timeout_s,
        env=dict(env),
    )


@dataclass
class Deployment:
    """One deployment ``afd bench`` measures: its servers (unstarted), the one it measures
    through, the batch sizes; :func:`run_deployments` fills ``rows`` and, with
    ``want_metrics``, ``metrics`` (each server's ``/metrics`` text by name, read while the last
    start still serves)."""

    setup: str
    servers: list[VLLMServer]
    front: VLLMServer
    batches: tuple[int, ...]
    want_metrics: bool = False
    rows: list[TPOTRow] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)


def run_deployments(
    deployments: Sequence[Deployment], cfg: BenchConfig, progress: Progress = print
) -> None:
    """Start each deployment, measure its front server at each batch size, stop it; in
    ``cfg.starts`` rounds, each round starting every deployment once in order (a later start is
    the same deployment again: :meth:`VLLMServer.restarted`). A row is the median of the
    per-start medians. Rounds, not consecutive starts, because what drifts on a shared host
    over a run (tens of minutes) then spreads over every deployment instead of landing on the
    ones measured last."""
    per_start: list[list[list[TPOTRow]]] = [[] for _ in deployments]
    current = [list(d.servers) for d in deployments]
    for start in range(cfg.starts):
        for i, d in enumerate(deployments):
            progress(d.setup if cfg.starts == 1 else f"{d.setup} (start {start + 1}/{cfg.starts})")
            if start:
                current[i] = [s.restarted() for s in current[i]]
            servers = current[i]
            front = servers[d.servers.index(d.front)]
            for s in reversed(servers):
                s.start()
            try:
                wait_until_healthy(list(servers))
                per_start[i].append([measure_tpot(front, b, cfg, d.setup) for b in d.batches])
                if d.want_metrics and start == cfg.starts - 1:
                    d.metrics.update({s.name: s.metrics_text() for s in servers})
            finally:
                stop_all(servers)
    for d, runs in zip(deployments, per_start, strict=True):
        d.rows = (
            runs[0] if cfg.starts == 1 else [_across_starts(r) for r in zip(*runs, strict=True)]
        )


def run_setup(
    servers: Sequence[VLLMServer],
    front: VLLMServer,
    batches: Sequence[int],
    cfg: BenchConfig,
    setup: str,
    metrics: dict[str, str] | None = None,
) -> list[TPOTRow]:
    """One deployment alone (:func:`run_deployments`; its ``cfg.starts`` starts follow each
    other). With ``metrics``, first store each server's ``/metrics`` text under its name."""
    d = Deployment(setup, list(servers), front, tuple(batches), want_metrics=metrics is not None)
    run_deployments([d], cfg, progress=lambda _msg: None)
    if metrics is not None:
        metrics.update(d.metrics)
    return d.rows


def _across_starts(rows: Sequence[TPOTRow]) -> TPOTRow:
    """One row from the same setup and batch measured at several engine starts."""
    medians = tuple(r.tpot_ms for r in rows)
    samples = tuple(x for r in rows for x in r.tpot_samples_ms)
    return TPOTRow(rows[0].setup, rows[0].batch, statistics.median(medians), samples, medians)


def compare(
    plain: Sequence[TPOTRow], afd: Sequence[TPOTRow], round_trip: Mapping[int, float], layers: int
) -> list[ComparedRow]:
    """Each AFD row against the plain row of the same batch size."""
    by_batch = {r.batch: r for r in plain}
    rows = []
    for r in afd:
        p = by_batch[r.batch]
        per_layer = (r.tpot_ms - p.tpot_ms) / layers
        rt = round_trip[r.batch]
        rows.append(
            ComparedRow(
                r.setup,
                r.batch,
                p.tpot_ms,
                r.tpot_ms,
                r.tpot_ms / p.tpot_ms,
                per_layer,
                rt,
                per_layer / rt,
            )
        )
    return rows


def setup_name(num_attention_ranks: int, num_ffn_ranks: int, gate_on_attention: bool) -> str:
    """``afd A:F`` (gate on FFN), ``afd A:F gate-attn`` (gate on Attention)."""
    name = f"afd {num_attention_ranks}:{num_ffn_ranks}"
    return f"{name} gate-attn" if gate_on_attention else name


def traffic_row(
    setup: str,
    stats: Sequence[FFNStats | None],
    reference_bytes_per_step: float | None = None,
) -> TrafficRow:
    """The :class:`TrafficRow` of a deployment from its FFN ranks' counters (``stats[i]`` of
    FFN rank ``i``); ``reference_bytes_per_step`` is the 1-FFN-rank deployment's (None: this one
    is the reference). Raises :class:`RuntimeError` when a rank published no counters."""
    missing = [rank for rank, s in enumerate(stats) if s is None]
    if not stats or missing:
        raise RuntimeError(
            f"{setup}: no afd_* counters on /metrics of FFN rank(s) {missing or [0]}"
        )
    ranks = [s for s in stats if s is not None]
    per_step = sum(s.bytes_per_step for s in ranks)
    reference = per_step if reference_bytes_per_step is None else reference_bytes_per_step
    return TrafficRow(
        setup,
        len(ranks),
        tuple(s.steps for s in ranks),
        tuple(s.tokens for s in ranks),
        tuple(s.bytes for s in ranks),
        per_step,
        per_step / reference if reference > 0 else None,
    )


def render_traffic(rows: Sequence[TrafficRow]) -> str:
    """The bytes-per-step table (markdown)."""
    lines = [
        "| setup | FFN ranks | steps (per rank) | bytes sent per step (per rank) | vs 1 FFN rank |",
        "|" + "---|" * 5,
    ]
    for r in rows:
        per_rank = " + ".join(
            f"{b / s:.0f}" if s else "0" for b, s in zip(r.bytes, r.steps, strict=True)
        )
        ratio = "n/a" if r.ratio_vs_one_rank is None else f"{r.ratio_vs_one_rank:.2f}"
        lines.append(
            f"| {r.setup} | {r.num_ffn_ranks} | {' / '.join(map(str, r.steps))} | "
            f"{r.bytes_per_step:.0f} ({per_rank}) | {ratio} |"
        )
    return "\n".join(lines)


def quantized_rows(
    setup: QuantizedSetup,
    rows: Sequence[TPOTRow],
    native: Sequence[TPOTRow],
    plain: Sequence[TPOTRow],
    report: QuantReport | None,
) -> list[QuantizedRow]:
    """``setup``'s TPOT rows against the native ``afd 1:1`` and the plain rows of the same batch
    size; ``report`` is the FFN rank's quantized-compute metrics. Raises :class:`RuntimeError`
    when they are missing (the FFN rank did not serve the quantized compute)."""
    if report is None:
        raise RuntimeError(
            f"{setup.setup}: no afd_ffn_quantized_expert_bytes on /metrics of FFN rank 0"
        )
    native_by_batch = {r.batch: r for r in native}
    plain_by_batch = {r.batch: r for r in plain}
    out = []
    for r in rows:
        n, p = native_by_batch[r.batch], plain_by_batch[r.batch]
        out.append(
            QuantizedRow(
                setup.setup,
                setup.ffn_compute,
                setup.scheme,
                setup.group_size,
                r.batch,
                r.tpot_ms,
                n.tpot_ms,
                r.tpot_ms / n.tpot_ms,
                p.tpot_ms,
                r.tpot_ms / p.tpot_ms,
                report.expert_bytes,
                report.bf16_bytes,
            )
        )
    return out


def stage_rows(
    one: Sequence[TPOTRow],
    two: Sequence[TPOTRow],
    round_trip: Mapping[int, float],
    layers: int,
    split_steps: float,
    model: str = "tiny",
) -> list[StageRow]:
    """Each ``num_stages=2`` row against the one-stage row of the same batch size."""
    by_batch = {r.batch: r for r in one}
    out = []
    for r in two:
        base = by_batch[r.batch]
        rt = round_trip[r.batch]
        out.append(
            StageRow(
                model,
                r.batch,
                base.tpot_ms,
                r.tpot_ms,
                layers,
                rt,
                (base.tpot_ms - r.tpot_ms) / (layers * rt),
                split_steps,
            )
        )
    return out


def render_stages(rows: Sequence[StageRow]) -> str:
    """The two-stage table (markdown)."""
    head = (
        "| model | batch | TPOT 1 stage (ms) | TPOT 2 stages (ms) | L x raw round trip (ms) | "
        "transfer hidden | split steps |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {r.tpot_one_stage_ms:.2f} | {r.tpot_two_stages_ms:.2f} | "
            f"{r.layers * r.raw_round_trip_ms:.3f} | {100 * r.hidden_share:.0f} % | "
            f"{100 * r.split_steps:.0f} % |"
        )
    return "\n".join(lines)


def split_step_share(stats: FFNStats | None) -> float:
    """The share of an FFN rank's steps whose second stage carried tokens: a split step makes
    ``2 L`` compute calls, a one-stage step ``L`` (its empty stage computes nothing)."""
    if stats is None or not stats.steps:
        raise RuntimeError("two-stage setup: no afd_* counters on /metrics of FFN rank 0")
    return stats.compute_calls / (stats.steps * stats.layers) - 1.0


def render_quantized(rows: Sequence[QuantizedRow]) -> str:
    """The quantized-compute table (markdown)."""
    head = (
        "| setup | batch | TPOT plain (ms) | TPOT AFD native (ms) | TPOT quantized (ms) | "
        "vs AFD native | vs plain | expert bytes (vs bf16) |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.batch} | {r.tpot_plain_ms:.2f} | {r.tpot_native_ms:.2f} | "
            f"{r.tpot_ms:.2f} | {r.ratio_vs_native:.2f} | {r.ratio_vs_plain:.2f} | "
            f"{r.expert_bytes} ({r.bytes_ratio_vs_bf16:.3f}) |"
        )
    return "\n".join(lines)


def render(rows: Sequence[ComparedRow]) -> str:
    """The result table (markdown)."""
    head = (
        "| setup | batch | TPOT plain (ms) | TPOT AFD (ms) | AFD / plain | overhead per MoE layer "
        "(ms) | raw round trip (ms) | overhead / round trip | targets |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.batch} | {r.tpot_plain_ms:.2f} | {r.tpot_afd_ms:.2f} | "
            f"{r.ratio:.2f} | {r.overhead_per_layer_ms:.3f} | {r.raw_round_trip_ms:.3f} | "
            f"{r.overhead_in_round_trips:.1f} | {'met' if r.meets_targets else 'MISSED'} |"
        )
    return "\n".join(lines)


def run_bench(cfg: BenchConfig, progress: Progress = print) -> dict[str, Any]:
    """Run every measurement; returns the JSON-able result (also written to ``cfg.out``)."""
    model = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), cfg.cache_dir)
    config = json.loads((model / "config.json").read_text())
    hidden = int(config["hidden_size"])
    layers = sum(
        1
        for i in range(int(config["num_hidden_layers"]))
        if (i + 1) % int(config.get("decoder_sparse_step", 1)) == 0
        and i not in (config.get("mlp_only_layers") or [])
    )
    largest = max(cfg.batch_sizes)
    progress(f"raw gloo round trip, hidden={hidden}")
    round_trip = raw_round_trip_ms(cfg.batch_sizes, hidden)
    log_dir = Path(cfg.log_dir)

    # Declare every deployment first, then run them (in rounds with --starts), then derive.
    deployments: list[Deployment] = []

    def declare(
        setup: str,
        servers: Sequence[VLLMServer],
        batches: Sequence[int],
        *,
        metrics: bool = False,
    ) -> Deployment:
        d = Deployment(setup, list(servers), servers[0], tuple(batches), want_metrics=metrics)
        deployments.append(d)
        return d

    plain_setups = (
        ("plain", "plain", PLACEMENT_ENV),
        (DEFAULT_THREADS_SETUP, "plain-default-threads", DEFAULT_ENGINE_ENV),
    )
    plain_runs = []
    for setup, name, env in plain_setups:
        options = bench_options(cfg, env)
        plain = plain_server(model, log_dir=log_dir, options=options, name=name, progress=progress)
        plain_runs.append(declare(setup, [plain], cfg.batch_sizes))

    afd_runs: list[Deployment] = []
    for attention_ranks, batches in ((1, cfg.batch_sizes), (2, (largest,))):
        attention, ffns = afd_servers(
            model,
            log_dir=log_dir,
            options=bench_options(cfg, PLACEMENT_ENV),
            num_attention_ranks=attention_ranks,
            gate_on_attention=False,
            prefix=f"bench-{attention_ranks}a1f",
            progress=progress,
        )
        setup = setup_name(attention_ranks, 1, gate_on_attention=False)
        afd_runs.append(declare(setup, [attention, *ffns], batches))

    # Two-stage overlap at 1:1 (gate on FFN), against one stage: the tiny model (its one-stage
    # rows are the afd 1:1 rows above) and the wide one (both measured here).
    stage_plans: list[tuple[TinyWidth, str, dict[int, float], Deployment, str]] = []
    stage_runs: list[Deployment] = []
    checkpoints = {"tiny": str(model)}
    stage_batches = tuple(b for b in cfg.batch_sizes if b >= 2)
    for width in STAGE_WIDTHS if cfg.stages and stage_batches else ():
        stage_model, rt = model, round_trip
        one_setup = setup_name(1, 1, gate_on_attention=False)
        if width != "tiny":
            stage_model = ensure_tiny_checkpoint(TinySpec("qwen3_moe", width=width), cfg.cache_dir)
            wide_hidden = int(json.loads((stage_model / "config.json").read_text())["hidden_size"])
            progress(f"raw gloo round trip, hidden={wide_hidden}")
            rt = raw_round_trip_ms(stage_batches, wide_hidden)
            one_setup = f"{one_setup} {width}"
            # Plain on one thread (the model's device) and with vLLM's own threading (every
            # core): the AFD pair's two cores are measured against the better of the two.
            for plain_setup, name, env in (
                (f"plain {width}", f"plain-{width}", PLACEMENT_ENV),
                (
                    f"plain {width} (vLLM default threads)",
                    f"plain-{width}-default-threads",
                    DEFAULT_ENGINE_ENV,
                ),
            ):
                plain = plain_server(
                    stage_model,
                    log_dir=log_dir,
                    options=bench_options(cfg, env),
                    name=name,
                    progress=progress,
                )
                stage_runs.append(declare(plain_setup, [plain], stage_batches))
            checkpoints[width] = str(stage_model)
            attention, ffns = afd_servers(
                stage_model,
                log_dir=log_dir,
                options=bench_options(cfg, PLACEMENT_ENV),
                num_attention_ranks=1,
                gate_on_attention=False,
                prefix=f"bench-1a1f-{width}",
                progress=progress,
            )
            stage_runs.append(declare(one_setup, [attention, *ffns], stage_batches))
        two_setup = f"{one_setup} stages=2"
        attention, ffns = afd_servers(
            stage_model,
            log_dir=log_dir,
            # Thresholds at 1: measure the split itself at these small batches.
            options=split_every_step(bench_options(cfg, PLACEMENT_ENV)),
            num_attention_ranks=1,
            gate_on_attention=False,
            afd_extra={"num_stages": 2},
            prefix="bench-1a1f-stages2" if width == "tiny" else f"bench-1a1f-{width}-stages2",
            progress=progress,
        )
        two = declare(two_setup, [attention, *ffns], stage_batches, metrics=True)
        stage_runs.append(two)
        stage_plans.append((width, one_setup, rt, two, ffns[0].name))

    # Quantized FFN computes at 1:1 (gate on FFN), against the native afd 1:1 rows above.
    quantized_runs: list[tuple[QuantizedSetup, Deployment, str]] = []
    for q in QUANTIZED_SETUPS if cfg.quantized else ():
        attention, ffns = afd_servers(
            model,
            log_dir=log_dir,
            options=bench_options(cfg, PLACEMENT_ENV),
            num_attention_ranks=1,
            gate_on_attention=False,
            ffn_extra=q.ffn_extra(),
            prefix=f"bench-1a1f-{q.ffn_compute}-{q.scheme}".replace("_", "-"),
            progress=progress,
        )
        d = declare(q.setup, [attention, *ffns], cfg.batch_sizes, metrics=True)
        quantized_runs.append((q, d, ffns[0].name))

    # Gate on Attention, 1:F; F = 1 first: the bytes-per-step reference.
    gate_runs: list[tuple[Deployment, list[str]]] = []
    for num_ffn_ranks in cfg.gate_on_attention_ffn_ranks:
        attention, ffns = afd_servers(
            model,
            log_dir=log_dir,
            options=bench_options(cfg, PLACEMENT_ENV),
            num_attention_ranks=1,
            num_ffn_ranks=num_ffn_ranks,
            gate_on_attention=True,
            prefix=f"bench-1a{num_ffn_ranks}f-gate-attn",
            progress=progress,
        )
        setup = setup_name(1, num_ffn_ranks, gate_on_attention=True)
        d = declare(setup, [attention, *ffns], cfg.batch_sizes, metrics=True)
        gate_runs.append((d, [f.name for f in ffns]))

    run_deployments(deployments, cfg, progress)

    plain_rows = [r for d in plain_runs for r in d.rows]
    afd_rows = [r for d in afd_runs for r in d.rows]
    stage_tpot = [r for d in stage_runs for r in d.rows]
    stages: list[StageRow] = []
    for stage_width, one_setup, rt, two, ffn_name in stage_plans:
        split = split_step_share(parse_ffn_stats(two.metrics[ffn_name]).get(0))
        one = [r for r in (*afd_rows, *stage_tpot) if r.setup == one_setup]
        stages += stage_rows(one, two.rows, rt, layers, split, stage_width)

    quantized: list[QuantizedRow] = []
    quantized_tpot: list[TPOTRow] = []
    native = [r for r in afd_rows if r.setup == setup_name(1, 1, gate_on_attention=False)]
    plain_ref = [r for r in plain_rows if r.setup == "plain"]
    for q, d, ffn_name in quantized_runs:
        quantized_tpot += d.rows
        report = parse_quantized(d.metrics[ffn_name]).get(0)
        quantized += quantized_rows(q, d.rows, native, plain_ref, report)

    traffic: list[TrafficRow] = []
    for d, ffn_names in gate_runs:
        afd_rows += d.rows
        stats = [parse_ffn_stats(d.metrics[name]).get(rank) for rank, name in enumerate(ffn_names)]
        reference = traffic[0].bytes_per_step if traffic else None
        traffic.append(traffic_row(d.setup, stats, reference))

    rows = compare(plain_ref, afd_rows, round_trip, layers)
    tpot = [asdict(r) for r in (*plain_rows, *afd_rows, *stage_tpot, *quantized_tpot)]
    result = {
        "model": f"tiny qwen3_moe (hidden {hidden}, {layers} MoE layers)",
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "starts": cfg.starts,
        "ffn_ranks": list(cfg.gate_on_attention_ffn_ranks),
        "env": dict(PLACEMENT_ENV),
        "default_threads_env": dict(DEFAULT_ENGINE_ENV),
        "checkpoints": checkpoints,
        "raw_round_trip_ms": {str(b): v for b, v in round_trip.items()},
        "tpot": tpot,
        "stages": [
            {**asdict(r), "meets_target": r.hidden_share >= TARGET_HIDDEN_SHARE} for r in stages
        ],
        "compared": [{**asdict(r), "meets_targets": r.meets_targets} for r in rows],
        "traffic": [asdict(r) for r in traffic],
        "quantized": [
            {**asdict(r), "bytes_ratio_vs_bf16": r.bytes_ratio_vs_bf16} for r in quantized
        ],
        "targets": {
            "ratio_max": TARGET_RATIO,
            "overhead_round_trips_max": TARGET_OVERHEAD_RT,
            "hidden_share_min_at_largest_batch": TARGET_HIDDEN_SHARE,
        },
    }
    planned = None
    if cfg.plan_profile is not None:
        from afd_plan.hardware import load_profile

        from afd_models.demo.bench_plan import compare_with_plan

        planned = compare_with_plan(
            tpot, checkpoints, load_profile(cfg.plan_profile), max_tokens=cfg.max_tokens
        )
        result["plan"] = planned.to_json()
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(json.dumps(result, indent=2) + "\n")
    progress(render(rows))
    progress(render_traffic(traffic))
    if stages:
        progress(render_stages(stages))
    if quantized:
        progress(render_quantized(quantized))
    default = {r.batch: r.tpot_ms for r in plain_rows if r.setup == DEFAULT_THREADS_SETUP}
    progress(
        "plain with vLLM's default CPU threading (reference): "
        + ", ".join(f"batch {b}: {t:.2f} ms" for b, t in default.items())
    )
    if planned is not None:
        from afd_models.demo.bench_plan import render_plan_comparison

        progress(render_plan_comparison(planned))
    return result
