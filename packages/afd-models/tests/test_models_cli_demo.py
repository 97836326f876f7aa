"""``afd`` CLI: argument parsing, report rendering and exit codes (no vLLM started)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from afd_models import cli
from afd_models.demo import run
from afd_models.demo.client import BatchResult, Completion
from afd_models.demo.parity import compare_parity
from afd_models.demo.run import DemoConfig, DemoReport, FFNRankStats, ServerStats, render_report
from afd_models.demo.servers import FFNStats, QuantReport, ServerExitedError

sys.path.insert(0, str(Path(__file__).parent))
from afd_models.demo.tiny import DEMO_PROMPTS
from afd_models_fake_servers import FakeServer, MetricsText


def test_demo_defaults_are_the_tiny_qwen_model() -> None:
    cfg = cli.parse_demo_config([])
    assert cfg.model is None
    assert cfg.family == "qwen3_moe"
    assert cfg.num_attention_ranks == 1
    assert cfg.num_ffn_ranks == 1
    assert cfg.gate_on_attention is False
    assert cfg.prompts == DEMO_PROMPTS
    assert cfg.max_tokens >= 16
    assert cfg.options.dtype == "float32"
    assert cfg.options.enforce_eager is True
    assert cfg.num_stages == 1


def test_demo_flags_map_to_config(tmp_path: Path) -> None:
    cfg = cli.parse_demo_config(
        [
            "--family",
            "deepseek_v2",
            "--gate",
            "attention",
            "--attention-ranks",
            "2",
            "--max-tokens",
            "20",
            "--prompt",
            "one",
            "--prompt",
            "two",
            "--concurrency",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "--no-enforce-eager",
            "--seed",
            "3",
        ]
    )
    assert (cfg.family, cfg.gate_on_attention, cfg.num_attention_ranks) == ("deepseek_v2", True, 2)
    assert (cfg.max_tokens, cfg.prompts, cfg.concurrency, cfg.seed) == (20, ("one", "two"), 2, 3)
    assert cfg.log_dir == tmp_path / "logs"
    assert cfg.options.enforce_eager is False
    assert cfg.options.max_num_seqs is None
    assert cli.parse_demo_config(["--max-num-seqs", "4"]).options.max_num_seqs == 4
    assert cli.parse_demo_config(["--stages", "2"]).num_stages == 2
    replicated = ["--ffn-ranks", "2", "--gate", "attention", "--expert-replicas", "2"]
    assert cli.parse_demo_config(replicated).expert_replicas == 2
    assert cli.parse_demo_config(["--tp", "2"]).attention_tp_size == 2


def test_qwen3_moe_accepts_the_gate_on_attention_and_several_ffn_ranks() -> None:
    cfg = cli.parse_demo_config(["--gate", "attention"])
    assert (cfg.family, cfg.gate_on_attention, cfg.num_ffn_ranks) == ("qwen3_moe", True, 1)
    cfg = cli.parse_demo_config(
        ["--family", "qwen3_moe", "--gate", "attention", "--ffn-ranks", "2"]
    )
    assert (cfg.family, cfg.gate_on_attention, cfg.num_ffn_ranks) == ("qwen3_moe", True, 2)
    cfg = cli.parse_demo_config(
        ["--family", "deepseek_v2", "--gate", "attention", "--ffn-ranks", "4"]
    )
    assert (cfg.family, cfg.gate_on_attention, cfg.num_ffn_ranks) == ("deepseek_v2", True, 4)
    assert cli.parse_demo_config(["--ffn-ranks", "1"]).num_ffn_ranks == 1
    for gate in ("ffn", "attention"):
        cfg = cli.parse_demo_config(["--family", "deepseek_v3", "--gate", gate])
        assert (cfg.family, cfg.gate_on_attention) == ("deepseek_v3", gate == "attention")


def test_demo_config_takes_deepseek_v3_expert_parallel_and_quantized() -> None:
    # noaux_tc's correction bias loads where the experts are selected (the Attention role with
    # expert parallelism, the quantized computes' router with one FFN rank), so both run.
    ep = DemoConfig(family="deepseek_v3", num_ffn_ranks=2, gate_on_attention=True)
    assert (ep.family, ep.num_ffn_ranks) == ("deepseek_v3", 2)
    quant = DemoConfig(family="deepseek_v3", ffn_compute="layered", expert_quant="w8a8")
    assert (quant.ffn_compute, quant.expert_quant) == ("layered", "w8a8")


def test_demo_runs_mega_over_several_ffn_ranks_with_the_ffn_dispatching() -> None:
    """Mega dispatches among the FFN ranks itself: with --ffn-ranks 2 the demo's roles get
    ``expert_dispatch: ffn``; with one FFN rank, and for Layered, the Attention role dispatches."""
    argv = ["--ffn-ranks", "2", "--gate", "attention", "--ffn-compute", "mega"]
    cfg = cli.parse_demo_config([*argv, "--expert-quant", "w8a8"])
    assert (cfg.num_ffn_ranks, cfg.expert_dispatch) == (2, "ffn")
    assert DemoConfig(ffn_compute="mega", expert_quant="w8a8").expert_dispatch == "attention"
    layered = DemoConfig(
        num_ffn_ranks=2, gate_on_attention=True, ffn_compute="layered", expert_quant="w8a8"
    )
    assert layered.expert_dispatch == "attention"
    with pytest.raises(ValueError) as err:  # Mega places each expert on one FFN rank
        DemoConfig(
            num_ffn_ranks=2,
            gate_on_attention=True,
            expert_replicas=2,
            ffn_compute="mega",
            expert_quant="w8a8",
        )
    assert "expert_dispatch" in str(err.value) and "expert_replicas=2" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ffn_ranks": 0}, "DemoConfig.num_ffn_ranks=0 must be >= 1"),
        (
            {"num_ffn_ranks": 2},
            "DemoConfig.num_ffn_ranks=2 > 1 needs gate_on_attention=True (expert parallelism "
            "runs the router gate on Attention)",
        ),
    ],
)
def test_demo_config_rejects_bad_ffn_ranks(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        DemoConfig(**kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message
    assert DemoConfig(num_ffn_ranks=2, gate_on_attention=True).num_ffn_ranks == 2


def test_real_model_keeps_checkpoint_dtype(tmp_path: Path) -> None:
    cfg = cli.parse_demo_config(["--model", str(tmp_path)])
    assert cfg.model == tmp_path
    assert cfg.options.dtype is None
    assert cli.parse_demo_config(
        ["--model", str(tmp_path), "--dtype", "bfloat16"]
    ).options.dtype == ("bfloat16")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--attention-ranks", "0"], "--attention-ranks=0"),
        (["--max-tokens", "-1"], "--max-tokens=-1"),
        (["--seed", "-2"], "--seed=-2"),
        (["--max-num-seqs", "0"], "--max-num-seqs=0"),
        (["--ffn-ranks", "0"], "error: --ffn-ranks=0 must be > 0"),
        (["--ffn-ranks", "-3", "--gate", "attention"], "error: --ffn-ranks=-3 must be > 0"),
        (
            ["--ffn-ranks", "2"],
            "error: --ffn-ranks=2 needs --gate attention (expert parallelism: the FFN ranks hold "
            "disjoint experts, so the router gate runs on the Attention role)",
        ),
        (["--ffn-ranks", "3", "--gate", "ffn"], "error: --ffn-ranks=3 needs --gate attention"),
        (["--ffn-ranks", "two"], "invalid int value: 'two'"),
        (["--model", "/does/not/exist"], "--model='/does/not/exist'"),
        (["--family", "llama"], "invalid choice: 'llama'"),
        (["--stages", "3"], "argument --stages: invalid choice: 3"),
        (["--expert-replicas", "2"], "--expert-replicas=2; allowed: 1..1 (--ffn-ranks"),
        (["--expert-replicas", "0"], "--expert-replicas=0; allowed: 1..1"),
        (["--tp", "0"], "error: --tp=0 must be > 0"),
    ],
)
def test_demo_usage_errors_exit_2_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(["demo", *argv])
    assert err.value.code == cli.EXIT_USAGE
    assert needle in capsys.readouterr().err


def _report(actual_b: tuple[int, ...]) -> DemoReport:
    base = [Completion("a", "", (1, 2), 0.1), Completion("b", "", (3, 4), 0.1)]
    cand = [Completion("a", "", (1, 2), 0.1), Completion("b", "", actual_b, 0.1)]
    servers = (
        ServerStats("plain", "monolithic", 12.5, 3 * 1024**3, None),
        ServerStats("afd-attention", "attention", 10.0, 2 * 1024**2, (2048, 2048)),
        ServerStats("afd-ffn", "ffn", None, None, None),
    )
    return DemoReport("/m", "1 attention : 1 ffn, gate on ffn", compare_parity(base, cand), servers)


def test_render_report_pass() -> None:
    text = render_report(_report((3, 4)))
    assert "PASS: all prompts identical" in text
    assert text.count("identical") == 3  # two rows + the verdict
    lines = {
        line.split("|")[1].strip(): line
        for line in text.splitlines()
        if line.startswith("| afd") or line.startswith("| plain")
    }
    assert "12.5" in lines["plain"] and "3.0 GiB" in lines["plain"]
    assert "2.0 KiB / 2.0 KiB" in lines["afd-attention"] and "2.0 MiB" in lines["afd-attention"]
    assert lines["afd-ffn"].count("n/a") == 2


def test_ffn_stats_are_parsed_and_rendered() -> None:
    from afd_models.demo.servers import parse_ffn_stats

    text = (
        MetricsText()
        .ffn(0, steps=10, calls=40, tokens=200, nbytes=20480, peers=2, layers=4)
        .param_bytes("ffn", 0, 5)
        .text()
    )
    stats = parse_ffn_stats(text)
    assert set(stats) == {0}
    s = stats[0]
    assert (s.steps, s.compute_calls, s.tokens, s.bytes, s.peers, s.layers) == (
        10,
        40,
        200,
        20480,
        2,
        4,
    )
    assert s.layer_calls == ((0, 10), (1, 10), (2, 10), (3, 10))
    assert (s.calls_per_step, s.tokens_per_call) == (4.0, 5.0)
    assert (s.tokens_per_step, s.bytes_per_step) == (20.0, 2048.0)
    assert parse_ffn_stats("") == {}
    rank = FFNRankStats(0, "afd-ffn", (3 * 1024**2,), s)
    report = dataclasses.replace(_report((3, 4)), ffn_ranks=(rank,))
    text = render_report(report)
    assert (
        "FFN rank 0 batching: 10 steps, 40 compute calls (4.0 per step over 4 MoE layers, "
        "2 Attention peer(s) per call), 200 tokens (5.0 per call)"
    ) in text.splitlines()


def _stats(rank: int, steps: int, tokens: int, nbytes: int) -> FFNStats:
    return FFNStats(
        rank=rank,
        steps=steps,
        compute_calls=steps * 4,
        tokens=tokens,
        bytes=nbytes,
        peers=1,
        layers=4,
    )


def test_render_report_prints_each_ffn_rank() -> None:
    ranks = (
        FFNRankStats(0, "afd-ffn0", (1536 * 1024,), _stats(0, 50, 545, 5734400)),
        FFNRankStats(1, "afd-ffn1", (1536 * 1024,), _stats(1, 50, 551, 512)),
        FFNRankStats(2, "afd-ffn2", None, None),
    )
    report = dataclasses.replace(
        _report((3, 4)), topology="1 attention : 3 ffn, gate on attention", ffn_ranks=ranks
    )
    lines = render_report(report).splitlines()
    assert "topology: 1 attention : 3 ffn, gate on attention" in lines
    start = lines.index(
        "| ffn rank | server   | routed-expert bytes | tokens received/step | bytes received/step |"
    )
    assert lines[start + 1 : start + 6] == [
        "|----------|----------|---------------------|----------------------|---------------------|",
        "| 0        | afd-ffn0 | 1.5 MiB             | 10.9                 | 112.0 KiB           |",
        "| 1        | afd-ffn1 | 1.5 MiB             | 11.0                 | 10 B                |",
        "| 2        | afd-ffn2 | n/a                 | n/a                  | n/a                 |",
        "",
    ]
    batching = [ln for ln in lines if ln.startswith("FFN rank ")]
    assert batching == [
        "FFN rank 0 batching: 50 steps, 200 compute calls (4.0 per step over 4 MoE layers, "
        "1 Attention peer(s) per call), 545 tokens (2.7 per call)",
        "FFN rank 1 batching: 50 steps, 200 compute calls (4.0 per step over 4 MoE layers, "
        "1 Attention peer(s) per call), 551 tokens (2.8 per call)",
    ]
    assert lines[-1] == "PASS: all prompts identical"


def test_render_report_without_ffn_ranks_has_no_rank_table() -> None:
    text = render_report(_report((3, 4)))
    assert "| ffn rank" not in text
    assert "FFN rank" not in text


def test_run_demo_starts_waits_for_and_stops_every_ffn_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    events: list[str] = []
    calls: dict[str, object] = {}

    def ffn_metrics(rank: int) -> str:
        return (
            MetricsText()
            .param_bytes("ffn", rank, 100 + rank)
            .ffn(rank, steps=10, calls=40, tokens=30 + rank, nbytes=1000 * (rank + 1), peers=1,
                 layers=4)
            .text()
        )  # fmt: skip

    def fake_afd_servers(model: object, **kwargs: object) -> tuple[object, tuple[object, ...]]:
        calls.update(kwargs)
        ffns = tuple(FakeServer(f"afd-ffn{i}", ffn_metrics(i), events) for i in range(2))
        attention = MetricsText().param_bytes("attention", 0, 7).text()
        return FakeServer("afd-attention", attention, events), ffns

    def fake_complete_many(base_url: str, prompts: object, **kwargs: object) -> BatchResult:
        got = tuple(Completion(p, "", (1, 2), 0.1) for p in prompts)  # type: ignore[attr-defined]
        return BatchResult(got, 1.0)

    monkeypatch.setattr(run, "plain_server", lambda model, **kw: FakeServer("plain", "", events))
    monkeypatch.setattr(run, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(
        run,
        "wait_until_healthy",
        lambda servers: events.append("wait " + ",".join(s.name for s in servers)),
    )
    monkeypatch.setattr(run, "complete_many", fake_complete_many)
    cfg = DemoConfig(
        model=tmp_path,
        num_ffn_ranks=2,
        gate_on_attention=True,
        prompts=("a", "b"),
        log_dir=tmp_path / "logs",
    )
    report = run.run_demo(cfg, progress=lambda msg: None)
    assert (calls["num_ffn_ranks"], calls["gate_on_attention"], calls["num_attention_ranks"]) == (
        2,
        True,
        1,
    )
    afd_events = events[events.index("stop plain") + 1 :]
    assert afd_events == [
        "start afd-ffn0",
        "start afd-ffn1",
        "start afd-attention",
        "wait afd-ffn0,afd-ffn1,afd-attention",
        "alive afd-attention",
        "alive afd-ffn0",
        "alive afd-ffn1",
        # Every AFD server's /metrics is read while it still serves, then they stop.
        "metrics afd-attention",
        "metrics afd-ffn0",
        "metrics afd-ffn1",
        "stop afd-attention",
        "stop afd-ffn0",
        "stop afd-ffn1",
    ]
    assert report.ok
    assert [(m.name, m.role, m.ok) for m in report.metrics] == [
        ("afd-attention", "attention", True),
        ("afd-ffn0", "ffn", True),
        ("afd-ffn1", "ffn", True),
    ]
    assert report.topology == "1 attention : 2 ffn, gate on attention"
    assert [(s.name, s.role, s.param_bytes) for s in report.servers] == [
        ("plain", "monolithic", None),
        ("afd-attention", "attention", (7,)),
        ("afd-ffn0", "ffn", (100,)),
        ("afd-ffn1", "ffn", (101,)),
    ]
    assert [(r.rank, r.name, r.param_bytes) for r in report.ffn_ranks] == [
        (0, "afd-ffn0", (100,)),
        (1, "afd-ffn1", (101,)),
    ]
    assert [(r.stats.tokens, r.stats.bytes) for r in report.ffn_ranks if r.stats] == [
        (30, 1000),
        (31, 2000),
    ]


def test_a_role_without_afd_metrics_fails_the_demo() -> None:
    from afd_models.demo.run import MetricsCheck

    served = MetricsCheck("afd-attention", "attention", 12)
    silent = MetricsCheck("afd-ffn", "ffn", 0)
    report = dataclasses.replace(_report((3, 4)), metrics=(served, silent))
    assert report.parity.ok and not report.ok
    lines = render_report(report).splitlines()
    assert "afd_* series on /metrics: afd-attention (attention): 12, afd-ffn (ffn): 0" in lines
    assert lines[-1] == "FAIL: no afd_* series on /metrics of afd-ffn"
    assert dataclasses.replace(report, metrics=(served,)).ok


def test_render_report_fail_names_the_mismatch() -> None:
    report = _report((3, 9))
    assert not report.ok
    text = render_report(report)
    assert "FAIL: 1 of 2 prompts differ" in text
    row = next(line for line in text.splitlines() if line.startswith("| 'b'"))
    assert "MISMATCH" in row and row.rstrip(" |").endswith("1")


def test_demo_exit_codes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(cfg: DemoConfig, progress: object) -> DemoReport:
        raise ServerExitedError("afd-ffn", 1, tmp_path / "x.log", "boom")

    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(run, "run_demo", failing)
    assert cli.main(["demo"]) == cli.EXIT_SERVER_ERROR
    monkeypatch.setattr(run, "run_demo", lambda cfg, progress: _report((3, 9)))
    assert cli.main(["demo"]) == cli.EXIT_MISMATCH
    monkeypatch.setattr(run, "run_demo", lambda cfg, progress: _report((3, 4)))
    assert cli.main(["demo"]) == cli.EXIT_OK


@pytest.mark.parametrize("command", ["demo", "tiny"])
def test_demo_commands_name_the_missing_demo_extra(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.DEMO_EXTRA_MODULES, command, ("psutil", "afd_no_such_module"))
    monkeypatch.setattr(run, "run_demo", lambda cfg, progress: pytest.fail("demo ran"))
    assert cli.main([command]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "afd_no_such_module" in err and "psutil" not in err
    assert "afd-models[demo]" in err


def test_serve_imports_neither_the_demo_subpackage_nor_the_demo_extra() -> None:
    """`afd serve` (and the harness's `python -m afd_models.cli serve`) on a plain install."""
    code = (
        "import sys\n"
        "import afd_models.vllm_cli as v\n"
        "v.run_vllm_cli = lambda argv: print('served', list(argv))\n"
        "from afd_models import cli\n"
        "assert cli.main(['serve', '/m', '--port', '1']) == cli.EXIT_OK\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'psutil', 'requests', 'tokenizers', 'safetensors'} or m.startswith('afd_models.demo'))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "served ['serve', '/m', '--port', '1']" in out.stdout


def test_tiny_subcommand_prints_cached_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tokenizers")
    assert cli.main(["tiny", "--family", "qwen3_moe", "--cache-dir", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path
    assert (path / "config.json").is_file()


def test_tiny_published_writes_the_published_config_without_its_mtp_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("safetensors")
    argv = ["tiny", "--published", "deepseek-v3", "--dequantized", "--no-mtp-weights"]
    assert cli.main([*argv, "--cache-dir", str(tmp_path)]) == 0
    path = Path(capsys.readouterr().out.strip())
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and "quantization_config" not in config
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    layers = {int(k.split(".")[2]) for k in names if k.startswith("model.layers.")}
    assert layers == set(range(config["num_hidden_layers"]))  # no MTP layer written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--published", "nope"], "allowed: ["),
        (["--no-mtp-weights"], "need --published KEY"),
    ],
)
def test_tiny_published_flags_are_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["tiny", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "afd"]
    assert ep.value == "afd_models.cli:main"


# --------------------------------------------------------------------------------------------
# Quantized experts


def test_quant_flags_default_to_the_native_float_experts() -> None:
    cfg = cli.parse_demo_config([])
    assert (cfg.ffn_compute, cfg.expert_quant, cfg.expert_quant_group_size) == ("native", "none", 0)
    assert not cfg.quantized


def test_quant_flag_choices_are_afd_cores() -> None:
    from afd_core.config import EXPERT_QUANT_SCHEMES, FFN_COMPUTE_KINDS

    assert cli.FFN_COMPUTE_CHOICES == FFN_COMPUTE_KINDS
    assert cli.EXPERT_QUANT_CHOICES == EXPERT_QUANT_SCHEMES


@pytest.mark.parametrize(
    ("argv", "fields"),
    [
        (["--ffn-compute", "layered", "--expert-quant", "w8a8"], ("layered", "w8a8", 0)),
        (["--ffn-compute", "mega", "--expert-quant", "w4a8"], ("mega", "w4a8", 0)),
        (
            [
                "--ffn-compute",
                "layered",
                "--expert-quant",
                "w4a8",
                "--expert-quant-group-size",
                "32",
            ],
            ("layered", "w4a8", 32),
        ),
    ],
)
def test_quant_flags_map_to_config(argv: list[str], fields: tuple[str, str, int]) -> None:
    cfg = cli.parse_demo_config(argv)
    assert (cfg.ffn_compute, cfg.expert_quant, cfg.expert_quant_group_size) == fields
    assert cfg.quantized
    assert cfg.ffn_extra == dict(
        zip(("ffn_compute", "expert_quant", "expert_quant_group_size"), fields, strict=True)
    )


@pytest.mark.parametrize(
    ("argv", "needle", "field"),
    [
        (["--ffn-compute", "layered"], "error: --ffn-compute='layered': ", "ffn_compute"),
        (
            ["--ffn-compute", "mega", "--expert-quant", "none"],
            "--ffn-compute='mega': ",
            "ffn_compute",
        ),
        (["--expert-quant", "w8a8"], "error: --expert-quant='w8a8': ", "expert_quant"),
        (
            ["--ffn-compute", "native", "--expert-quant", "w4a8"],
            "error: --expert-quant='w4a8': ",
            "expert_quant",
        ),
        # ffn_compute is native by default: the scheme is what afd-core rejects first.
        (
            ["--expert-quant-group-size", "32", "--expert-quant", "w8a8"],
            "error: --expert-quant='w8a8': ",
            "expert_quant",
        ),
        (
            [
                "--ffn-compute",
                "layered",
                "--expert-quant-group-size",
                "32",
                "--expert-quant",
                "w8a8",
            ],
            "error: --expert-quant-group-size=32: ",
            "expert_quant_group_size",
        ),
        (["--expert-quant-group-size", "16"], "error: --expert-quant-group-size=16: ", None),
        (
            ["--ffn-compute", "mega", "--expert-quant", "w4a8", "--expert-quant-group-size", "-1"],
            "error: --expert-quant-group-size=-1: ",
            "expert_quant_group_size",
        ),
        (["--ffn-compute", "fused"], "invalid choice: 'fused'", None),
        (["--expert-quant", "int4"], "invalid choice: 'int4'", None),
    ],
)
def test_quant_usage_errors_name_the_flag_and_afd_cores_message(
    argv: list[str], needle: str, field: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    from afd_core.config import AFDConfig
    from afd_core.errors import AFDConfigError

    with pytest.raises(SystemExit) as err:
        cli.main(["demo", *argv])
    assert err.value.code == cli.EXIT_USAGE
    text = capsys.readouterr().err
    assert needle in text
    if field is not None:
        ns = cli.build_parser().parse_args(["demo", *argv])
        with pytest.raises(AFDConfigError) as cfg_err:
            AFDConfig.from_mapping(
                {
                    "role": "ffn",
                    "ffn_compute": ns.ffn_compute,
                    "expert_quant": ns.expert_quant,
                    "expert_quant_group_size": ns.expert_quant_group_size,
                }
            )
        assert cfg_err.value.field == field
        assert f"{needle}{cfg_err.value}" in text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"ffn_compute": "layered"}, "ffn_compute"),
        ({"expert_quant": "w8a8"}, "expert_quant"),
        ({"ffn_compute": "layered", "expert_quant": "w8a8", "expert_quant_group_size": 8}, None),
        ({"ffn_compute": "bogus"}, "ffn_compute"),
    ],
)
def test_demo_config_validates_the_quant_fields(kwargs: dict[str, Any], field: str | None) -> None:
    from afd_core.errors import AFDConfigError

    with pytest.raises(AFDConfigError) as err:
        DemoConfig(**kwargs)
    assert err.value.field == (field or "expert_quant_group_size")
    ok = DemoConfig(ffn_compute="mega", expert_quant="w4a8", expert_quant_group_size=32)
    assert ok.quantized


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_every_quantized_scheme_has_a_tolerance_that_decides_the_verdict(scheme: str) -> None:
    from afd_core.config import EXPERT_QUANT_SCHEMES

    # Every scheme a quantized demo accepts has one (run_demo looks it up by expert_quant).
    assert set(run.QUANT_ERROR_TOLERANCE) == set(EXPERT_QUANT_SCHEMES) - {"none"}
    tolerance = run.QUANT_ERROR_TOLERANCE[scheme]
    assert 0 < tolerance < 1
    at = _quant_summary((tolerance,), expert_quant=scheme)
    assert at.tolerance == tolerance and at.ok and at.over_tolerance == ()
    for worse in (tolerance * 1.01, float("nan")):
        over = _quant_summary((tolerance / 2, worse), expert_quant=scheme)
        assert not over.ok and over.over_tolerance == (1,), worse
    # Coarser weights may err more: int4 experts get the looser bound.
    assert run.QUANT_ERROR_TOLERANCE["w8a8"] < run.QUANT_ERROR_TOLERANCE["w4a8"]


def test_token_match_counts_equal_tokens_position_by_position() -> None:
    base = [Completion("a", "", (1, 2, 3, 4), 0.1), Completion("b", "", (5, 6), 0.1)]
    cand = [Completion("a", "", (1, 9, 3, 4), 0.1), Completion("b", "", (5, 6, 7), 0.1)]
    # a: 3 of 4 equal (a later equal token still counts); b: 2 equal, the extra token is not.
    assert run.token_match(compare_parity(base, cand)) == (5, 7)
    assert run.token_match(compare_parity(base, base)) == (6, 6)


def _quant_summary(
    errors: tuple[float | None, ...],
    *,
    expert_quant: str = "w8a8",
    equal: int = 3,
    total: int = 4,
) -> run.QuantSummary:
    ranks = []
    for rank, err in enumerate(errors):
        quant = QuantReport(
            rank, "layered", "w8a8", 0, 540672 + rank * 1024, 1048576 + rank * 2048, 4
        )
        ranks.append(
            run.QuantRankStats(
                rank, f"afd-ffn{rank}", quant, None if err is None else (0, 12 + rank, err)
            )
        )
    return run.QuantSummary(
        ffn_compute="layered",
        expert_quant=expert_quant,
        group_size=0,
        tolerance=run.QUANT_ERROR_TOLERANCE[expert_quant],
        ranks=tuple(ranks),
        equal_tokens=equal,
        total_tokens=total,
    )


def test_render_report_shows_the_quantized_experts_beside_parity() -> None:
    report = dataclasses.replace(_report((3, 9)), quant=_quant_summary((2.8e-2,)))
    assert not report.parity.ok and report.ok
    lines = render_report(report).splitlines()
    parity_end = lines.index("| 'b'    | 2      | MISMATCH  | 1              |")
    assert lines[parity_end + 1 : parity_end + 4] == [
        "",
        "quantized experts: ffn_compute=layered expert_quant=w8a8 group_size=0 (exact token "
        "parity is not expected; tolerance: max relative error <= 5.0e-02 vs fp32)",
        "greedy tokens equal to plain fp32 vLLM: 3 of 4 (75.0%)",
    ]
    header = next(
        i for i, ln in enumerate(lines) if ln.startswith("| ffn rank | server   | scheme")
    )
    cells = [c.strip() for c in lines[header + 2].strip("|").split("|")]
    assert cells == [
        "0",
        "afd-ffn0",
        "w8a8",
        "528.0 KiB",
        "1.0 MiB",
        "0.516",
        "0",
        "12",
        "2.800e-02",
    ]
    assert [c.strip() for c in lines[header].strip("|").split("|")][3:] == [
        "expert bytes",
        "bf16 bytes",
        "vs bf16",
        "measured layer",
        "calls",
        "max rel error vs fp32",
    ]
    assert lines[-1] == (
        "PASS: quantized experts within tolerance (max relative error 2.800e-02 <= 5.0e-02 on "
        "every FFN rank); 1 of 2 prompts differ from plain fp32 vLLM (not expected to be identical)"
    )


def test_render_report_names_unmeasured_and_over_tolerance_ranks() -> None:
    quant = _quant_summary((0.6, None, 0.1), expert_quant="w4a8", equal=0, total=0)
    report = dataclasses.replace(_report((3, 4)), quant=quant)
    assert report.parity.ok and not report.ok
    assert (quant.unmeasured, quant.over_tolerance, quant.max_rel) == ((1,), (0,), 0.6)
    lines = render_report(report).splitlines()
    assert "greedy tokens equal to plain fp32 vLLM: 0 of 0 (0.0%)" in lines
    row = next(ln for ln in lines if ln.startswith("| 1        | afd-ffn1"))
    assert [c.strip() for c in row.strip("|").split("|")][-3:] == ["-", "-", "not measured"]
    assert lines[-1] == (
        "FAIL: quantized experts: no afd_ffn_quant_error_max_rel from FFN rank(s) [1] (error not "
        "measured); "
        "max relative error 6.000e-01 > 5.0e-01 on FFN rank(s) [0]; 0 of 2 prompts differ from "
        "plain fp32 vLLM (not expected to be identical)"
    )


def test_a_rank_without_tokens_of_its_own_is_not_required_to_measure() -> None:
    """Mega over two FFN ranks: every token goes to FFN rank 0; rank 1 only adds its experts'
    share through the group and has no rows to measure."""
    both = _quant_summary((2.8e-2, None))
    assert both.unmeasured == (1,) and not both.ok  # a rank that computed must measure
    idle = dataclasses.replace(both.ranks[1], computed=False)
    quant = dataclasses.replace(both, ranks=(both.ranks[0], idle))
    assert quant.unmeasured == () and quant.ok
    report = dataclasses.replace(_report((3, 4)), quant=quant)
    lines = render_report(report).splitlines()
    row = next(ln for ln in lines if ln.startswith("| 1        | afd-ffn1"))
    assert row.strip("|").split("|")[-1].strip() == "no tokens of its own"
    assert "<= 5.0e-02 on every FFN rank with tokens of its own)" in lines[-1]
    none = dataclasses.replace(quant, ranks=(dataclasses.replace(both.ranks[0], computed=False),))
    assert none.unmeasured == (0,) and not none.ok  # nothing measured at all


def test_quant_summary_without_a_quant_line_renders_na() -> None:
    quant = dataclasses.replace(
        _quant_summary((1e-2,)), ranks=(run.QuantRankStats(0, "afd-ffn", None, (0, 1, 1e-2)),)
    )
    row = next(ln for ln in run.render_quant(quant) if ln.startswith("| 0 "))
    assert [c.strip() for c in row.strip("|").split("|")][2:6] == ["n/a"] * 4
    assert quant.ok  # the rule is on the measured error only
    nan = _quant_summary((float("nan"),))
    assert nan.over_tolerance == (0,) and not nan.ok
    assert not dataclasses.replace(nan, ranks=()).ok


@pytest.mark.parametrize(
    ("errors", "tokens", "code"),
    [
        ((2.8e-2,), (3, 9), cli.EXIT_OK),  # within tolerance: token mismatches do not count
        ((2.8e-2, 4.9e-2), (9, 9), cli.EXIT_OK),
        ((6e-2,), (3, 4), cli.EXIT_MISMATCH),  # above tolerance, even with identical tokens
        ((2.8e-2, 6e-2), (3, 4), cli.EXIT_MISMATCH),
        ((None,), (3, 4), cli.EXIT_MISMATCH),  # no error line
        ((2.8e-2, None), (3, 4), cli.EXIT_MISMATCH),
    ],
)
def test_quantized_demo_exit_code_follows_the_measured_error(
    errors: tuple[float | None, ...],
    tokens: tuple[int, ...],
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = dataclasses.replace(_report(tokens), quant=_quant_summary(errors))
    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(run, "run_demo", lambda cfg, progress: report)
    argv = ["demo", "--ffn-compute", "layered", "--expert-quant", "w8a8"]
    assert cli.main(argv) == code
    out = capsys.readouterr().out
    assert ("PASS: quantized" if code == cli.EXIT_OK else "FAIL: quantized") in out


def _fake_demo_run(
    monkeypatch: pytest.MonkeyPatch, ffn_logs: list[str], afd_tokens: tuple[int, ...]
) -> tuple[list[str], dict[str, Any]]:
    events: list[str] = []
    calls: dict[str, Any] = {}

    def fake_afd_servers(model: object, **kwargs: Any) -> tuple[object, tuple[object, ...]]:
        calls.update(kwargs)
        ffns = tuple(FakeServer(f"afd-ffn{i}", text, events) for i, text in enumerate(ffn_logs))
        attention = MetricsText().param_bytes("attention", 0, 7).text()
        return FakeServer("afd-attention", attention, events), ffns

    def fake_complete_many(base_url: str, prompts: Any, **kwargs: object) -> BatchResult:
        ids = (1, 2, 3) if base_url.endswith("/plain") else afd_tokens
        return BatchResult(tuple(Completion(p, "", ids, 0.1) for p in prompts), 1.0)

    monkeypatch.setattr(run, "plain_server", lambda model, **kw: FakeServer("plain", "", events))
    monkeypatch.setattr(run, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(run, "wait_until_healthy", lambda servers: None)
    monkeypatch.setattr(run, "complete_many", fake_complete_many)
    return events, calls


def test_run_demo_quantized_configures_the_ffn_ranks_and_reads_their_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from afd_models.models._quantized import REPORT_ERROR_ENV

    def ffn_log(rank: int, err: float) -> str:
        return (
            MetricsText()
            .quantized(rank, "mega", "w4a8_per_group", 32, 300000, 1000000, 4)
            .quant_error(rank, 0, 6, err / 2)
            .quant_error(rank, 0, 1, err)
            .text()
        )

    _events, calls = _fake_demo_run(
        monkeypatch, [ffn_log(0, 0.26), ffn_log(1, 0.2)], afd_tokens=(1, 5, 3)
    )
    cfg = DemoConfig(
        model=tmp_path,
        num_ffn_ranks=2,
        gate_on_attention=True,
        prompts=("a", "b"),
        log_dir=tmp_path / "logs",
        ffn_compute="mega",
        expert_quant="w4a8",
        expert_quant_group_size=32,
    )
    report = run.run_demo(cfg, progress=lambda msg: None)
    assert calls["ffn_extra"] == {
        "ffn_compute": "mega",
        "expert_quant": "w4a8",
        "expert_quant_group_size": 32,
    }
    assert calls["ffn_env"] == {REPORT_ERROR_ENV: "1"}
    # What the demo sets is what an FFN process reads to measure (the documented variable).
    from afd_models.models._quantized import report_error_requested

    monkeypatch.delenv("AFD_REPORT_QUANT_ERROR", raising=False)
    assert not report_error_requested()
    for name, value in calls["ffn_env"].items():
        monkeypatch.setenv(name, value)
    assert report_error_requested()
    monkeypatch.setenv("AFD_REPORT_QUANT_ERROR", "0")
    assert not report_error_requested()
    assert not report.parity.ok
    quant = report.quant
    assert quant is not None
    assert (quant.equal_tokens, quant.total_tokens, quant.tolerance) == (4, 6, 5e-1)
    assert [(r.rank, r.name, r.error) for r in quant.ranks] == [
        (0, "afd-ffn0", (0, 7, 0.26)),
        (1, "afd-ffn1", (0, 7, 0.2)),
    ]
    assert [r.quant.ratio_vs_bf16 for r in quant.ranks if r.quant] == [0.3, 0.3]
    assert report.ok
    assert "greedy tokens equal to plain fp32 vLLM: 4 of 6 (66.7%)" in render_report(report)


def test_run_demo_quantized_without_error_lines_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_demo_run(
        monkeypatch, [MetricsText().param_bytes("ffn", 0, 1).text()], afd_tokens=(1, 2, 3)
    )
    cfg = DemoConfig(
        model=tmp_path,
        prompts=("a",),
        log_dir=tmp_path / "logs",
        ffn_compute="layered",
        expert_quant="w8a8",
    )
    report = run.run_demo(cfg, progress=lambda msg: None)
    assert report.parity.ok and not report.ok
    assert report.quant is not None and report.quant.unmeasured == (0,)
    assert report.quant.ranks[0].quant is None


def test_run_demo_without_quantization_sets_nothing_on_the_ffn_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ffn = MetricsText().param_bytes("ffn", 0, 1).text()
    _events, calls = _fake_demo_run(monkeypatch, [ffn], afd_tokens=(1, 2, 3))
    cfg = DemoConfig(model=tmp_path, prompts=("a",), log_dir=tmp_path / "logs")
    report = run.run_demo(cfg, progress=lambda msg: None)
    assert (calls["ffn_extra"], calls["ffn_env"]) == (None, None)
    assert report.quant is None and report.ok
    assert "quantized" not in render_report(report)


def test_run_demo_with_tp_runs_plain_and_attention_at_that_tp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--tp 2``: plain vLLM gets ``--tensor-parallel-size 2`` (parity at the same settings) and
    both AFD roles get ``attention_tp_size: 2`` (afd_role_args adds the Attention server's flag)."""
    events: list[str] = []
    calls: dict[str, object] = {}
    plain_args: list[list[str]] = []

    def fake_plain(model: object, **kw: object) -> FakeServer:
        plain_args.append(kw["options"].args())  # type: ignore[attr-defined]
        return FakeServer("plain", "", events)

    def fake_afd_servers(model: object, **kwargs: object) -> tuple[object, tuple[object, ...]]:
        calls.update(kwargs)
        ffn = (
            MetricsText()
            .param_bytes("ffn", 0, 100)
            .ffn(0, steps=1, calls=4, tokens=3, nbytes=10, peers=2, layers=4)
        )
        attention = MetricsText().param_bytes("attention", 0, 7).param_bytes("attention", 1, 7)
        return FakeServer("afd-attention", attention.text(), events), (
            FakeServer("afd-ffn", ffn.text(), events),
        )

    def fake_complete_many(base_url: str, prompts: object, **kwargs: object) -> BatchResult:
        got = tuple(Completion(p, "", (1, 2), 0.1) for p in prompts)  # type: ignore[attr-defined]
        return BatchResult(got, 1.0)

    monkeypatch.setattr(run, "plain_server", fake_plain)
    monkeypatch.setattr(run, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(run, "wait_until_healthy", lambda servers: None)
    monkeypatch.setattr(run, "complete_many", fake_complete_many)
    cfg = DemoConfig(model=tmp_path, attention_tp_size=2, prompts=("a",), log_dir=tmp_path)
    report = run.run_demo(cfg, progress=lambda msg: None)
    assert plain_args[0][-2:] == ["--tensor-parallel-size", "2"]
    assert calls["afd_extra"] == {"attention_tp_size": 2}
    assert report.topology == "1 attention : 1 ffn, gate on ffn, attention TP 2"
    assert report.ok
