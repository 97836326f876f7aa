"""``afd`` flags driven through :func:`afd_models.cli.main` and checked by their effect.

``afd demo --speculative`` / ``--startup-timeout``, ``afd tiny --width`` / ``--mtp-layers`` and
``afd bench --starts`` (``afd plan --dense-quant`` / ``--kv-dtype`` / ``--routing``: in
``test_models_cli_plan.py``). No engine
starts: the demo's servers are built by the real ``plain_server`` / ``afd_servers`` (argv and
:class:`~afd_models.demo.servers.ServerConfig` only, nothing spawned) and then replaced by
stand-ins; the bench's by :class:`FakeServer`; every refusal test replaces ``run_demo`` with one
that fails the test if it is reached.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_models import cli
from afd_models.demo import bench, run, servers, tiny
from afd_models.demo.bench import BenchConfig, TPOTRow
from afd_models.demo.client import BatchResult, Completion
from afd_models.demo.servers import ServerConfig
from afd_models.demo.tiny import WIDE_QWEN3_MOE, TinySpec

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_fake_servers import FakeServer, MetricsText


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No calibrated profile of this host (``afd plan`` / ``afd bench`` read one by default) and
    no tiny checkpoint written outside the test's own folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv(tiny.DEFAULT_CACHE_ENV, str(tmp_path / "tiny-cache"))


def _no_demo_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal test must refuse before any server is built: reaching the demo fails it."""
    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(
        run, "run_demo", lambda cfg, progress: pytest.fail(f"the demo ran with {cfg!r}")
    )


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``afd ARGV`` expecting a usage error (exit 2); returns stderr."""
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# afd demo: the real server factories, stand-in servers


class _StartingServer(FakeServer):
    """A stand-in keeping the real server's :class:`ServerConfig`, for the real
    :func:`~afd_models.demo.servers.wait_until_healthy`: it has been starting for ``elapsed_s``
    and answers ``/health`` from its second poll on."""

    def __init__(self, config: ServerConfig, text: str, events: list[str], elapsed_s: float):
        super().__init__(config.name, text, events)
        self.config = config
        self._elapsed = elapsed_s
        self._polls = 0
        self._progress: Callable[[str], None] = lambda _msg: None

    def healthy(self) -> bool:
        self._polls += 1
        self._events.append(f"poll {self.name}")
        return self._polls > 1

    def elapsed_s(self) -> float:
        return self._elapsed

    def log_tail(self, lines: int = 40) -> str:
        return "loading weights"


class _Demo:
    """``afd demo`` with the real :func:`run.plain_server` / :func:`run.afd_servers` building each
    server (argv, startup timeout) and a stand-in serving it: ``configs`` maps each server's
    name to the :class:`ServerConfig` it was built with; ``tiny_specs`` the tiny checkpoints
    asked for (a stub checkpoint of ``model_type`` is returned, no weights are written)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path,
        *,
        model_type: str = "qwen3_moe",
        starting_for_s: float | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.events: list[str] = []
        self.configs: dict[str, ServerConfig] = {}
        self.tiny_specs: list[TinySpec] = []
        self._starting_for_s = starting_for_s
        real_plain, real_afd = run.plain_server, run.afd_servers

        def plain(model: Any, **kw: Any) -> FakeServer:
            return self._stand_in(real_plain(model, **kw), "")

        def afd(model: Any, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
            attention, ffns = real_afd(model, **kw)
            att_text = MetricsText().param_bytes("attention", 0, 7).text()
            return self._stand_in(attention, att_text), tuple(
                self._stand_in(f, MetricsText().param_bytes("ffn", rank, 100).text())
                for rank, f in enumerate(ffns)
            )

        def checkpoint(spec: TinySpec, cache_dir: Path | None) -> Path:
            self.tiny_specs.append(spec)
            path = tmp_path / f"tiny-{spec.family}-mtp{spec.mtp_layers}"
            path.mkdir(exist_ok=True)
            config = {"model_type": model_type, "num_nextn_predict_layers": spec.mtp_layers}
            (path / "config.json").write_text(json.dumps(config))
            return path

        def complete_many(base_url: str, prompts: Any, **kw: Any) -> BatchResult:
            return BatchResult(tuple(Completion(p, "", (1, 2, 3), 0.1) for p in prompts), 1.0)

        monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
        monkeypatch.setattr(run, "plain_server", plain)
        monkeypatch.setattr(run, "afd_servers", afd)
        monkeypatch.setattr(run, "ensure_tiny_checkpoint", checkpoint)
        monkeypatch.setattr(run, "complete_many", complete_many)
        if starting_for_s is None:
            monkeypatch.setattr(run, "wait_until_healthy", lambda servers: None)
        else:  # the real wait, without its 1 s sleep between polls
            wait = functools.partial(servers.wait_until_healthy, poll_interval_s=0.0)
            monkeypatch.setattr(run, "wait_until_healthy", wait)

    def _stand_in(self, real: servers.VLLMServer, text: str) -> FakeServer:
        assert real.pid is None  # built, never started
        self.configs[real.name] = real.config
        if self._starting_for_s is None:
            return FakeServer(real.name, text, self.events)
        return _StartingServer(real.config, text, self.events, self._starting_for_s)

    def main(self, *argv: str) -> int:
        return cli.main(["demo", "--prompt", "a", "--log-dir", str(self.tmp_path / "logs"), *argv])

    def speculative_config(self, name: str) -> dict[str, Any] | None:
        """The parsed ``--speculative-config`` of server ``name``'s argv (None without one)."""
        argv = list(self.configs[name].argv)
        if "--speculative-config" not in argv:
            return None
        assert argv.count("--speculative-config") == 1, argv
        value: dict[str, Any] = json.loads(argv[argv.index("--speculative-config") + 1])
        return value


def _mtp_checkpoint(tmp_path: Path) -> Path:
    model = tmp_path / "dsv3-mtp"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1})
    )
    return model


@pytest.mark.parametrize("source", ["tiny", "model"])
def test_demo_speculative_drafts_on_plain_and_attention_never_on_the_ffn_role(
    source: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--speculative N``: plain vLLM and the Attention role get DeepSeek's MTP drafter with N
    tokens per step, the FFN role no drafter; the tiny checkpoint is built with one MTP layer
    (a ``--model`` is served as given)."""
    demo = _Demo(monkeypatch, tmp_path, model_type="deepseek_v3")
    if source == "tiny":
        rc = demo.main("--family", "deepseek_v3", "--speculative", "2")
        assert demo.tiny_specs == [
            TinySpec(family="deepseek_v3", seed=0, mtp_layers=1, draft="accepting")
        ]
        tokens = 2
    else:
        model = _mtp_checkpoint(tmp_path)
        rc = demo.main("--model", str(model), "--speculative", "3")
        assert demo.tiny_specs == []
        assert demo.configs["plain"].argv[demo.configs["plain"].argv.index("serve") + 1] == str(
            model
        )
        tokens = 3
    out = capsys.readouterr().out
    assert rc == cli.EXIT_OK, out
    assert set(demo.configs) == {"plain", "afd-attention", "afd-ffn"}
    drafter = {"method": "deepseek_mtp", "num_speculative_tokens": tokens}
    assert demo.speculative_config("plain") == drafter
    assert demo.speculative_config("afd-attention") == drafter
    assert demo.speculative_config("afd-ffn") is None
    assert f"MTP {tokens} speculative token(s)" in out


def test_demo_without_speculative_sets_no_drafter_and_no_mtp_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = _Demo(monkeypatch, tmp_path, model_type="deepseek_v3")
    assert demo.main("--family", "deepseek_v3") == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "speculative decoding" not in out and "speculative token(s)" not in out
    assert demo.tiny_specs == [TinySpec(family="deepseek_v3", seed=0, mtp_layers=0)]
    assert {name: demo.speculative_config(name) for name in demo.configs} == {
        "plain": None,
        "afd-attention": None,
        "afd-ffn": None,
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--speculative", "-1", "--family", "deepseek_v3"],
            "error: --speculative=-1 must be >= 0",
        ),
        (
            ["--speculative", "2"],
            "error: --speculative=2 needs --family deepseek_v3 (the tiny checkpoint whose MTP "
            "layer drafts) or a --model with MTP layers",
        ),
        (["--speculative", "1", "--family", "qwen3_moe"], "error: --speculative=1 needs --family"),
        (
            ["--speculative", "1", "--family", "deepseek_v2"],
            "error: --speculative=1 needs --family",
        ),
        (["--speculative", "two"], "argument --speculative: invalid int value: 'two'"),
    ],
)
def test_demo_speculative_refusals_name_the_flag(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_demo_run(monkeypatch)
    assert message in _usage_error(["demo", *argv], capsys)


def test_demo_speculative_refuses_a_model_without_mtp_layers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_demo_run(monkeypatch)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 0})
    )
    err = _usage_error(["demo", "--model", str(tmp_path), "--speculative", "1"], capsys)
    assert "--speculative=1" in err


def test_demo_startup_timeout_reaches_every_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    demo = _Demo(monkeypatch, tmp_path)
    assert demo.main("--ffn-ranks", "2", "--gate", "attention", "--startup-timeout", "42.5") == 0
    assert {n: c.startup_timeout_s for n, c in demo.configs.items()} == {
        "plain": 42.5,
        "afd-attention": 42.5,
        "afd-ffn0": 42.5,
        "afd-ffn1": 42.5,
    }
    demo.configs.clear()
    assert demo.main() == cli.EXIT_OK
    assert {c.startup_timeout_s for c in demo.configs.values()} == {900.0}  # the default


@pytest.mark.parametrize(("timeout", "code"), [("40", cli.EXIT_SERVER_ERROR), ("60", cli.EXIT_OK)])
def test_demo_startup_timeout_is_the_limit_the_health_wait_applies(
    timeout: str,
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Servers that have been starting for 50 s and answer ``/health`` on the next poll: with
    ``--startup-timeout 40`` the real wait gives up on the first (exit 3, naming it and the
    limit), with 60 it waits and the demo runs."""
    demo = _Demo(monkeypatch, tmp_path, starting_for_s=50.0)
    assert demo.main("--startup-timeout", timeout) == code
    captured = capsys.readouterr()
    if code == cli.EXIT_SERVER_ERROR:
        assert "server 'plain' was not healthy after 40s" in captured.err
        lifecycle = [e for e in demo.events if e.split()[0] in ("start", "poll", "stop")]
        assert lifecycle == ["start plain", "poll plain", "stop plain"]  # one poll, no AFD
    else:
        assert captured.err == ""
        polls = Counter(e.split()[1] for e in demo.events if e.startswith("poll "))
        assert polls == {"plain": 2, "afd-attention": 2, "afd-ffn": 2}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "error: --startup-timeout=0.0 must be > 0"),
        ("-5", "error: --startup-timeout=-5.0 must be > 0"),
        ("soon", "argument --startup-timeout: invalid float value: 'soon'"),
    ],
)
def test_demo_startup_timeout_refusals_name_the_flag(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_demo_run(monkeypatch)
    assert message in _usage_error(["demo", f"--startup-timeout={value}"], capsys)


def test_demo_startup_timeout_refuses_nan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_demo_run(monkeypatch)
    assert "--startup-timeout=nan" in _usage_error(["demo", "--startup-timeout", "nan"], capsys)


# --------------------------------------------------------------------------------------------
# afd tiny


def _tiny(capsys: pytest.CaptureFixture[str], cache: Path, *argv: str) -> Path:
    assert cli.main(["tiny", *argv, "--cache-dir", str(cache)]) == cli.EXIT_OK
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == cache
    return path


def _recorded_tensors(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, ...]]:
    """Record each tensor the builder asks for (name -> shape) and write a 1-element stand-in:
    the wide checkpoint's 400 MB of experts are not generated."""
    shapes: dict[str, tuple[int, ...]] = {}

    def make_tensor(seed: int, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        shapes[name] = tuple(shape)
        return torch.zeros(1)

    monkeypatch.setattr(tiny, "make_tensor", make_tensor)
    return shapes


def test_tiny_width_wide_writes_a_qwen3_moe_of_hidden_1024(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shapes = _recorded_tensors(monkeypatch)
    wide = _tiny(capsys, tmp_path, "--width", "wide")
    config = json.loads((wide / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert {k: config[k] for k in WIDE_QWEN3_MOE} == WIDE_QWEN3_MOE
    assert config["hidden_size"] == 1024
    vocab, experts = config["vocab_size"], config["num_experts"]
    assert shapes["model.embed_tokens.weight"] == (vocab, 1024)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16 * 64, 1024)
    assert shapes[f"model.layers.3.mlp.experts.{experts - 1}.down_proj.weight"] == (1024, 1024)

    shapes.clear()
    narrow = _tiny(capsys, tmp_path)  # the default width, cached apart
    assert narrow != wide and wide.name.startswith("qwen3_moe-wide-")
    assert json.loads((narrow / "config.json").read_text())["hidden_size"] == 128
    assert shapes["model.embed_tokens.weight"] == (vocab, 128)


def test_tiny_mtp_layers_writes_the_draft_layers_and_their_weights(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    path = _tiny(capsys, tmp_path, "--family", "deepseek_v3", "--mtp-layers", "2")
    config = json.loads((path / "config.json").read_text())
    n, h, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    assert config["num_nextn_predict_layers"] == 2
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.")}
    assert layers == set(range(n + 2))
    for layer in (n, n + 1):
        p = f"model.layers.{layer}."
        assert shapes[p + "eh_proj.weight"] == (h, 2 * h)
        assert shapes[p + "enorm.weight"] == shapes[p + "hnorm.weight"] == (h,)
        assert shapes[p + "shared_head.head.weight"] == (vocab, h)
        assert p + "shared_head.norm.weight" in shapes
        experts = {k.split(".")[5] for k in shapes if k.startswith(p + "mlp.experts.")}
        assert len(experts) == config["n_routed_experts"]  # a full MoE layer the FFN role serves

    recorded = _recorded_tensors(monkeypatch)
    plain = _tiny(capsys, tmp_path, "--family", "deepseek_v3")  # --mtp-layers 0, cached apart
    assert plain != path
    assert json.loads((plain / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert {int(k.split(".")[2]) for k in recorded if k.startswith("model.layers.")} == set(
        range(n)
    )
    assert not any("eh_proj" in k or "shared_head" in k for k in recorded)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--family", "deepseek_v3", "--mtp-layers", "3"],
            "afd tiny: TinySpec.mtp_layers=3; allowed: 0, 1 or 2",
        ),
        (["--family", "deepseek_v3", "--mtp-layers", "-1"], "TinySpec.mtp_layers=-1; allowed"),
        (
            ["--mtp-layers", "1"],
            "afd tiny: TinySpec.mtp_layers=1 with family='qwen3_moe'; allowed: 0 (MTP layers "
            "are DeepSeek-V3's)",
        ),
        (
            ["--family", "deepseek_v3", "--width", "wide"],
            "afd tiny: TinySpec.width='wide' with family='deepseek_v3'; allowed: 'tiny'",
        ),
        (["--width", "huge"], "argument --width: invalid choice: 'huge'"),
    ],
)
def test_tiny_width_and_mtp_refusals_write_nothing(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    assert message in _usage_error(["tiny", *argv, "--cache-dir", str(cache)], capsys)
    assert not cache.exists()


@pytest.mark.parametrize("argv", [["--width", "wide"], ["--mtp-layers", "2"]])
def test_tiny_published_refuses_the_family_shape_flags(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from afd_models.demo import published

    monkeypatch.setattr(
        published,
        "ensure_published_checkpoint",
        lambda spec, cache: pytest.fail(f"built {spec!r} ignoring {argv}"),
    )
    cache = str(tmp_path / "cache")
    err = _usage_error(
        ["tiny", "--published", "qwen3-30b-a3b", *argv, "--cache-dir", cache], capsys
    )
    assert argv[0] in err


# --------------------------------------------------------------------------------------------
# afd bench


def _bench(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str
) -> tuple[int, list[str], int, dict[str, Any]]:
    """``afd bench`` (no quantized or stage rows, batch 1, FFN ranks 1) on stand-in servers;
    returns the exit status, the servers' events, the number of health waits and the JSON."""
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "decoder_sparse_step": 1})
    )
    events: list[str] = []
    waits: list[int] = []
    measured: Counter[str] = Counter()

    def afd_servers(model: Any, **kw: Any) -> tuple[FakeServer, tuple[FakeServer, ...]]:
        prefix, n = kw["prefix"], kw.get("num_ffn_ranks", 1)
        ffns = tuple(
            FakeServer(
                f"{prefix}-ffn{r}",
                MetricsText().ffn(r, steps=4, calls=8, tokens=4, nbytes=64, peers=1, layers=2).text(),
                events,
            )
            for r in range(n)
        )  # fmt: skip
        return FakeServer(f"{prefix}-attention", "", events), ffns

    def measure_tpot(server: Any, batch: int, cfg: BenchConfig, setup: str) -> TPOTRow:
        # The k-th start of a setup measures 10 + k ms: a row shows which starts it took.
        tpot = 10.0 + measured[setup]
        measured[setup] += 1
        return TPOTRow(setup, batch, tpot, (tpot,))

    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(bench, "ensure_tiny_checkpoint", lambda spec, cache: model)
    monkeypatch.setattr(bench, "raw_round_trip_ms", lambda sizes, hidden: dict.fromkeys(sizes, 0.5))
    monkeypatch.setattr(
        bench, "plain_server", lambda model, name, **kw: FakeServer(name, "", events)
    )
    monkeypatch.setattr(bench, "afd_servers", afd_servers)
    monkeypatch.setattr(bench, "wait_until_healthy", lambda servers: waits.append(len(servers)))
    monkeypatch.setattr(bench, "measure_tpot", measure_tpot)
    out = tmp_path / "bench.json"
    fixed = ["--batch-sizes", "1", "--ffn-ranks", "1", "--no-quantized", "--no-stages"]
    rc = cli.main(["bench", *fixed, "--out", str(out), "--log-dir", str(tmp_path / "logs"), *argv])
    return rc, events, len(waits), json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("starts", [1, 3])
def test_bench_starts_starts_every_deployment_that_many_times(
    starts: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    argv = [] if starts == 1 else ["--starts", str(starts)]
    rc, events, waits, result = _bench(monkeypatch, tmp_path, *argv)
    assert rc == cli.EXIT_OK
    started = Counter(e.split()[1] for e in events if e.startswith("start "))
    stopped = Counter(e.split()[1] for e in events if e.startswith("stop "))
    restarted = Counter(e.split()[1] for e in events if e.startswith("restarted "))
    names = {
        "plain",
        "plain-default-threads",
        "bench-1a1f-attention",
        "bench-1a1f-ffn0",
        "bench-2a1f-attention",
        "bench-2a1f-ffn0",
        "bench-1a1f-gate-attn-attention",
        "bench-1a1f-gate-attn-ffn0",
    }
    assert started == stopped == dict.fromkeys(names, starts)
    assert restarted == (dict.fromkeys(names, starts - 1) if starts > 1 else {})
    deployments = 5  # plain, plain default threads, afd 1:1, afd 2:1, afd 1:1 gate-attn
    assert waits == deployments * starts
    assert result["starts"] == starts
    rows = {(r["setup"], r["batch"]): r for r in result["tpot"]}
    assert len(rows) == deployments
    per_start = tuple(10.0 + k for k in range(starts))
    for row in rows.values():
        assert tuple(row["start_tpot_ms"]) == (per_start if starts > 1 else ())
        assert row["tpot_ms"] == sorted(per_start)[(starts - 1) // 2]  # the per-start median


@pytest.mark.parametrize(
    ("value", "message"),
    [("0", "afd bench: starts=0 must be >= 1"), ("once", "invalid int value: 'once'")],
)
def test_bench_starts_refusals_name_the_value_and_start_nothing(
    value: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "missing_demo_modules", lambda command: [])
    monkeypatch.setattr(bench, "run_bench", lambda cfg, progress: pytest.fail("bench ran"))
    assert message in _usage_error(["bench", "--starts", value], capsys)
