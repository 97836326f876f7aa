"""``afd demo``: serve one model with plain vLLM and with the AFD roles, compare, report.

Flow: build (or reuse) the tiny checkpoint unless a model path is given; run plain ``vllm serve``,
send the prompts (concurrently), record tokens/s and RSS, stop it; start the FFN rank servers
(one per FFN rank, each holding ``1/F`` of the routed experts) and the Attention role, send the
same prompts to the Attention role, record tokens/s, RSS per role process tree and the parameter
bytes each role reports (``AFD role=<role> param_bytes=<n>`` log lines), stop them all (Attention
first) and read each FFN rank's counters (``AFD FFN rank=<f> stats ...``: batching, tokens and
payload bytes received). Each server gets one untimed request before the timed batch. The report
holds per-prompt parity; the demo fails when any prompt differs. At most ``1 + F`` engines run
at a time (plain alone first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from afd_models.demo.client import BatchResult, complete_many
from afd_models.demo.parity import ParityResult, compare_parity
from afd_models.demo.servers import (
    EngineOptions,
    FFNStats,
    Progress,
    VLLMServer,
    afd_servers,
    parity_options,
    parse_ffn_stats,
    parse_param_bytes,
    plain_server,
    process_tree_rss,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinyFamily, TinySpec, ensure_tiny_checkpoint


@dataclass(frozen=True)
class DemoConfig:
    """What ``afd demo`` runs. ``model=None`` means the embedded tiny checkpoint of ``family``."""

    model: Path | None = None
    family: TinyFamily = "qwen3_moe"
    seed: int = 0
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    gate_on_attention: bool = False
    prompts: tuple[str, ...] = DEMO_PROMPTS
    max_tokens: int = 16
    concurrency: int = 3
    log_dir: Path = Path("afd-demo-logs")
    cache_dir: Path | None = None
    options: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        if self.num_attention_ranks < 1:
            raise ValueError(
                f"DemoConfig.num_attention_ranks={self.num_attention_ranks!r} must be >= 1"
            )
        if self.num_ffn_ranks < 1:
            raise ValueError(f"DemoConfig.num_ffn_ranks={self.num_ffn_ranks!r} must be >= 1")
        if self.num_ffn_ranks > 1 and not self.gate_on_attention:
            raise ValueError(
                f"DemoConfig.num_ffn_ranks={self.num_ffn_ranks!r} > 1 needs "
                "gate_on_attention=True (expert parallelism runs the router gate on Attention)"
            )
        if self.max_tokens < 1:
            raise ValueError(f"DemoConfig.max_tokens={self.max_tokens!r} must be >= 1")
        if self.concurrency < 1:
            raise ValueError(f"DemoConfig.concurrency={self.concurrency!r} must be >= 1")
        if not self.prompts:
            raise ValueError("DemoConfig.prompts must hold at least one prompt")


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
    reports (``AFD role=ffn param_bytes=<n>``, one entry per worker) and its last counters line
    (None when absent)."""

    rank: int
    name: str
    param_bytes: tuple[int, ...] | None
    stats: FFNStats | None


@dataclass(frozen=True)
class DemoReport:
    """Everything ``afd demo`` prints; ``ok`` is parity on every prompt."""

    model: str
    topology: str
    parity: ParityResult
    servers: tuple[ServerStats, ...]
    ffn_ranks: tuple[FFNRankStats, ...] = ()

    @property
    def ok(self) -> bool:
        return self.parity.ok


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


def render_report(report: DemoReport) -> str:
    """A plain-text report: one parity table (per prompt) and one table per server."""
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
                f"Attention rank(s) per call), {f.tokens} tokens ({f.tokens_per_call:.1f} per "
                "call)"
            )
        out.append("")
    n_bad = len(report.parity.mismatches)
    out.append(
        "PASS: all prompts identical"
        if report.ok
        else f"FAIL: {n_bad} of {len(report.parity.prompts)} prompts differ"
    )
    return "\n".join(out)


def resolve_model(cfg: DemoConfig, progress: Progress) -> Path:
    """The model directory to serve: ``cfg.model`` or the (cached) tiny checkpoint."""
    if cfg.model is not None:
        if not Path(cfg.model).exists():
            raise FileNotFoundError(f"model={str(cfg.model)!r} does not exist")
        return Path(cfg.model)
    progress(f"building tiny {cfg.family} checkpoint (seed {cfg.seed}) ...")
    path = ensure_tiny_checkpoint(TinySpec(family=cfg.family, seed=cfg.seed), cfg.cache_dir)
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
    if options.max_num_seqs != cfg.options.max_num_seqs:
        progress(
            "note: vLLM's CPU MLA path is not batch invariant; serving one sequence at a time "
            "(--max-num-seqs 1) on every server so outputs are comparable"
        )

    plain = plain_server(model, log_dir=log_dir, options=options, progress=progress)
    plain.start()
    try:
        wait_until_healthy([plain])
        base = _run_batch(plain, cfg, progress)
        plain_rss = process_tree_rss(plain.pid) if plain.pid else None
    finally:
        plain.stop()
    plain_stats = ServerStats("plain", "monolithic", base.tokens_per_s, plain_rss, None)

    attention, ffns = afd_servers(
        model,
        log_dir=log_dir,
        options=options,
        num_attention_ranks=cfg.num_attention_ranks,
        num_ffn_ranks=cfg.num_ffn_ranks,
        gate_on_attention=cfg.gate_on_attention,
        progress=progress,
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
    finally:
        stop_all([attention, *ffns])
    att_bytes = parse_param_bytes(attention.log_text()).get("attention")
    ffn_ranks = tuple(
        FFNRankStats(
            rank,
            ffn.name,
            parse_param_bytes(ffn.log_text()).get("ffn"),
            parse_ffn_stats(ffn.log_text()).get(rank),
        )
        for rank, ffn in enumerate(ffns)
    )
    servers = (
        plain_stats,
        ServerStats(attention.name, "attention", afd.tokens_per_s, rss[attention.name], att_bytes),
        *(ServerStats(r.name, "ffn", None, rss[r.name], r.param_bytes) for r in ffn_ranks),
    )
    gate = "attention" if cfg.gate_on_attention else "ffn"
    topology = f"{cfg.num_attention_ranks} attention : {cfg.num_ffn_ranks} ffn, gate on {gate}"
    parity = compare_parity(base.completions, afd.completions)
    return DemoReport(str(model), topology, parity, servers, ffn_ranks)
