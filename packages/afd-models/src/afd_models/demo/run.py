"""``afd demo``: serve one model with plain vLLM and with the AFD roles, compare, report.

Flow: build (or reuse) the tiny checkpoint unless a model path is given; run plain ``vllm serve``,
send the prompts (concurrently), record tokens/s and RSS, stop it; start the FFN rank servers
(one per FFN rank, each holding ``1/F`` of the routed experts) and the Attention role, send the
same prompts to the Attention role, record tokens/s and RSS per role process tree, read every AFD
server's ``/metrics`` (the ``afd_*`` series of afd-runtime's README, "Metrics": the parameter
bytes each role holds, each FFN rank's batching, tokens and payload bytes received, each
Attention rank's wait for the FFN) and stop them all (Attention first). Each server gets one untimed request before the timed batch. The report
holds per-prompt parity; the demo fails when any prompt differs. At most ``1 + F`` engines run
at a time (plain alone first).

Quantized experts (``DemoConfig.expert_quant`` ``w8a8`` / ``w4a8``, with ``ffn_compute`` ``layered``
or ``mega``): the FFN ranks get the three FFN-local AFD fields and ``AFD_REPORT_QUANT_ERROR=1``,
so each publishes its quantized expert bytes (``afd_ffn_quantized_expert_bytes``) and the max
relative error of its first MoE layer against the same layer in fp32 on the tokens it served
(``afd_ffn_quant_error_max_rel``). Exact
token parity is then not expected: the report adds the share of greedy tokens equal to plain
fp32 vLLM, and the demo fails when an FFN rank's error exceeds :data:`QUANT_ERROR_TOLERANCE` of
the scheme or when a rank published no error, whatever the tokens. The demo also fails when an AFD
server's ``/metrics`` shows no ``afd_*`` series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from afd_models.demo.client import BatchResult, complete_many
from afd_models.demo.parity import ParityResult, compare_parity
from afd_models.demo.servers import (
    AttentionStats,
    EngineOptions,
    FFNStats,
    Progress,
    QuantReport,
    VLLMServer,
    afd_series_count,
    afd_servers,
    mtp_speculative_args,
    parity_options,
    parse_attention_stats,
    parse_ffn_stats,
    parse_param_bytes,
    parse_quant_error,
    parse_quantized,
    plain_server,
    process_tree_rss,
    split_every_step,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinyFamily, TinySpec, ensure_tiny_checkpoint

#: The max relative error (``max|y - ref| / max|ref|``) of an FFN rank's measured MoE layer
#: against fp32 that a quantized ``afd demo`` accepts, per ``expert_quant``. Measured on the tiny
#: random-weight checkpoints, first MoE layer vs fp32, over the demo prompts: W8A8 2.8e-2
#: (Qwen3-MoE) and 3.6e-2 (DeepSeek-V2); W4A8 per channel 3.1e-1 (Qwen3-MoE) and 4.4e-1
#: (DeepSeek-V2), per group G=32 2.6e-1 (Qwen3-MoE). W4A8's tolerance covers both layouts: int4
#: on unstructured random weights is the worst case.
QUANT_ERROR_TOLERANCE: Final[dict[str, float]] = {"w8a8": 5e-2, "w4a8": 5e-1}


@dataclass(frozen=True)
class DemoConfig:
    """What ``afd demo`` runs. ``model=None`` means the embedded tiny checkpoint of ``family``."""

    model: Path | None = None
    family: TinyFamily = "qwen3_moe"
    seed: int = 0
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    #: The Attention role's --tensor-parallel-size (plain vLLM runs with the same, for parity).
    attention_tp_size: int = 1
    #: Speculative tokens per step with DeepSeek's MTP drafter (0: none); the tiny DeepSeek-V3
    #: checkpoint then has one MTP layer. Plain vLLM and the Attention role run the same config.
    speculative_tokens: int = 0
    gate_on_attention: bool = False
    num_stages: int = 1
    #: ``expert_replicas``: how many of the FFN ranks hold each routed expert (1..num_ffn_ranks).
    expert_replicas: int = 1
    prompts: tuple[str, ...] = DEMO_PROMPTS
    max_tokens: int = 16
    concurrency: int = 3
    log_dir: Path = Path("afd-demo-logs")
    cache_dir: Path | None = None
    options: EngineOptions = field(default_factory=EngineOptions)
    ffn_compute: str = "native"
    expert_quant: str = "none"
    expert_quant_group_size: int = 0

    @property
    def quantized(self) -> bool:
        """True when the FFN ranks serve quantized experts (``expert_quant`` is not ``none``)."""
        return self.expert_quant != "none"

    @property
    def expert_dispatch(self) -> str:
        """``ffn`` for Mega over several FFN ranks (its fused kernel dispatches the tokens among
        them: each Attention rank sends its tokens to one FFN rank), else ``attention``."""
        return "ffn" if self.ffn_compute == "mega" and self.num_ffn_ranks > 1 else "attention"

    @property
    def ffn_extra(self) -> dict[str, Any]:
        """The FFN-local AFD fields of the FFN ranks' ``additional_config["afd"]``."""
        return {
            "ffn_compute": self.ffn_compute,
            "expert_quant": self.expert_quant,
            "expert_quant_group_size": self.expert_quant_group_size,
        }

    def __post_init__(self) -> None:
        if self.num_attention_ranks < 1:
            raise ValueError(
                f"DemoConfig.num_attention_ranks={self.num_attention_ranks!r} must be >= 1"
            )
        if self.num_ffn_ranks < 1:
            raise ValueError(f"DemoConfig.num_ffn_ranks={self.num_ffn_ranks!r} must be >= 1")
        if self.speculative_tokens < 0:
            raise ValueError(
                f"DemoConfig.speculative_tokens={self.speculative_tokens!r} must be >= 0"
            )
        if self.speculative_tokens and self.model is None and self.family != "deepseek_v3":
            raise ValueError(
                f"DemoConfig.speculative_tokens={self.speculative_tokens!r} with "
                f"family={self.family!r}; allowed: family 'deepseek_v3' (its MTP layer drafts)"
            )
        if self.attention_tp_size < 1:
            raise ValueError(
                f"DemoConfig.attention_tp_size={self.attention_tp_size!r} must be >= 1"
            )
        if self.num_ffn_ranks > 1 and not self.gate_on_attention:
            raise ValueError(
                f"DemoConfig.num_ffn_ranks={self.num_ffn_ranks!r} > 1 needs "
                "gate_on_attention=True (expert parallelism runs the router gate on Attention)"
            )
        if self.num_stages not in (1, 2):
            raise ValueError(f"DemoConfig.num_stages={self.num_stages!r}; allowed: 1 or 2")
        if not 1 <= self.expert_replicas <= self.num_ffn_ranks:
            raise ValueError(
                f"DemoConfig.expert_replicas={self.expert_replicas!r}; allowed: 1.."
                f"{self.num_ffn_ranks} (num_ffn_ranks)"
            )
        if self.max_tokens < 1:
            raise ValueError(f"DemoConfig.max_tokens={self.max_tokens!r} must be >= 1")
        if self.concurrency < 1:
            raise ValueError(f"DemoConfig.concurrency={self.concurrency!r} must be >= 1")
        if not self.prompts:
            raise ValueError("DemoConfig.prompts must hold at least one prompt")
        if (self.ffn_compute, self.expert_quant, self.expert_quant_group_size) != (
            "native",
            "none",
            0,
        ):
            # afd-core's own checks (an AFDConfigError, a ValueError, naming the field); only
            # off the default, which is valid, because afd_core.config imports torch.
            from afd_core.config import AFDConfig

            AFDConfig.from_mapping(
                {
                    "role": "ffn",
                    **self.ffn_extra,
                    "num_ffn_ranks": self.num_ffn_ranks,
                    "compute_gate_on_attention": self.gate_on_attention,
                    "expert_replicas": self.expert_replicas,
                    "expert_dispatch": self.expert_dispatch,
                }
            )


@dataclass(frozen=True)
class ServerStats:
    """Measurements of one server (or role): throughput, memory and reported weight bytes."""

    name: str
    role: str
    tokens_per_s: float | None
    rss_bytes: int | None
    param_bytes: tuple[int, ...] | None


@dataclass(frozen=True)
class FFNRankStats:
    """One FFN rank of the AFD deployment: its server, the (routed-expert) parameter bytes it
    reports (``afd_param_bytes``, one entry per worker) and its counters from ``/metrics``
    (None when absent)."""

    rank: int
    name: str
    param_bytes: tuple[int, ...] | None
    stats: FFNStats | None


@dataclass(frozen=True)
class MetricsCheck:
    """One AFD server's ``/metrics``: how many ``afd_*`` series it showed while serving."""

    name: str
    role: str
    afd_series: int

    @property
    def ok(self) -> bool:
        return self.afd_series > 0


@dataclass(frozen=True)
class QuantRankStats:
    """One FFN rank of a quantized run: its quantized-compute metrics (None when absent), its
    measured error as ``(layer, calls, max_rel)`` (None: not measured) and whether it computed
    tokens of its own (a Mega over several FFN ranks gets every token at one of them: the others
    only add their experts' share through the group and have no rows to measure)."""

    rank: int
    name: str
    quant: QuantReport | None
    error: tuple[int, int, float] | None
    computed: bool = True


@dataclass(frozen=True)
class QuantSummary:
    """The quantized side of a demo run: the FFN-local config, the tolerance of its scheme
    (:data:`QUANT_ERROR_TOLERANCE`), each FFN rank's measurements, and how many greedy tokens
    equal plain fp32 vLLM's (position by position, over all prompts; see :func:`token_match`).

    ``ok`` when every FFN rank that computed tokens published an error (at least one did) and
    each is within ``tolerance``."""

    ffn_compute: str
    expert_quant: str
    group_size: int
    tolerance: float
    ranks: tuple[QuantRankStats, ...]
    equal_tokens: int
    total_tokens: int

    @property
    def token_share(self) -> float:
        """``equal_tokens / total_tokens`` (0.0 without tokens)."""
        return self.equal_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def unmeasured(self) -> tuple[int, ...]:
        """FFN ranks that computed tokens and published no ``afd_ffn_quant_error_max_rel`` (every
        rank when none computed)."""
        if not any(r.computed for r in self.ranks):
            return tuple(r.rank for r in self.ranks)
        return tuple(r.rank for r in self.ranks if r.error is None and r.computed)

    @property
    def over_tolerance(self) -> tuple[int, ...]:
        """FFN ranks whose measured error exceeds ``tolerance`` (NaN counts as exceeding)."""
        return tuple(
            r.rank
            for r in self.ranks
            if r.error is not None
            and not (math.isfinite(r.error[2]) and r.error[2] <= self.tolerance)
        )

    @property
    def max_rel(self) -> float | None:
        """The largest measured error over the FFN ranks (None when none was measured)."""
        errors = [r.error[2] for r in self.ranks if r.error is not None]
        return max(errors, key=lambda e: math.inf if math.isnan(e) else e) if errors else None

    @property
    def ok(self) -> bool:
        return bool(self.ranks) and not self.unmeasured and not self.over_tolerance


@dataclass(frozen=True)
class DemoReport:
    """Everything ``afd demo`` prints. ``ok`` is parity on every prompt, or, for quantized
    experts (``quant`` set), the measured error within tolerance on every FFN rank (token
    mismatches then do not count)."""

    model: str
    topology: str
    parity: ParityResult
    servers: tuple[ServerStats, ...]
    ffn_ranks: tuple[FFNRankStats, ...] = ()
    quant: QuantSummary | None = None
    metrics: tuple[MetricsCheck, ...] = ()
    attention_ranks: tuple[AttentionStats, ...] = ()

    @property
    def metrics_ok(self) -> bool:
        """Every AFD server showed ``afd_*`` series on ``/metrics`` (True when none was read)."""
        return all(m.ok for m in self.metrics)

    @property
    def ok(self) -> bool:
        served = self.quant.ok if self.quant is not None else self.parity.ok
        return served and self.metrics_ok


def token_match(parity: ParityResult) -> tuple[int, int]:
    """``(equal, total)`` greedy tokens of the candidate against the baseline over all prompts,
    position by position; ``total`` counts the longer of the two runs per prompt (a token only one
    run produced is unequal)."""
    equal = total = 0
    for p in parity.prompts:
        equal += sum(a == b for a, b in zip(p.expected, p.actual, strict=False))
        total += max(len(p.expected), len(p.actual))
    return equal, total


def _fmt_bytes(n: int | None) -> str:
    """``n`` bytes in B (exact), KiB, MiB or GiB (one decimal); ``n/a`` for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    raise AssertionError("unreachable")


def _fmt_param_bytes(values: tuple[int, ...] | None) -> str:
    if not values:
        return "n/a"
    return " / ".join(_fmt_bytes(v) for v in values)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]


def _fmt_error(error: tuple[int, int, float] | None, computed: bool) -> tuple[str, str, str]:
    if error is None:
        return "-", "-", "not measured" if computed else "no tokens of its own"
    layer, calls, err = error
    return str(layer), str(calls), f"{err:.3e}"


def render_quant(quant: QuantSummary) -> list[str]:
    """The quantized-experts lines of the report: config and tolerance, the share of greedy
    tokens equal to plain fp32 vLLM, and per FFN rank the expert bytes vs bf16 and the error."""
    pct = 100.0 * quant.token_share
    out = [
        f"quantized experts: ffn_compute={quant.ffn_compute} expert_quant={quant.expert_quant} "
        f"group_size={quant.group_size} (exact token parity is not expected; tolerance: max "
        f"relative error <= {quant.tolerance:.1e} vs fp32)",
        f"greedy tokens equal to plain fp32 vLLM: {quant.equal_tokens} of {quant.total_tokens} "
        f"({pct:.1f}%)",
        "",
    ]
    rows = []
    for r in quant.ranks:
        q = r.quant
        rows.append(
            [
                str(r.rank),
                r.name,
                "n/a" if q is None else q.scheme,
                "n/a" if q is None else _fmt_bytes(q.expert_bytes),
                "n/a" if q is None else _fmt_bytes(q.bf16_bytes),
                "n/a" if q is None else f"{q.ratio_vs_bf16:.3f}",
                *_fmt_error(r.error, r.computed),
            ]
        )
    header = [
        "ffn rank",
        "server",
        "scheme",
        "expert bytes",
        "bf16 bytes",
        "vs bf16",
        "measured layer",
        "calls",
        "max rel error vs fp32",
    ]
    return [*out, *_table(header, rows)]


def _verdict(report: DemoReport) -> str:
    if not report.metrics_ok:
        missing = [m.name for m in report.metrics if not m.ok]
        return f"FAIL: no afd_* series on /metrics of {', '.join(missing)}"
    n_bad = len(report.parity.mismatches)
    n = len(report.parity.prompts)
    quant = report.quant
    if quant is None:
        return (
            "PASS: all prompts identical" if report.ok else f"FAIL: {n_bad} of {n} prompts differ"
        )
    tokens = f"{n_bad} of {n} prompts differ from plain fp32 vLLM (not expected to be identical)"
    if quant.ok:
        assert quant.max_rel is not None
        which = "every FFN rank" + (
            "" if all(r.computed for r in quant.ranks) else " with tokens of its own"
        )
        return (
            f"PASS: quantized experts within tolerance (max relative error {quant.max_rel:.3e} "
            f"<= {quant.tolerance:.1e} on {which}); {tokens}"
        )
    reasons = []
    if not quant.ranks:
        reasons.append("no FFN rank reported (error not measured)")
    if quant.unmeasured:
        reasons.append(
            f"no afd_ffn_quant_error_max_rel from FFN rank(s) {list(quant.unmeasured)} (error "
            "not measured)"
        )
    if quant.over_tolerance:
        worst = quant.max_rel
        reasons.append(
            f"max relative error {worst:.3e} > {quant.tolerance:.1e} on FFN rank(s) "
            f"{list(quant.over_tolerance)}"
        )
    return f"FAIL: quantized experts: {'; '.join(reasons)}; {tokens}"


def render_report(report: DemoReport) -> str:
    """A plain-text report: one parity table (per prompt), the quantized experts' section when
    quantized, and one table per server."""
    out = [f"model: {report.model}", f"topology: {report.topology}", ""]
    rows = []
    for p in report.parity.prompts:
        rows.append(
            [
                repr(p.prompt)[:40],
                str(len(p.expected)),
                "identical" if p.ok else "MISMATCH",
                "-" if p.mismatch_index is None else str(p.mismatch_index),
            ]
        )
    out += _table(["prompt", "tokens", "parity", "first mismatch"], rows)
    out.append("")
    if report.quant is not None:
        out += render_quant(report.quant)
        out.append("")
    srows = [
        [
            s.name,
            s.role,
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.1f}",
            _fmt_param_bytes(s.param_bytes),
            _fmt_bytes(s.rss_bytes),
        ]
        for s in report.servers
    ]
    out += _table(["server", "role", "tokens/s", "weight bytes (per rank)", "RSS (tree)"], srows)
    out.append("")
    if report.ffn_ranks:
        frows = [
            [
                str(r.rank),
                r.name,
                _fmt_param_bytes(r.param_bytes),
                "n/a" if r.stats is None else f"{r.stats.tokens_per_step:.1f}",
                "n/a" if r.stats is None else _fmt_bytes(round(r.stats.bytes_per_step)),
            ]
            for r in report.ffn_ranks
        ]
        header = [
            "ffn rank",
            "server",
            "routed-expert bytes",
            "tokens received/step",
            "bytes received/step",
        ]
        out += _table(header, frows)
        out.append("")
        for r in report.ffn_ranks:
            f = r.stats
            if f is None:
                continue
            out.append(
                f"FFN rank {f.rank} batching: {f.steps} steps, {f.compute_calls} compute calls "
                f"({f.calls_per_step:.1f} per step over {f.layers} MoE layers, {f.peers} "
                f"Attention peer(s) per call), {f.tokens} tokens ({f.tokens_per_call:.1f} per "
                "call)"
            )
        out.append("")
    for a in report.attention_ranks:
        out.append(
            f"Attention peer {a.rank}: {a.steps} steps, {a.waits} FFN replies, mean wait "
            f"{1000 * a.mean_wait_s:.2f} ms per reply, {_fmt_bytes(a.sent_bytes)} sent, "
            f"{_fmt_bytes(a.received_bytes)} received"
        )
    if report.metrics:
        checks = ", ".join(f"{m.name} ({m.role}): {m.afd_series}" for m in report.metrics)
        out += [f"afd_* series on /metrics: {checks}", ""]
    out.append(_verdict(report))
    return "\n".join(out)


def resolve_model(cfg: DemoConfig, progress: Progress) -> Path:
    """The model directory to serve: ``cfg.model`` or the (cached) tiny checkpoint."""
    if cfg.model is not None:
        if not Path(cfg.model).exists():
            raise FileNotFoundError(f"model={str(cfg.model)!r} does not exist")
        return Path(cfg.model)
    mtp = 1 if cfg.speculative_tokens else 0
    progress(f"building tiny {cfg.family} checkpoint (seed {cfg.seed}, MTP layers {mtp}) ...")
    # With a drafter, MTP weights whose drafts the target mostly accepts (random ones never are).
    spec = TinySpec(
        family=cfg.family, seed=cfg.seed, mtp_layers=mtp, draft="accepting" if mtp else "random"
    )
    path = ensure_tiny_checkpoint(spec, cfg.cache_dir)
    progress(f"tiny checkpoint: {path}")
    return path


def _run_batch(server: VLLMServer, cfg: DemoConfig, progress: Progress) -> BatchResult:
    # One untimed request first: tokens/s then measures serving, not first-request warm-up.
    complete_many(server.base_url, cfg.prompts[:1], max_tokens=cfg.max_tokens, concurrency=1)
    progress(f"[{server.name}] sending {len(cfg.prompts)} prompts ({cfg.concurrency} concurrent)")
    result = complete_many(
        server.base_url, cfg.prompts, max_tokens=cfg.max_tokens, concurrency=cfg.concurrency
    )
    server.check_alive()
    return result


def run_demo(cfg: DemoConfig, progress: Progress = print) -> DemoReport:
    """Run the comparison described in the module docstring; engines are always stopped."""
    model = resolve_model(cfg, progress)
    log_dir = Path(cfg.log_dir)
    progress(f"logs: {log_dir.resolve()}")
    options = parity_options(model, cfg.options)
    afd_extra: dict[str, Any] = {}
    if cfg.attention_tp_size > 1:
        afd_extra["attention_tp_size"] = cfg.attention_tp_size
        progress(
            f"tensor-parallel Attention: plain vLLM and the Attention role run "
            f"--tensor-parallel-size {cfg.attention_tp_size} (each TP worker sends its slice of "
            "the tokens to the FFN ranks)"
        )
    if cfg.num_stages > 1:
        afd_extra["num_stages"] = cfg.num_stages
    if cfg.expert_replicas > 1:
        afd_extra["expert_replicas"] = cfg.expert_replicas
    if cfg.expert_dispatch == "ffn":
        afd_extra["expert_dispatch"] = "ffn"
        progress(
            f"Mega over {cfg.num_ffn_ranks} FFN ranks (expert_dispatch ffn): each Attention rank "
            "sends its tokens to one FFN rank, and Mega dispatches and combines them among the "
            "FFN ranks itself"
        )
    if options.max_num_seqs != cfg.options.max_num_seqs:
        progress(
            "note: vLLM's CPU MLA path is not batch invariant; serving one sequence at a time "
            "(--max-num-seqs 1) on every server so outputs are comparable"
        )

    attention_args: tuple[str, ...] = ()
    if cfg.speculative_tokens:
        attention_args = mtp_speculative_args(cfg.speculative_tokens)
        progress(
            f"speculative decoding: DeepSeek MTP, {cfg.speculative_tokens} token(s) per step, on "
            "plain vLLM and the Attention role (the FFN role serves the MTP layer's experts)"
        )
    plain_extra = attention_args
    if cfg.attention_tp_size > 1:
        plain_extra += ("--tensor-parallel-size", str(cfg.attention_tp_size))
    plain_options = replace(options, extra_args=(*options.extra_args, *plain_extra))
    plain = plain_server(model, log_dir=log_dir, options=plain_options, progress=progress)
    plain.start()
    try:
        wait_until_healthy([plain])
        base = _run_batch(plain, cfg, progress)
        plain_rss = process_tree_rss(plain.pid) if plain.pid else None
    finally:
        plain.stop()
    plain_stats = ServerStats("plain", "monolithic", base.tokens_per_s, plain_rss, None)

    ffn_extra = ffn_env = None
    if cfg.quantized:
        from afd_models.models._quantized import REPORT_ERROR_ENV

        ffn_extra = cfg.ffn_extra
        ffn_env = {REPORT_ERROR_ENV: "1"}
        progress(
            f"quantized FFN experts ({cfg.ffn_compute}, {cfg.expert_quant}, group size "
            f"{cfg.expert_quant_group_size}); each FFN rank measures its first MoE layer against "
            f"fp32 ({REPORT_ERROR_ENV}=1)"
        )
    afd_options = options
    if cfg.num_stages > 1:
        afd_options = split_every_step(options)
        progress(
            "two stages: vLLM's DBO token thresholds set to 1 on the AFD servers, so every step "
            "of two or more requests splits (serving defaults: 32 decode / 512 prefill tokens)"
        )
    attention, ffns = afd_servers(
        model,
        log_dir=log_dir,
        options=afd_options,
        num_attention_ranks=cfg.num_attention_ranks,
        num_ffn_ranks=cfg.num_ffn_ranks,
        gate_on_attention=cfg.gate_on_attention,
        afd_extra=afd_extra or None,
        ffn_extra=ffn_extra,
        ffn_env=ffn_env,
        progress=progress,
        attention_args=attention_args,
    )
    try:
        for ffn in ffns:
            ffn.start()
        attention.start()
        wait_until_healthy([*ffns, attention])
        afd = _run_batch(attention, cfg, progress)
        for ffn in ffns:
            ffn.check_alive()
        rss = {s.name: process_tree_rss(s.pid) if s.pid else None for s in (attention, *ffns)}
        # While serving: each role's afd_* series on its own /metrics.
        metrics = {s.name: s.metrics_text() for s in (attention, *ffns)}
    finally:
        stop_all([attention, *ffns])
    att_bytes = parse_param_bytes(metrics[attention.name]).get("attention")
    ffn_ranks = tuple(
        FFNRankStats(
            rank,
            ffn.name,
            parse_param_bytes(metrics[ffn.name]).get("ffn"),
            parse_ffn_stats(metrics[ffn.name]).get(rank),
        )
        for rank, ffn in enumerate(ffns)
    )
    checks = (
        MetricsCheck(attention.name, "attention", afd_series_count(metrics[attention.name])),
        *(MetricsCheck(f.name, "ffn", afd_series_count(metrics[f.name])) for f in ffns),
    )
    attention_ranks = tuple(parse_attention_stats(metrics[attention.name]).values())
    servers = (
        plain_stats,
        ServerStats(attention.name, "attention", afd.tokens_per_s, rss[attention.name], att_bytes),
        *(ServerStats(r.name, "ffn", None, rss[r.name], r.param_bytes) for r in ffn_ranks),
    )
    gate = "attention" if cfg.gate_on_attention else "ffn"
    topology = f"{cfg.num_attention_ranks} attention : {cfg.num_ffn_ranks} ffn, gate on {gate}"
    if cfg.attention_tp_size > 1:
        topology += f", attention TP {cfg.attention_tp_size}"
    if cfg.speculative_tokens:
        topology += f", MTP {cfg.speculative_tokens} speculative token(s)"
    if cfg.num_stages > 1:
        topology += f", {cfg.num_stages} stages"
    if cfg.expert_replicas > 1:
        topology += f", {cfg.expert_replicas} replicas of each expert"
    parity = compare_parity(base.completions, afd.completions)
    quant = quant_summary(cfg, ffns, parity, metrics) if cfg.quantized else None
    return DemoReport(
        str(model), topology, parity, servers, ffn_ranks, quant, checks, attention_ranks
    )


def quant_summary(
    cfg: DemoConfig,
    ffns: Sequence[VLLMServer],
    parity: ParityResult,
    metrics: dict[str, str],
) -> QuantSummary:
    """The :class:`QuantSummary` of a quantized run from its FFN servers' ``/metrics`` texts
    (``metrics[server name]``; ``ffns[i]`` is FFN rank ``i``) and its parity against plain
    vLLM."""
    ranks = []
    for rank, ffn in enumerate(ffns):
        log = metrics.get(ffn.name, "")
        stats = parse_ffn_stats(log).get(rank)
        ranks.append(
            QuantRankStats(
                rank,
                ffn.name,
                parse_quantized(log).get(rank),
                parse_quant_error(log).get(rank),
                computed=stats is None or stats.tokens > 0,
            )
        )
    equal, total = token_match(parity)
    return QuantSummary(
        ffn_compute=cfg.ffn_compute,
        expert_quant=cfg.expert_quant,
        group_size=cfg.expert_quant_group_size,
        tolerance=QUANT_ERROR_TOLERANCE[cfg.expert_quant],
        ranks=tuple(ranks),
        equal_tokens=equal,
        total_tokens=total,
    )
