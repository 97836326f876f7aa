"""``afd`` CLI: argument parsing, report rendering and exit codes (no vLLM started)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from afd_models import cli
from afd_models.demo import run
from afd_models.demo.client import BatchResult, Completion
from afd_models.demo.parity import compare_parity
from afd_models.demo.run import DemoConfig, DemoReport, FFNRankStats, ServerStats, render_report
from afd_models.demo.servers import FFNStats, ServerExitedError

sys.path.insert(0, str(Path(__file__).parent))
from afd_models.demo.tiny import DEMO_PROMPTS
from afd_models_fake_servers import FakeServer


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
    from afd_runtime.ffn_service import STATS_FORMAT

    def line(steps: int, calls: int, tokens: int, nbytes: int) -> str:
        return STATS_FORMAT.format(
            rank=0, steps=steps, calls=calls, tokens=tokens, bytes=nbytes, peers=2, layers=4
        )

    log = f"noise\n{line(1, 4, 8, 100)}\n(Worker) INFO x\n{line(10, 40, 200, 20480)}\n"
    stats = parse_ffn_stats(log)
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
    assert (s.calls_per_step, s.tokens_per_call) == (4.0, 5.0)
    assert (s.tokens_per_step, s.bytes_per_step) == (20.0, 2048.0)
    assert parse_ffn_stats("nothing here") == {}
    rank = FFNRankStats(0, "afd-ffn", (3 * 1024**2,), s)
    report = dataclasses.replace(_report((3, 4)), ffn_ranks=(rank,))
    text = render_report(report)
    assert (
        "FFN rank 0 batching: 10 steps, 40 compute calls (4.0 per step over 4 MoE layers, "
        "2 Attention rank(s) per call), 200 tokens (5.0 per call)"
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
        "1 Attention rank(s) per call), 545 tokens (2.7 per call)",
        "FFN rank 1 batching: 50 steps, 200 compute calls (4.0 per step over 4 MoE layers, "
        "1 Attention rank(s) per call), 551 tokens (2.8 per call)",
    ]
    assert lines[-1] == "PASS: all prompts identical"


def test_render_report_without_ffn_ranks_has_no_rank_table() -> None:
    text = render_report(_report((3, 4)))
    assert "| ffn rank" not in text
    assert "FFN rank" not in text


def test_run_demo_starts_waits_for_and_stops_every_ffn_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from afd_runtime.ffn_service import STATS_FORMAT

    events: list[str] = []
    calls: dict[str, object] = {}

    def ffn_log(rank: int) -> str:
        stats = STATS_FORMAT.format(
            rank=rank,
            steps=10,
            calls=40,
            tokens=30 + rank,
            bytes=1000 * (rank + 1),
            peers=1,
            layers=4,
        )
        return f"AFD role=ffn param_bytes={100 + rank}\n{stats}\n"

    def fake_afd_servers(model: object, **kwargs: object) -> tuple[object, tuple[object, ...]]:
        calls.update(kwargs)
        ffns = tuple(FakeServer(f"afd-ffn{i}", ffn_log(i), events) for i in range(2))
        return FakeServer("afd-attention", "AFD role=attention param_bytes=7\n", events), ffns

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
        "stop afd-attention",
        "stop afd-ffn0",
        "stop afd-ffn1",
    ]
    assert report.ok
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


def test_console_script_is_declared() -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="console_scripts") if e.name == "afd"]
    assert ep.value == "afd_models.cli:main"
