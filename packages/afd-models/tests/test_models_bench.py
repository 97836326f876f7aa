"""``afd bench``'s arithmetic, table and argument checks (the measurement itself is a benchmark)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("requests")

from afd_models import cli
from afd_models.demo import bench
from afd_models.demo.bench import (
    QUANTIZED_SETUPS,
    BenchConfig,
    QuantizedRow,
    QuantizedSetup,
    TPOTRow,
    TrafficRow,
    bench_prompts,
    compare,
    quantized_rows,
    render,
    render_quantized,
    render_traffic,
    setup_name,
    traffic_row,
)
from afd_models.demo.servers import SPLIT_EVERY_STEP_ARGS, FFNStats, QuantReport
from afd_models.demo.tiny import DEMO_PROMPTS

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_fake_servers import FakeServer, MetricsText


@pytest.fixture(autouse=True)
def _no_host_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`afd bench` reads this host's calibrated profile by default (``$XDG_CACHE_HOME``): the
    tests here must not depend on one a developer wrote (a profile from a newer afd-plan made
    the old CLI refuse it). A test that wants one writes it under its own cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))


def test_compare_derives_ratio_and_overhead_per_layer() -> None:
    plain = [TPOTRow("plain", 1, 10.0, (10.0,)), TPOTRow("plain", 16, 20.0, (20.0,))]
    afd = [TPOTRow("afd 1:1", 1, 12.0, (12.0,)), TPOTRow("afd 2:1", 16, 40.0, (40.0,))]
    rows = compare(plain, afd, {1: 0.25, 16: 0.5}, layers=4)
    assert [(r.setup, r.batch) for r in rows] == [("afd 1:1", 1), ("afd 2:1", 16)]
    first, second = rows
    assert (first.ratio, first.overhead_per_layer_ms, first.overhead_in_round_trips) == (
        1.2,
        0.5,
        2.0,
    )
    assert first.meets_targets
    assert (second.ratio, second.overhead_per_layer_ms, second.overhead_in_round_trips) == (
        2.0,
        5.0,
        10.0,
    )
    assert not second.meets_targets
    table = render(rows).splitlines()
    assert table[2] == "| afd 1:1 | 1 | 10.00 | 12.00 | 1.20 | 0.500 | 0.250 | 2.0 | met |"
    assert table[3].endswith("| 2.00 | 5.000 | 0.500 | 10.0 | MISSED |")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"batch_sizes": ()}, "batch_sizes"),
        ({"batch_sizes": (1, 0)}, "batch_sizes"),
        ({"max_tokens": 3}, "max_tokens"),
        ({"repeats": 0}, "repeats"),
        ({"ffn_ranks": ()}, "ffn_ranks"),
        ({"ffn_ranks": (1, 0)}, "ffn_ranks"),
    ],
)
def test_bench_config_rejects_bad_values(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        BenchConfig(**kwargs)  # type: ignore[arg-type]


def test_bench_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--batch-sizes", "1,x"])
    assert err.value.code == cli.EXIT_USAGE
    assert "afd bench" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--repeats", "0"])
    assert err.value.code == cli.EXIT_USAGE
    assert "repeats=0" in capsys.readouterr().err


def test_bench_cli_ffn_ranks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[BenchConfig] = []
    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])

    def fake_run_bench(cfg: BenchConfig, progress: object) -> dict[str, Any]:
        seen.append(cfg)
        return {}

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    assert cli.main(["bench"]) == cli.EXIT_OK
    assert cli.main(["bench", "--ffn-ranks", "4,2", "--batch-sizes", "8"]) == cli.EXIT_OK
    assert [(c.ffn_ranks, c.batch_sizes) for c in seen] == [((1, 2), (1, 4, 16)), ((4, 2), (8,))]
    assert [c.quantized for c in seen] == [True, True]
    assert cli.main(["bench", "--no-quantized"]) == cli.EXIT_OK
    assert cli.main(["bench", "--quantized"]) == cli.EXIT_OK
    assert [c.quantized for c in seen[2:]] == [False, True]
    del seen[2:]
    assert [c.gate_on_attention_ffn_ranks for c in seen] == [(1, 2), (1, 2, 4)]
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--ffn-ranks", "1,two"])
    assert err.value.code == cli.EXIT_USAGE
    assert "afd bench: --ffn-ranks='1,two': expected comma-separated integers" in (
        capsys.readouterr().err
    )

    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--ffn-ranks", "0"])
    assert err.value.code == cli.EXIT_USAGE
    assert "afd bench: ffn_ranks=(0,): each must be >= 1" in capsys.readouterr().err


def test_bench_compares_with_the_calibrated_profile_when_there_is_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[BenchConfig] = []
    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(bench, "run_bench", lambda cfg, progress: seen.append(cfg) or {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cli.main(["bench"]) == cli.EXIT_OK  # no calibrated profile: no comparison
    assert cli.main(["bench", "--hardware", "cpu-2core"]) == cli.EXIT_OK
    calibrated = tmp_path / "afd" / "profile.json"
    calibrated.parent.mkdir()
    from afd_plan.hardware import load_profile

    calibrated.write_text(json.dumps(load_profile("cpu-2core").to_mapping()))
    assert cli.main(["bench"]) == cli.EXIT_OK
    assert [c.plan_profile for c in seen] == [None, "cpu-2core", calibrated]


def test_gate_on_attention_ffn_ranks_always_start_with_the_reference() -> None:
    assert BenchConfig().gate_on_attention_ffn_ranks == (1, 2)
    assert BenchConfig(ffn_ranks=(2,)).gate_on_attention_ffn_ranks == (1, 2)
    assert BenchConfig(ffn_ranks=(4, 2, 4, 1)).gate_on_attention_ffn_ranks == (1, 2, 4)
    assert BenchConfig(ffn_ranks=(1,)).gate_on_attention_ffn_ranks == (1,)


def test_setup_names() -> None:
    assert setup_name(1, 1, gate_on_attention=False) == "afd 1:1"
    assert setup_name(2, 1, gate_on_attention=False) == "afd 2:1"
    assert setup_name(1, 1, gate_on_attention=True) == "afd 1:1 gate-attn"
    assert setup_name(1, 2, gate_on_attention=True) == "afd 1:2 gate-attn"


def _stats(rank: int, steps: int, tokens: int, nbytes: int) -> FFNStats:
    return FFNStats(rank, steps, steps * 4, tokens, nbytes, 1, 4)


def test_traffic_rows_sum_bytes_per_step_over_ffn_ranks_and_compare_to_one_rank() -> None:
    one = traffic_row("afd 1:1 gate-attn", [_stats(0, 100, 800, 409600)])
    assert one == TrafficRow("afd 1:1 gate-attn", 1, (100,), (800,), (409600,), 4096.0, 1.0)
    two = traffic_row(
        "afd 1:2 gate-attn",
        [_stats(0, 100, 700, 358400), _stats(1, 50, 450, 230400)],
        one.bytes_per_step,
    )
    # 358400 / 100 + 230400 / 50 = 3584 + 4608
    assert two == TrafficRow(
        "afd 1:2 gate-attn", 2, (100, 50), (700, 450), (358400, 230400), 8192.0, 2.0
    )
    assert render_traffic([one, two]).splitlines() == [
        "| setup | FFN ranks | steps (per rank) | bytes sent per step (per rank) | vs 1 FFN rank |",
        "|---|---|---|---|---|",
        "| afd 1:1 gate-attn | 1 | 100 | 4096 (4096) | 1.00 |",
        "| afd 1:2 gate-attn | 2 | 100 / 50 | 8192 (3584 + 4608) | 2.00 |",
    ]


def test_traffic_row_without_reference_bytes_has_no_ratio() -> None:
    idle = traffic_row("afd 1:1 gate-attn", [_stats(0, 0, 0, 0)])
    assert (idle.bytes_per_step, idle.ratio_vs_one_rank) == (0.0, None)
    two = traffic_row("afd 1:2 gate-attn", [_stats(0, 10, 5, 100), _stats(1, 10, 5, 100)], 0.0)
    assert (two.bytes_per_step, two.ratio_vs_one_rank) == (20.0, None)
    assert render_traffic([idle, two]).splitlines()[2:] == [
        "| afd 1:1 gate-attn | 1 | 0 | 0 (0) | n/a |",
        "| afd 1:2 gate-attn | 2 | 10 / 10 | 20 (10 + 10) | n/a |",
    ]


def test_traffic_row_names_ranks_without_counters() -> None:
    with pytest.raises(RuntimeError) as err:
        traffic_row("afd 1:2 gate-attn", [_stats(0, 1, 1, 1), None])
    assert str(err.value) == ("afd 1:2 gate-attn: no afd_* counters on /metrics of FFN rank(s) [1]")
    with pytest.raises(RuntimeError) as err:
        traffic_row("afd 1:2 gate-attn", [])
    assert str(err.value) == ("afd 1:2 gate-attn: no afd_* counters on /metrics of FFN rank(s) [0]")


def test_compare_covers_gate_on_attention_rows() -> None:
    plain = [TPOTRow("plain", 4, 10.0, (10.0,))]
    afd = [
        TPOTRow("afd 1:1 gate-attn", 4, 11.0, (11.0,)),
        TPOTRow("afd 1:2 gate-attn", 4, 15.0, (15.0,)),
    ]
    rows = compare(plain, afd, {4: 0.5}, layers=4)
    assert [(r.setup, r.ratio) for r in rows] == [
        ("afd 1:1 gate-attn", 1.1),
        ("afd 1:2 gate-attn", 1.5),
    ]
    assert render(rows).splitlines()[3] == (
        "| afd 1:2 gate-attn | 4 | 10.00 | 15.00 | 1.50 | 1.250 | 0.500 | 2.5 | met |"
    )


def test_run_bench_adds_gate_on_attention_deployments_and_their_traffic(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "decoder_sparse_step": 1})
    )
    events: list[str] = []
    deployments: list[dict[str, object]] = []
    # Per FFN rank count: each rank's (steps, bytes).
    counters = {1: [(10, 40960)], 2: [(10, 30720), (10, 20480)]}

    def fake_afd_servers(model: object, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
        deployments.append(kw)
        n, prefix = kw.get("num_ffn_ranks", 1), kw["prefix"]
        logs = ["" for _ in range(n)]
        if kw["gate_on_attention"]:
            logs = [
                MetricsText()
                .ffn(r, steps=st, calls=st * 2, tokens=st, nbytes=b, peers=1, layers=2)
                .text()
                for r, (st, b) in enumerate(counters[n])
            ]
        ffns = tuple(FakeServer(f"{prefix}-ffn{r}", log, events) for r, log in enumerate(logs))
        return FakeServer(f"{prefix}-attention", "", events), ffns

    tpot = {"plain": 10.0, "afd 1:1": 12.0, "afd 2:1": 14.0, "afd 1:1 gate-attn": 11.0}
    tpot["afd 1:2 gate-attn"] = 13.0
    monkeypatch.setattr(bench, "ensure_tiny_checkpoint", lambda spec, cache: model)
    monkeypatch.setattr(bench, "raw_round_trip_ms", lambda sizes, hidden: dict.fromkeys(sizes, 0.5))
    monkeypatch.setattr(
        bench, "plain_server", lambda model, name, **kw: FakeServer(name, "", events)
    )
    monkeypatch.setattr(bench, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: None)
    monkeypatch.setattr(
        bench,
        "measure_tpot",
        lambda server, b, cfg, setup: TPOTRow(setup, b, tpot.get(setup, 9.0), (1.0,)),
    )
    out = tmp_path / "res" / "serving.json"
    printed: list[str] = []
    cfg = BenchConfig(
        batch_sizes=(1, 4), out=out, log_dir=tmp_path / "logs", quantized=False, stages=False
    )
    result = bench.run_bench(cfg, progress=printed.append)

    assert [
        (d["num_attention_ranks"], d.get("num_ffn_ranks", 1), d["gate_on_attention"], d["prefix"])
        for d in deployments
    ] == [
        (1, 1, False, "bench-1a1f"),
        (2, 1, False, "bench-2a1f"),
        (1, 1, True, "bench-1a1f-gate-attn"),
        (1, 2, True, "bench-1a2f-gate-attn"),
    ]
    # FFN ranks start before the Attention role; each /metrics is read while serving; the
    # Attention role stops first.
    assert events[-9:] == [
        "start bench-1a2f-gate-attn-ffn1",
        "start bench-1a2f-gate-attn-ffn0",
        "start bench-1a2f-gate-attn-attention",
        "metrics bench-1a2f-gate-attn-attention",
        "metrics bench-1a2f-gate-attn-ffn0",
        "metrics bench-1a2f-gate-attn-ffn1",
        "stop bench-1a2f-gate-attn-attention",
        "stop bench-1a2f-gate-attn-ffn0",
        "stop bench-1a2f-gate-attn-ffn1",
    ]
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(result))
    result = written
    assert result["ffn_ranks"] == [1, 2]
    assert [(r["setup"], r["batch"]) for r in result["compared"]] == [
        ("afd 1:1", 1),
        ("afd 1:1", 4),
        ("afd 2:1", 4),
        ("afd 1:1 gate-attn", 1),
        ("afd 1:1 gate-attn", 4),
        ("afd 1:2 gate-attn", 1),
        ("afd 1:2 gate-attn", 4),
    ]
    assert [r["ratio"] for r in result["compared"]][-2:] == [1.3, 1.3]
    assert result["traffic"] == [
        {
            "setup": "afd 1:1 gate-attn",
            "num_ffn_ranks": 1,
            "steps": [10],
            "tokens": [10],
            "bytes": [40960],
            "bytes_per_step": 4096.0,
            "ratio_vs_one_rank": 1.0,
        },
        {
            "setup": "afd 1:2 gate-attn",
            "num_ffn_ranks": 2,
            "steps": [10, 10],
            "tokens": [10, 10],
            "bytes": [30720, 20480],
            "bytes_per_step": 5120.0,
            "ratio_vs_one_rank": 1.25,
        },
    ]
    assert "| afd 1:2 gate-attn | 2 | 10 / 10 | 5120 (3072 + 2048) | 1.25 |" in "\n".join(printed)
    assert result["quantized"] == []
    assert all(d.get("ffn_extra") is None for d in deployments)


def test_quantized_setups_are_layered_w8a8_and_mega_w4a8_per_channel() -> None:
    assert [(q.ffn_compute, q.expert_quant, q.group_size) for q in QUANTIZED_SETUPS] == [
        ("layered", "w8a8", 0),
        ("mega", "w4a8", 0),
    ]
    assert [q.setup for q in QUANTIZED_SETUPS] == [
        "afd 1:1 layered w8a8",
        "afd 1:1 mega w4a8_per_channel",
    ]
    assert [q.scheme for q in QUANTIZED_SETUPS] == ["w8a8", "w4a8_per_channel"]
    per_group = QuantizedSetup("layered", "w4a8", 32)
    assert (per_group.scheme, per_group.setup) == (
        "w4a8_per_group",
        "afd 1:1 layered w4a8_per_group g32",
    )
    assert QUANTIZED_SETUPS[1].ffn_extra() == {
        "ffn_compute": "mega",
        "expert_quant": "w4a8",
        "expert_quant_group_size": 0,
    }
    # Each is a valid FFN-role config.
    from afd_core.config import AFDConfig

    for q in (*QUANTIZED_SETUPS, per_group):
        AFDConfig.from_mapping({"role": "ffn", **q.ffn_extra()})


def test_quantized_rows_compare_to_native_afd_and_plain() -> None:
    q = QUANTIZED_SETUPS[0]
    native = [TPOTRow("afd 1:1", 1, 10.0, (10.0,)), TPOTRow("afd 1:1", 4, 20.0, (20.0,))]
    plain = [TPOTRow("plain", 1, 8.0, (8.0,)), TPOTRow("plain", 4, 16.0, (16.0,))]
    rows_q = [TPOTRow(q.setup, 1, 15.0, (15.0,)), TPOTRow(q.setup, 4, 24.0, (24.0,))]
    report = QuantReport(0, "layered", "w8a8", 0, 540672, 1048576, 2)
    rows = quantized_rows(q, rows_q, native, plain, report)
    assert rows[0] == QuantizedRow(
        "afd 1:1 layered w8a8",
        "layered",
        "w8a8",
        0,
        1,
        15.0,
        10.0,
        1.5,
        8.0,
        1.875,
        540672,
        1048576,
    )
    assert (rows[1].ratio_vs_native, rows[1].ratio_vs_plain) == (1.2, 1.5)
    assert rows[1].bytes_ratio_vs_bf16 == 0.515625
    assert render_quantized(rows).splitlines() == [
        "| setup | batch | TPOT plain (ms) | TPOT AFD native (ms) | TPOT quantized (ms) | "
        "vs AFD native | vs plain | expert bytes (vs bf16) |",
        "|---|---|---|---|---|---|---|---|",
        "| afd 1:1 layered w8a8 | 1 | 8.00 | 10.00 | 15.00 | 1.50 | 1.88 | 540672 (0.516) |",
        "| afd 1:1 layered w8a8 | 4 | 16.00 | 20.00 | 24.00 | 1.20 | 1.50 | 540672 (0.516) |",
    ]
    with pytest.raises(RuntimeError) as err:
        quantized_rows(q, rows_q, native, plain, None)
    assert str(err.value) == (
        "afd 1:1 layered w8a8: no afd_ffn_quantized_expert_bytes on /metrics of FFN rank 0"
    )


def test_run_bench_adds_the_quantized_computes_at_one_to_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "decoder_sparse_step": 1})
    )
    events: list[str] = []
    deployments: list[dict[str, Any]] = []
    expert_bytes = {"w8a8": 540672, "w4a8": 294912}

    def fake_afd_servers(model: object, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
        deployments.append(kw)
        n, prefix, extra = kw.get("num_ffn_ranks", 1), kw["prefix"], kw.get("ffn_extra")
        logs = [""] * n
        if kw["gate_on_attention"]:
            logs = [
                MetricsText().ffn(r, steps=1, calls=2, tokens=1, nbytes=8, peers=1, layers=2).text()
                for r in range(n)
            ]
        if extra is not None:
            q = QuantizedSetup(extra["ffn_compute"], extra["expert_quant"])
            logs[0] = (
                MetricsText()
                .quantized(0, q.ffn_compute, q.scheme, 0, expert_bytes[q.expert_quant], 1048576, 2)
                .text()
            )
        ffns = tuple(FakeServer(f"{prefix}-ffn{r}", log, events) for r, log in enumerate(logs))
        return FakeServer(f"{prefix}-attention", "", events), ffns

    tpot = {"plain": 10.0, "afd 1:1": 12.0, "afd 1:1 layered w8a8": 18.0}
    tpot["afd 1:1 mega w4a8_per_channel"] = 15.0
    monkeypatch.setattr(bench, "ensure_tiny_checkpoint", lambda spec, cache: model)
    monkeypatch.setattr(bench, "raw_round_trip_ms", lambda sizes, hidden: dict.fromkeys(sizes, 0.5))
    monkeypatch.setattr(
        bench, "plain_server", lambda model, name, **kw: FakeServer(name, "", events)
    )
    monkeypatch.setattr(bench, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: None)
    monkeypatch.setattr(
        bench,
        "measure_tpot",
        lambda server, b, cfg, setup: TPOTRow(setup, b, tpot.get(setup, 9.0) * b, (1.0,)),
    )
    out = tmp_path / "serving.json"
    printed: list[str] = []
    cfg = BenchConfig(
        batch_sizes=(1, 4), ffn_ranks=(1,), out=out, log_dir=tmp_path / "logs", stages=False
    )
    assert cfg.quantized
    result = json.loads(json.dumps(bench.run_bench(cfg, progress=printed.append)))
    assert json.loads(out.read_text()) == result

    quantized = [d for d in deployments if d.get("ffn_extra") is not None]
    assert [
        (d["num_attention_ranks"], d.get("num_ffn_ranks", 1), d["gate_on_attention"], d["prefix"])
        for d in quantized
    ] == [
        (1, 1, False, "bench-1a1f-layered-w8a8"),
        (1, 1, False, "bench-1a1f-mega-w4a8-per-channel"),
    ]
    assert [d["ffn_extra"] for d in quantized] == [q.ffn_extra() for q in QUANTIZED_SETUPS]
    # The bench measures speed: no accuracy measurement on its FFN ranks.
    assert all(d.get("ffn_env") is None for d in deployments)
    # Each quantized deployment is started and stopped like the others.
    assert "start bench-1a1f-mega-w4a8-per-channel-ffn0" in events
    assert "stop bench-1a1f-mega-w4a8-per-channel-attention" in events
    rows = result["quantized"]
    assert [(r["setup"], r["batch"]) for r in rows] == [
        ("afd 1:1 layered w8a8", 1),
        ("afd 1:1 layered w8a8", 4),
        ("afd 1:1 mega w4a8_per_channel", 1),
        ("afd 1:1 mega w4a8_per_channel", 4),
    ]
    assert [(r["tpot_ms"], r["tpot_native_ms"], r["tpot_plain_ms"]) for r in rows] == [
        (18.0, 12.0, 10.0),
        (72.0, 48.0, 40.0),
        (15.0, 12.0, 10.0),
        (60.0, 48.0, 40.0),
    ]
    assert [r["ratio_vs_native"] for r in rows] == [1.5, 1.5, 1.25, 1.25]
    assert [r["ratio_vs_plain"] for r in rows] == [1.8, 1.8, 1.5, 1.5]
    assert [(r["scheme"], r["expert_bytes"], r["bytes_ratio_vs_bf16"]) for r in rows][1:3] == [
        ("w8a8", 540672, 0.515625),
        ("w4a8_per_channel", 294912, 0.28125),
    ]
    # The TPOT samples are recorded; the transport comparison keeps its own rows.
    assert {r["setup"] for r in result["tpot"]} >= {r["setup"] for r in rows}
    assert not {r["setup"] for r in result["compared"]} & {r["setup"] for r in rows}
    text = "\n".join(printed)
    assert "| afd 1:1 mega w4a8_per_channel | 4 | 40.00 | 48.00 | 60.00 | 1.25 | 1.50 | " in text
    assert "294912 (0.281) |" in text


def test_run_bench_fails_when_a_quantized_ffn_rank_did_not_compute_quantized(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    events: list[str] = []

    def fake_afd_servers(model: object, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
        prefix = kw["prefix"]
        return FakeServer(f"{prefix}-attention", "", events), (
            FakeServer(f"{prefix}-ffn", "", events),
        )

    monkeypatch.setattr(bench, "ensure_tiny_checkpoint", lambda spec, cache: model)
    monkeypatch.setattr(bench, "raw_round_trip_ms", lambda sizes, hidden: dict.fromkeys(sizes, 0.5))
    monkeypatch.setattr(
        bench, "plain_server", lambda model, name, **kw: FakeServer(name, "", events)
    )
    monkeypatch.setattr(bench, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: None)
    monkeypatch.setattr(
        bench, "measure_tpot", lambda server, b, cfg, setup: TPOTRow(setup, b, 1.0, (1.0,))
    )
    cfg = BenchConfig(batch_sizes=(1,), ffn_ranks=(1,), log_dir=tmp_path / "logs")
    with pytest.raises(
        RuntimeError, match="afd 1:1 layered w8a8: no afd_ffn_quantized_expert_bytes"
    ):
        bench.run_bench(cfg, progress=lambda msg: None)
    # Every deployment ran and was stopped before the check.
    assert "stop bench-1a1f-layered-w8a8-ffn" in events
    started = {e.split()[1] for e in events if e.startswith("start ")}
    assert started == {e.split()[1] for e in events if e.startswith("stop ")}


def test_several_engine_starts_give_each_row_the_median_of_the_per_start_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    ffn = FakeServer("d-ffn", "ffn metrics", events)
    attention = FakeServer("d-attention", "", events)
    by_start = iter([{1: 6.0, 4: 7.0}, {1: 9.0, 4: 8.0}, {1: 5.0, 4: 7.5}])
    current: dict[int, float] = {}
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: current.update(next(by_start)))
    measured: list[str] = []

    def fake_measure(server: FakeServer, b: int, cfg: BenchConfig, setup: str) -> TPOTRow:
        measured.append(server.name)
        return TPOTRow(setup, b, current[b], (current[b], current[b] + 1))

    monkeypatch.setattr(bench, "measure_tpot", fake_measure)
    metrics: dict[str, str] = {}
    cfg = BenchConfig(starts=3)
    rows = bench.run_setup([attention, ffn], attention, (1, 4), cfg, "afd 1:1", metrics)

    assert [(r.batch, r.tpot_ms, r.start_tpot_ms) for r in rows] == [
        (1, 6.0, (6.0, 9.0, 5.0)),
        (4, 7.5, (7.0, 8.0, 7.5)),
    ]
    assert rows[0].tpot_samples_ms == (6.0, 7.0, 9.0, 10.0, 5.0, 6.0)
    assert measured == ["d-attention"] * 6  # the front server of every start
    # Each start stops every server before the next starts (FFN first up, Attention first down);
    # /metrics are read once, from the last start.
    starts = [e for e in events if e.startswith(("start", "stop", "restarted"))]
    one = ["start d-ffn", "start d-attention", "stop d-attention", "stop d-ffn"]
    again = ["restarted d-attention", "restarted d-ffn"]
    assert starts == [*one, *again, *one, *again, *one]
    assert events.count("metrics d-ffn") == 1 and metrics == {
        "d-attention": "",
        "d-ffn": "ffn metrics",
    }


def test_several_deployments_are_started_in_rounds_not_one_after_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    a, b = FakeServer("a", "", events), FakeServer("b", "b metrics", events)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: None)
    level = iter([5.0, 7.0, 6.0, 8.0])  # a, b, a, b: the host drifts between rounds
    monkeypatch.setattr(
        bench, "measure_tpot", lambda server, n, cfg, setup: TPOTRow(setup, n, next(level), ())
    )
    da = bench.Deployment("A", [a], a, (1,))
    db = bench.Deployment("B", [b], b, (1,), want_metrics=True)
    printed: list[str] = []
    bench.run_deployments([da, db], BenchConfig(starts=2), printed.append)

    runs = [e for e in events if e.startswith(("start", "restarted"))]
    assert runs == ["start a", "start b", "restarted a", "start a", "restarted b", "start b"]
    assert printed == ["A (start 1/2)", "B (start 1/2)", "A (start 2/2)", "B (start 2/2)"]
    assert [r.start_tpot_ms for r in da.rows] == [(5.0, 6.0)]
    assert [r.start_tpot_ms for r in db.rows] == [(7.0, 8.0)]
    assert db.metrics == {"b": "b metrics"} and da.metrics == {}
    assert events.count("metrics b") == 1  # from the last round only


def test_starts_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="starts=0 must be >= 1"):
        BenchConfig(starts=0)


def test_stage_rows_derive_the_hidden_share_of_the_round_trips() -> None:
    one = [TPOTRow("afd 1:1", 4, 20.0, (20.0,)), TPOTRow("afd 1:1", 16, 30.0, (30.0,))]
    two = [
        TPOTRow("afd 1:1 stages=2", 4, 19.0, (19.0,)),
        TPOTRow("afd 1:1 stages=2", 16, 27.0, (27.0,)),
    ]
    rows = bench.stage_rows(one, two, {4: 0.5, 16: 1.0}, 4, 0.75, "wide")
    assert [(r.model, r.batch, r.tpot_one_stage_ms, r.tpot_two_stages_ms) for r in rows] == [
        ("wide", 4, 20.0, 19.0),
        ("wide", 16, 30.0, 27.0),
    ]
    assert [r.hidden_share for r in rows] == [0.5, 0.75]
    assert all(r.split_steps == 0.75 for r in rows)
    table = bench.render_stages(rows)
    assert "| wide | 16 | 30.00 | 27.00 | 4.000 | 75 % | 75 % |" in table


def test_split_step_share_counts_steps_with_two_computed_stages() -> None:
    from afd_models.demo.servers import FFNStats

    stats = FFNStats(rank=0, steps=10, compute_calls=60, tokens=100, bytes=0, peers=1, layers=4)
    assert bench.split_step_share(stats) == 0.5
    with pytest.raises(RuntimeError, match="no afd_\\* counters on /metrics"):
        bench.split_step_share(None)


def test_run_bench_measures_two_stages_against_one_at_batches_of_two_or_more(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "decoder_sparse_step": 1})
    )
    events: list[str] = []
    deployments: list[dict[str, object]] = []

    def fake_afd_servers(model: object, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
        deployments.append(kw)
        log = (
            MetricsText().ffn(0, steps=10, calls=30, tokens=10, nbytes=1, peers=1, layers=2).text()
        )
        ffn = FakeServer(f"{kw['prefix']}-ffn", log, events)
        return FakeServer(f"{kw['prefix']}-attention", "", events), (ffn,)

    tpot = {
        "plain": 10.0,
        "afd 1:1": 12.0,
        "afd 1:1 stages=2": 11.0,
        "afd 1:1 wide": 40.0,
        "afd 1:1 wide stages=2": 36.0,
    }
    specs: list[object] = []

    def fake_checkpoint(spec: object, cache: object) -> Path:
        specs.append(spec)
        return model

    monkeypatch.setattr(bench, "ensure_tiny_checkpoint", fake_checkpoint)
    round_trips: list[tuple[tuple[int, ...], int]] = []

    def fake_round_trip(sizes: tuple[int, ...], hidden: int) -> dict[int, float]:
        round_trips.append((tuple(sizes), hidden))
        return dict.fromkeys(sizes, 0.25 if len(round_trips) == 1 else 0.5)

    monkeypatch.setattr(bench, "raw_round_trip_ms", fake_round_trip)
    monkeypatch.setattr(
        bench, "plain_server", lambda model, name, **kw: FakeServer(name, "", events)
    )
    monkeypatch.setattr(bench, "afd_servers", fake_afd_servers)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: None)
    measured: list[tuple[str, int]] = []

    def fake_measure(server: object, b: int, cfg: object, setup: str) -> TPOTRow:
        measured.append((setup, b))
        return TPOTRow(setup, b, tpot.get(setup, 9.0), (1.0,))

    monkeypatch.setattr(bench, "measure_tpot", fake_measure)
    cfg = BenchConfig(batch_sizes=(1, 4, 16), log_dir=tmp_path / "logs", quantized=False)
    result = bench.run_bench(cfg, progress=lambda _msg: None)
    by_prefix = {d["prefix"]: d for d in deployments}
    for prefix in ("bench-1a1f-stages2", "bench-1a1f-wide-stages2"):
        staged = by_prefix[prefix]
        assert staged["afd_extra"] == {"num_stages": 2}
        assert staged["options"].extra_args[-4:] == SPLIT_EVERY_STEP_ARGS
    assert by_prefix["bench-1a1f-wide"].get("afd_extra") is None
    assert [s.width for s in specs] == ["tiny", "wide"]  # type: ignore[attr-defined]
    assert round_trips == [((1, 4, 16), 64), ((4, 16), 64)]
    assert [m for m in measured if "stages=2" in m[0] or "wide" in m[0]] == [
        ("afd 1:1 stages=2", 4),
        ("afd 1:1 stages=2", 16),
        ("plain wide", 4),  # the wide model's plain reference (afd plan's calibration check)
        ("plain wide", 16),
        ("plain wide (vLLM default threads)", 4),  # every core: the break-even reference
        ("plain wide (vLLM default threads)", 16),
        ("afd 1:1 wide", 4),
        ("afd 1:1 wide", 16),
        ("afd 1:1 wide stages=2", 4),
        ("afd 1:1 wide stages=2", 16),
    ]
    # tiny: (12 - 11) / (2 layers x 0.25 ms) = 2.0; wide: (40 - 36) / (2 x 0.5) = 4.0;
    # 30 calls over 10 steps of 2 layers: half the steps split.
    assert [
        (r["model"], r["batch"], r["hidden_share"], r["split_steps"], r["meets_target"])
        for r in result["stages"]
    ] == [
        ("tiny", 4, 2.0, 0.5, True),
        ("tiny", 16, 2.0, 0.5, True),
        ("wide", 4, 4.0, 0.5, True),
        ("wide", 16, 4.0, 0.5, True),
    ]


def test_bench_prompts_are_distinct_and_start_with_the_demo_prompts() -> None:
    prompts = bench_prompts(16)
    assert len(prompts) == 16
    assert len(set(prompts)) == 16
    assert prompts[: len(DEMO_PROMPTS)] == DEMO_PROMPTS
    assert prompts[len(DEMO_PROMPTS)] == f"{DEMO_PROMPTS[0]} (1)"
    assert bench_prompts(1) == DEMO_PROMPTS[:1]
    with pytest.raises(ValueError, match="batch: 0"):
        bench_prompts(0)
