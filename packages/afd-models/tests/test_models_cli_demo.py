"""``afd`` CLI: argument parsing, report rendering and exit codes (no vLLM started)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from afd_models import cli
from afd_models.demo import run
from afd_models.demo.client import Completion
from afd_models.demo.parity import compare_parity
from afd_models.demo.run import DemoConfig, DemoReport, ServerStats, render_report
from afd_models.demo.servers import ServerExitedError
from afd_models.demo.tiny import DEMO_PROMPTS


def test_demo_defaults_are_the_tiny_qwen_model() -> None:
    cfg = cli.parse_demo_config([])
    assert cfg.model is None
    assert cfg.family == "qwen3_moe"
    assert cfg.num_attention_ranks == 1
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
        (["--gate", "attention"], "--gate=attention"),
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

    def line(steps: int, calls: int, tokens: int) -> str:
        return STATS_FORMAT.format(
            rank=0, steps=steps, calls=calls, tokens=tokens, peers=2, layers=4
        )

    log = f"noise\n{line(1, 4, 8)}\n(Worker) INFO x\n{line(10, 40, 200)}\n"
    stats = parse_ffn_stats(log)
    assert set(stats) == {0}
    s = stats[0]
    assert (s.steps, s.compute_calls, s.tokens, s.peers, s.layers) == (10, 40, 200, 2, 4)
    assert (s.calls_per_step, s.tokens_per_call) == (4.0, 5.0)
    assert parse_ffn_stats("nothing here") == {}
    report = dataclasses.replace(_report((3, 4)), ffn_stats=s)
    text = render_report(report)
    assert (
        "FFN rank 0 batching: 10 steps, 40 compute calls (4.0 per step over 4 MoE layers, "
        "2 Attention rank(s) per call), 200 tokens (5.0 per call)"
    ) in text


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
