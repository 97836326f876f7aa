"""The ``afd`` console script.

Subcommands:

* ``afd demo`` — serve a model with plain vLLM and with the AFD roles (``--ffn-ranks F``: F FFN
  rank servers, each holding ``1/F`` of the routed experts), compare greedy outputs token for
  token and print parity, tokens/s, weight bytes and RSS per role, and what each FFN rank
  received per step. Exit status 0 when every prompt is identical, 1 on any mismatch, 2 on a
  usage error, 3 when a server fails. With quantized experts (``--ffn-compute layered|mega
  --expert-quant w8a8|w4a8 [--expert-quant-group-size G]``) exact parity is not expected: it
  also prints each FFN rank's expert bytes vs bf16, the share of greedy tokens equal to plain
  fp32 vLLM and the measured error against fp32, and exits 1 when that error exceeds the
  scheme's tolerance (``afd_models.demo.run.QUANT_ERROR_TOLERANCE``) or was not measured,
  whatever the tokens.
* ``afd tiny`` — build (or find in the cache) a tiny checkpoint and print its path.
* ``afd bench`` — steady-state decode TPOT of AFD against plain vLLM on the tiny Qwen3-MoE
  (expert-parallel ``1:F`` deployments included, with the bytes they send per step; the
  quantized FFN computes at ``1:1`` unless ``--no-quantized``), and the raw gloo round trip (see
  :mod:`afd_models.demo.bench`); prints tables, writes JSON; with a hardware profile
  (``--hardware``, default the calibrated one when it exists) afd-plan's predicted TPOT beside
  each measured row. ``afd bench --profile`` measures this host's profile instead.
* ``afd plan`` — afd-plan's capacity planner: for a checkpoint's ``config.json``, a hardware
  profile (a file or a shipped name; default: this host's calibrated profile if
  ``~/.cache/afd/profile.json`` exists, else a shipped one, with a note) and a workload, the
  candidate deployments (A, F, stages, batch per Attention rank, expert quantization) best first
  by predicted tokens/s per device, with the colocated expert-parallel baseline; ``--json`` the
  same for machines, ``--plot`` the curve over A:F (needs matplotlib). Exit status 0 with at
  least one candidate, 1 when none fits memory and the TPOT target, 2 on a usage error.
* ``afd serve ...`` — ``vllm serve ...`` (see :mod:`afd_models.vllm_cli`); a malformed
  ``--additional-config`` or an invalid ``afd`` mapping exits with status 2 before vLLM starts,
  and so does an AFD setting refused when vLLM builds its config (``--data-parallel-size``
  disagreeing with ``num_attention_ranks``), the message naming the flag (and where the JSON
  breaks) or the AFD field.

``demo``, ``bench`` and ``tiny`` use :mod:`afd_models.demo`, imported only when they run: ``afd serve`` needs
neither that subpackage nor the ``demo`` extra's packages (``python -m afd_models.cli serve ...``
is how the demo harness starts its servers).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from afd_models.demo.run import DemoConfig

EXIT_OK: Final[int] = 0
EXIT_MISMATCH: Final[int] = 1
EXIT_USAGE: Final[int] = 2
EXIT_SERVER_ERROR: Final[int] = 3

#: ``--ffn-compute`` / ``--expert-quant`` choices: afd_core.config's ``FFN_COMPUTE_KINDS`` and
#: ``EXPERT_QUANT_SCHEMES`` (spelled here: afd_core.config imports torch, the parser must not).
FFN_COMPUTE_CHOICES: Final[tuple[str, ...]] = ("native", "layered", "mega")
EXPERT_QUANT_CHOICES: Final[tuple[str, ...]] = ("none", "w8a8", "w4a8")
#: The ``afd demo`` flag of each FFN-local AFD config field.
QUANT_FLAGS: Final[dict[str, str]] = {
    "ffn_compute": "--ffn-compute",
    "expert_quant": "--expert-quant",
    "expert_quant_group_size": "--expert-quant-group-size",
}

#: Packages of afd-models' ``demo`` extra each subcommand needs (a plain install lacks them).
DEMO_EXTRA_MODULES: Final[dict[str, tuple[str, ...]]] = {
    "demo": ("psutil", "requests", "tokenizers", "safetensors"),
    "tiny": ("tokenizers", "safetensors"),
    "bench": ("psutil", "requests", "tokenizers", "safetensors"),
}


def build_parser() -> argparse.ArgumentParser:
    from afd_models.demo.tiny import FAMILIES

    parser = argparse.ArgumentParser(prog="afd", description="Attention-FFN Disaggregation tools")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="compare AFD serving with plain vLLM on a model",
        description="Serve a model with plain vLLM and with the AFD Attention/FFN roles, send "
        "greedy prompts and compare outputs token for token.",
    )
    demo.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: tiny model)"
    )
    demo.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="tiny model family")
    demo.add_argument("--seed", type=int, default=0, help="tiny model weight seed")
    demo.add_argument(
        "--attention-ranks", type=int, default=1, help="Attention ranks (data parallel)"
    )
    demo.add_argument(
        "--ffn-ranks",
        type=int,
        default=1,
        help="FFN ranks (expert parallel: each holds 1/F of the routed experts; F > 1 needs "
        "--gate attention)",
    )
    demo.add_argument(
        "--expert-replicas",
        type=int,
        default=1,
        metavar="R",
        help="how many of the --ffn-ranks hold each routed expert (1..F; > 1: elastic FFN "
        "ranks, any one of which may be lost, started or stopped while serving)",
    )
    demo.add_argument(
        "--speculative",
        type=int,
        default=0,
        metavar="N",
        help="speculative decoding with DeepSeek's MTP drafter, N tokens per step (plain vLLM and "
        "the Attention role alike; the tiny deepseek_v3 checkpoint gets an MTP layer whose "
        "experts the FFN role serves)",
    )
    demo.add_argument(
        "--tp",
        type=int,
        default=1,
        help="the Attention role's --tensor-parallel-size (plain vLLM runs with the same); "
        "each TP worker sends its slice of the tokens to the FFN ranks",
    )
    demo.add_argument(
        "--gate",
        choices=("attention", "ffn"),
        default="ffn",
        help="where the MoE router gate runs (attention is required by --ffn-ranks > 1)",
    )
    demo.add_argument(
        "--stages",
        type=int,
        choices=(1, 2),
        default=1,
        help="AFD num_stages: 2 splits each step into two micro-batches and overlaps one's FFN "
        "round trip with the other's attention",
    )
    demo.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt")
    demo.add_argument("--concurrency", type=int, default=3, help="requests in flight")
    demo.add_argument(
        "--prompt", action="append", default=None, help="a prompt (repeatable; default: built-in)"
    )
    demo.add_argument("--log-dir", type=Path, default=Path("afd-demo-logs"))
    demo.add_argument("--cache-dir", type=Path, default=None, help="tiny checkpoint cache")
    demo.add_argument(
        "--dtype",
        default=None,
        help="engine dtype (default: float32 for the tiny model, the checkpoint's for --model)",
    )
    demo.add_argument(
        "--no-enforce-eager", action="store_true", help="let vLLM compile (slower start)"
    )
    demo.add_argument("--max-model-len", type=int, default=512)
    demo.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="engine batch limit (default: vLLM's; 1 for DeepSeek on CPU, see README)",
    )
    demo.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per engine")
    demo.add_argument(
        "--ffn-compute",
        choices=FFN_COMPUTE_CHOICES,
        default="native",
        help="how the FFN ranks compute their experts: vLLM's FusedMoE (native) or "
        "afd-compute-npu's layered / mega on quantized experts (needs --expert-quant)",
    )
    demo.add_argument(
        "--expert-quant",
        choices=EXPERT_QUANT_CHOICES,
        default="none",
        help="quantize the FFN ranks' routed experts at load (w8a8 / w4a8; needs --ffn-compute "
        "layered or mega); the demo then checks the measured error against fp32, not parity",
    )
    demo.add_argument(
        "--expert-quant-group-size",
        type=int,
        default=0,
        help="W4A8 scale group (input rows per scale); 0 = per channel",
    )

    bench = sub.add_parser(
        "bench",
        help="steady-state decode TPOT of AFD vs plain vLLM (tiny Qwen3-MoE)",
        description="Measure TPOT of plain vLLM and of AFD (gate on FFN: 1:1 at each batch size, "
        "2:1 at the largest, and 1:1 with the FFN rank's quantized computes unless "
        "--no-quantized; gate on Attention: 1:F for each --ffn-ranks F at each batch size, "
        "with the bytes sent per step) on the tiny Qwen3-MoE, and the raw gloo round trip of a "
        "hidden-state message.",
    )
    bench.add_argument("--batch-sizes", default="1,4,16", help="comma-separated decode batch sizes")
    bench.add_argument(
        "--ffn-ranks",
        default="1,2",
        help="comma-separated FFN rank counts of the gate-on-Attention 1:F deployments (1, the "
        "bytes-per-step reference, always runs)",
    )
    bench.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the quantized FFN computes at 1:1, gate on FFN (layered w8a8, mega "
        "w4a8 per channel)",
    )
    bench.add_argument(
        "--stages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure num_stages=2 at 1:1, gate on FFN, at each batch size >= 2 (the share "
        "of the MoE-layer round trips the second stage hides)",
    )
    bench.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    bench.add_argument("--repeats", type=int, default=3, help="timed batches per row")
    bench.add_argument(
        "--starts",
        type=int,
        default=1,
        help="engine starts per deployment, in rounds over every deployment; a row is the "
        "median of the per-start medians (a setup's TPOT moves between starts of the same "
        "engines on a small VM, and the VM drifts over a run)",
    )
    bench.add_argument("--out", type=Path, default=None, help="JSON result file")
    bench.add_argument("--log-dir", type=Path, default=Path("afd-bench-logs"))
    bench.add_argument("--cache-dir", type=Path, default=None, help="tiny checkpoint cache")
    bench.add_argument(
        "--profile",
        action="store_true",
        help="instead of the serving bench: measure this host's GEMM rate, gloo round trips and "
        "thread wake-up and write the hardware profile afd plan reads (to --out, default: "
        "~/.cache/afd/profile.json, afd plan's default profile)",
    )
    bench.add_argument(
        "--quick", action="store_true", help="with --profile: fewer repeats (a harness check)"
    )
    bench.add_argument(
        "--engine",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --profile: also measure vLLM's own costs on the tiny model (plain at batch 1 "
        "and 16, AFD 1:1 at batch 1; a few minutes): the profile's step, sequence and message "
        "overheads",
    )
    bench.add_argument(
        "--hardware",
        default=None,
        help="compare the measured TPOT with afd plan's prediction on this profile (file or "
        "shipped name; default: the calibrated profile at $XDG_CACHE_HOME/afd/profile.json when "
        "it exists, else no comparison)",
    )

    plan = sub.add_parser(
        "plan",
        help="predict the best A:F deployments of a model on a hardware profile",
        description="Rank candidate AFD deployments (Attention ranks A, FFN ranks F, stages, "
        "batch per Attention rank, expert quantization) by predicted decode tokens/s per device "
        "with afd-plan's cost model, next to the colocated expert-parallel baseline.",
    )
    plan.add_argument(
        "--model",
        type=Path,
        required=True,
        help="checkpoint folder, its config.json, or a public shape's name (deepseek-v3, "
        "deepseek-v3.2)",
    )
    plan.add_argument(
        "--hardware",
        default=None,
        help="profile file (.toml/.json) or shipped name (default: the calibrated profile at "
        "$XDG_CACHE_HOME/afd/profile.json if present, else h100-sxm)",
    )
    plan.add_argument("--input-len", type=int, default=1024, help="input tokens per request")
    plan.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    plan.add_argument("--tpot-ms", type=float, default=None, help="TPOT target (ms)")
    plan.add_argument("--devices", type=int, default=None, help="device budget (A + F)")
    plan.add_argument(
        "--expert-quant",
        choices=EXPERT_QUANT_CHOICES,
        action="append",
        default=None,
        help="expert weight format to consider (repeatable; default: all)",
    )
    plan.add_argument(
        "--dense-quant",
        choices=EXPERT_QUANT_CHOICES,
        default="none",
        help="format of every non-expert linear weight",
    )
    plan.add_argument(
        "--kv-dtype",
        choices=("model", "bfloat16", "float16", "float32", "int8"),
        default="model",
        help="KV-cache element format",
    )
    plan.add_argument(
        "--routing",
        choices=("uniform", "balanced"),
        default="uniform",
        help="expert routing statistics (balanced = forced balance)",
    )
    plan.add_argument(
        "--expert-skew",
        type=float,
        default=1.0,
        help="hottest FFN rank's load over the mean (1 = none)",
    )
    plan.add_argument("--top", type=int, default=10, help="rows to print")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--plot", type=Path, default=None, help="write tokens/s per device vs A:F")

    tiny = sub.add_parser("tiny", help="build a tiny checkpoint and print its directory")
    tiny.add_argument(
        "--family", choices=FAMILIES, default=None, help="tiny model family (default qwen3_moe)"
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--width",
        choices=("tiny", "wide"),
        default=None,
        help="wide: Qwen3-MoE at hidden 1024 (96 MiB of experts per MoE layer; default tiny)",
    )
    tiny.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        help="DeepSeek-V3 multi-token-prediction layers (speculative decoding with deepseek_mtp; "
        "default 0)",
    )
    tiny.add_argument(
        "--published",
        metavar="KEY",
        default=None,
        help="instead of --family: a published model's config.json with only its sizes scaled "
        "(keys: afd_models/demo/published/*.config.json, e.g. qwen3-30b-a3b, glm-4.7)",
    )
    tiny.add_argument(
        "--no-mtp-weights",
        action="store_true",
        help="with --published: keep a declared MTP layer but write none of its weights",
    )
    tiny.add_argument(
        "--dequantized",
        action="store_true",
        help="with --published: drop the config's quantization_config (as BF16 conversions do)",
    )
    tiny.add_argument("--cache-dir", type=Path, default=None)
    return parser


def _positive(parser: argparse.ArgumentParser, flag: str, value: float) -> None:
    if value <= 0:
        parser.error(f"{flag}={value!r} must be > 0")
    if not math.isfinite(value):
        parser.error(f"{flag}={value!r} must be a finite number > 0")


def _mtp_layers(model: Path) -> int:
    """``num_nextn_predict_layers`` of ``model``'s ``config.json`` (0 when absent or unreadable)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("num_nextn_predict_layers") or 0) if isinstance(config, dict) else 0


def parse_demo_config(argv: Sequence[str]) -> DemoConfig:
    """Parse ``afd demo ...`` arguments (without the ``demo`` word) into a :class:`DemoConfig`.

    Usage errors exit with status 2 (argparse) naming the flag and the bad value.
    """
    parser = build_parser()
    return demo_config_from_namespace(parser, parser.parse_args(["demo", *argv]))


def demo_config_from_namespace(
    parser: argparse.ArgumentParser, ns: argparse.Namespace
) -> DemoConfig:
    """Validate parsed ``demo`` arguments; errors go through ``parser.error`` (exit status 2)."""
    from afd_models.demo.run import DemoConfig
    from afd_models.demo.servers import EngineOptions
    from afd_models.demo.tiny import DEMO_PROMPTS

    for flag, value in (
        ("--attention-ranks", ns.attention_ranks),
        ("--ffn-ranks", ns.ffn_ranks),
        ("--tp", ns.tp),
        ("--max-tokens", ns.max_tokens),
        ("--concurrency", ns.concurrency),
        ("--max-model-len", ns.max_model_len),
        ("--startup-timeout", ns.startup_timeout),
    ):
        _positive(parser, flag, value)
    if ns.max_num_seqs is not None:
        _positive(parser, "--max-num-seqs", ns.max_num_seqs)
    if ns.seed < 0:
        parser.error(f"--seed={ns.seed!r} must be >= 0")
    if ns.model is not None and not ns.model.exists():
        parser.error(f"--model={str(ns.model)!r} does not exist")
    if ns.speculative < 0:
        parser.error(f"--speculative={ns.speculative!r} must be >= 0")
    if ns.speculative and ns.model is None and ns.family != "deepseek_v3":
        parser.error(
            f"--speculative={ns.speculative!r} needs --family deepseek_v3 (the tiny checkpoint "
            "whose MTP layer drafts) or a --model with MTP layers"
        )
    if ns.speculative and ns.model is not None and (layers := _mtp_layers(ns.model)) < 1:
        parser.error(
            f"--speculative={ns.speculative!r} needs a --model with MTP layers; "
            f"{str(ns.model)!r} declares num_nextn_predict_layers={layers} in its config.json"
        )
    if ns.ffn_ranks > 1 and ns.gate != "attention":
        parser.error(
            f"--ffn-ranks={ns.ffn_ranks!r} needs --gate attention (expert parallelism: the FFN "
            "ranks hold disjoint experts, so the router gate runs on the Attention role)"
        )
    if not 1 <= ns.expert_replicas <= ns.ffn_ranks:
        parser.error(
            f"--expert-replicas={ns.expert_replicas!r}; allowed: 1..{ns.ffn_ranks} (--ffn-ranks: "
            "each routed expert lives on at most every FFN rank)"
        )
    _check_quant_flags(parser, ns)
    dtype = ns.dtype if ns.dtype is not None else ("float32" if ns.model is None else None)
    options = EngineOptions(
        dtype=dtype,
        enforce_eager=not ns.no_enforce_eager,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        startup_timeout_s=ns.startup_timeout,
    )
    return DemoConfig(
        model=ns.model,
        family=ns.family,
        seed=ns.seed,
        num_attention_ranks=ns.attention_ranks,
        num_ffn_ranks=ns.ffn_ranks,
        attention_tp_size=ns.tp,
        speculative_tokens=ns.speculative,
        gate_on_attention=ns.gate == "attention",
        num_stages=ns.stages,
        expert_replicas=ns.expert_replicas,
        prompts=tuple(ns.prompt) if ns.prompt else DEMO_PROMPTS,
        max_tokens=ns.max_tokens,
        concurrency=ns.concurrency,
        log_dir=ns.log_dir,
        cache_dir=ns.cache_dir,
        options=options,
        ffn_compute=ns.ffn_compute,
        expert_quant=ns.expert_quant,
        expert_quant_group_size=ns.expert_quant_group_size,
    )


def _check_quant_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """``--ffn-compute`` / ``--expert-quant`` / ``--expert-quant-group-size`` through afd-core's
    own validation of the FFN role's fields; an error names the flag of the rejected field."""
    from afd_core.config import AFDConfig
    from afd_core.errors import AFDConfigError

    fields = {
        "ffn_compute": ns.ffn_compute,
        "expert_quant": ns.expert_quant,
        "expert_quant_group_size": ns.expert_quant_group_size,
    }
    try:
        AFDConfig.from_mapping({"role": "ffn", **fields})
    except AFDConfigError as e:
        flag = QUANT_FLAGS.get(e.field)
        if flag is None:  # not one of the three (cannot happen with these keys)
            parser.error(f"--ffn-compute/--expert-quant: {e}")
        parser.error(f"{flag}={fields[e.field]!r}: {e}")


def missing_demo_modules(command: str) -> list[str]:
    """The ``demo`` extra's packages that ``afd <command>`` needs and this environment lacks."""
    return [m for m in DEMO_EXTRA_MODULES.get(command, ()) if importlib.util.find_spec(m) is None]


def _demo(cfg: DemoConfig) -> int:
    from afd_models.demo.client import CompletionError
    from afd_models.demo.run import render_report, run_demo
    from afd_models.demo.servers import ServerError

    try:
        report = run_demo(cfg, progress=lambda msg: print(msg, flush=True))
    except (ServerError, CompletionError) as e:
        print(f"afd demo: server failure: {e}", file=sys.stderr, flush=True)
        return EXIT_SERVER_ERROR
    print(render_report(report), flush=True)
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _int_list(parser: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, ...]:
    """``"1,4,16"`` -> ``(1, 4, 16)``; anything else is a usage error naming ``flag``."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"afd bench: {flag}={text!r}: expected comma-separated integers")


def _bench_profile(ns: argparse.Namespace) -> int:
    from afd_plan.hardware import calibrated_profile_path

    from afd_models.demo.calibrate import calibrate, measure_engine, write_profile

    out = ns.out if ns.out is not None else calibrated_profile_path()
    progress = lambda msg: print(msg, flush=True)  # noqa: E731
    cal = calibrate(quick=ns.quick, progress=progress)
    engine = None
    if ns.engine:
        engine = measure_engine(
            cache_dir=ns.cache_dir, log_dir=ns.log_dir, quick=ns.quick, progress=progress
        )
    profile = write_profile(cal, out, engine)
    print(
        f"peak fp32 {profile['peak_flops']['fp32'] / 1e9:.1f} GFLOP/s, memory "
        f"{profile['memory_bandwidth'] / 1e9:.1f} GB/s, link {profile['link_bandwidth'] / 1e9:.2f} "
        f"GB/s + {profile['link_latency'] * 1e6:.0f} us, message "
        f"{profile['message_overhead'] * 1e6:.1f} us (thread wake-up {cal.wakeup_s * 1e6:.1f} us)"
        + (
            f", engine step {profile['step_overhead'] * 1e3:.2f} ms + "
            f"{profile['sequence_overhead'] * 1e3:.3f} ms per sequence"
            if engine is not None
            else ""
        )
        + (
            f", {profile['host_cores']} cores shared: oversubscription cost "
            f"{profile['oversubscription_cost']:.2f}"
            if "oversubscription_cost" in profile
            else ""
        )
    )
    print(f"wrote {out} (afd plan's default profile at that path)")
    return EXIT_OK


def _bench(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    if ns.profile:
        if ns.hardware is not None:
            parser.error("afd bench: --hardware goes without --profile (it compares a bench run)")
        return _bench_profile(ns)
    if ns.quick:
        parser.error("afd bench: --quick goes with --profile")
    if not ns.engine:
        parser.error("afd bench: --no-engine goes with --profile")
    from afd_plan.errors import AFDPlanError
    from afd_plan.hardware import calibrated_profile_path, load_profile

    plan_profile: str | Path | None = ns.hardware
    if plan_profile is None and calibrated_profile_path().is_file():
        plan_profile = calibrated_profile_path()
    if plan_profile is not None:
        try:
            load_profile(plan_profile)  # refused now, not after the engines ran
        except AFDPlanError as e:
            print(f"afd bench: error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
    from afd_models.demo.bench import BenchConfig, run_bench
    from afd_models.demo.servers import ServerError

    sizes = _int_list(parser, "--batch-sizes", ns.batch_sizes)
    ffn_ranks = _int_list(parser, "--ffn-ranks", ns.ffn_ranks)
    try:
        cfg = BenchConfig(
            batch_sizes=sizes,
            ffn_ranks=ffn_ranks,
            max_tokens=ns.max_tokens,
            repeats=ns.repeats,
            starts=ns.starts,
            quantized=ns.quantized,
            stages=ns.stages,
            out=ns.out,
            log_dir=ns.log_dir,
            cache_dir=ns.cache_dir,
            plan_profile=plan_profile,
        )
    except ValueError as e:
        parser.error(f"afd bench: {e}")
    try:
        run_bench(cfg, progress=lambda msg: print(msg, flush=True))
    except ServerError as e:
        print(f"afd bench: server failure: {e}", file=sys.stderr, flush=True)
        return EXIT_SERVER_ERROR
    return EXIT_OK


def _plan_hardware(spec: str | None) -> tuple[str | Path, str | None]:
    """The profile ``afd plan`` uses and a note when it fell back to a shipped default."""
    from afd_plan.hardware import DEFAULT_PROFILE, calibrated_profile_path

    if spec is not None:
        return spec, None
    calibrated = calibrated_profile_path()
    if calibrated.is_file():
        return calibrated, f"afd plan: using the calibrated profile {calibrated}"
    return DEFAULT_PROFILE, (
        f"afd plan: no calibrated profile at {calibrated}; using the shipped {DEFAULT_PROFILE!r} "
        "(pass --hardware NAME|FILE)"
    )


def run_plan(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``afd plan``: usage errors (a bad flag, config.json or profile) exit 2 naming the field."""
    import json

    from afd_plan.errors import AFDPlanError
    from afd_plan.hardware import load_profile
    from afd_plan.plan import search
    from afd_plan.report import plan_json, plot_ratio, render_table
    from afd_plan.shape import load_model_shape
    from afd_plan.workload import QUANT_SCHEMES, Workload

    for flag, value in (
        ("--input-len", ns.input_len),
        ("--output-len", ns.output_len),
        ("--top", ns.top),
    ):
        _positive(parser, flag, value)
    if ns.tpot_ms is not None:
        _positive(parser, "--tpot-ms", ns.tpot_ms)
    try:
        spec, note = _plan_hardware(ns.hardware)
        if note:
            print(note, file=sys.stderr, flush=True)
        hw = load_profile(spec)
        shape = load_model_shape(ns.model)
        work = Workload(
            input_len=ns.input_len,
            output_len=ns.output_len,
            kv_dtype=ns.kv_dtype,
            dense_quant=ns.dense_quant,
            routing=ns.routing,
            expert_skew=ns.expert_skew,
        )
        result = search(
            shape,
            work,
            hw,
            devices=ns.devices,
            tpot_target_s=None if ns.tpot_ms is None else ns.tpot_ms / 1e3,
            expert_quants=tuple(dict.fromkeys(ns.expert_quant or QUANT_SCHEMES)),
        )
        if ns.plot is not None:
            plot_ratio(result, ns.plot)
    except AFDPlanError as e:
        print(f"afd plan: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if ns.json:
        print(json.dumps(plan_json(result, shape, hw, work), indent=2), flush=True)
    else:
        print(render_table(result, shape, hw, work, top=ns.top), flush=True)
    return EXIT_OK if result.candidates else EXIT_MISMATCH


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``afd`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:
        # `afd serve ...` is `vllm serve ...`, usable where the stock `vllm` script is broken.
        from afd_core.errors import AFDConfigError, AFDModelError

        from afd_models.vllm_cli import run_vllm_cli

        try:
            run_vllm_cli(args)
        except (AFDConfigError, AFDModelError) as e:
            # Raised before any engine starts: bad --additional-config JSON or AFD mapping, a
            # local checkpoint AFD does not serve (checked before vLLM is imported), or a
            # setting or checkpoint the AFD config patch refuses when vLLM builds its config in
            # this process (e.g. --data-parallel-size mismatch).
            print(f"afd serve: error: {e}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        return EXIT_OK
    parser = build_parser()
    ns = parser.parse_args(args)
    missing = missing_demo_modules(ns.command)
    if missing:
        print(
            f"afd {ns.command}: needs {', '.join(missing)} from afd-models' `demo` extra "
            "(included in `cpu` and `cuda`): pip install 'afd-models[demo]'",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_USAGE
    if ns.command == "demo":
        return _demo(demo_config_from_namespace(parser, ns))
    if ns.command == "bench":
        return _bench(parser, ns)
    if ns.command == "plan":
        return run_plan(parser, ns)
    print(_tiny(parser, ns))
    return EXIT_OK


def _tiny(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> Path:
    from afd_models.demo.published import PublishedSpec, ensure_published_checkpoint
    from afd_models.demo.tiny import TinySpec, ensure_tiny_checkpoint

    if ns.published is None:
        if ns.no_mtp_weights or ns.dequantized:
            parser.error("afd tiny: --no-mtp-weights and --dequantized need --published KEY")
        try:
            spec = TinySpec(
                family=ns.family or "qwen3_moe",
                seed=ns.seed,
                width=ns.width or "tiny",
                mtp_layers=ns.mtp_layers or 0,
            )
        except ValueError as e:
            parser.error(f"afd tiny: {e}")
        return ensure_tiny_checkpoint(spec, ns.cache_dir)
    given = [
        flag
        for flag, value in (
            ("--family", ns.family),
            ("--width", ns.width),
            ("--mtp-layers", ns.mtp_layers),
        )
        if value is not None
    ]
    if given:
        parser.error(
            f"afd tiny --published {ns.published}: {', '.join(given)} shape the tiny builder's "
            "checkpoints, not a published config (its sizes are scaled, its MTP layers are the "
            "config's); allowed with --published: --seed, --no-mtp-weights, --dequantized"
        )
    try:
        published = PublishedSpec(
            ns.published,
            draft_weights=not ns.no_mtp_weights,
            dequantized=ns.dequantized,
            seed=ns.seed,
        )
    except ValueError as e:
        parser.error(f"afd tiny --published: {e}")
    return ensure_published_checkpoint(published, ns.cache_dir)


if __name__ == "__main__":
    sys.exit(main())
