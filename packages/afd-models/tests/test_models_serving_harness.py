"""Server harness without vLLM: role arguments, parity, log parsing and process failure paths."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

psutil = pytest.importorskip("psutil")
pytest.importorskip("requests")

from afd_models.demo.client import Completion, CompletionError, complete, complete_many  # noqa: E402
from afd_models.demo.parity import compare_parity, first_mismatch  # noqa: E402
from afd_models.demo.servers import (  # noqa: E402
    EngineOptions,
    MetricsUnavailableError,
    ServerConfig,
    ServerExitedError,
    ServerStartTimeoutError,
    VLLMServer,
    afd_config,
    afd_role_args,
    afd_series_count,
    afd_servers,
    free_port,
    free_ports,
    parity_options,
    parse_ffn_stats,
    parse_layer_signatures,
    parse_param_bytes,
    parse_quant_error,
    parse_quantized,
    process_tree_rss,
    sample_total,
    wait_until_healthy,
)

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_fake_servers import MetricsText  # noqa: E402


def _config(
    tmp_path: Path, code: str, *, timeout_s: float = 60.0, name: str = "fake"
) -> ServerConfig:
    return ServerConfig(
        name=name,
        argv=(sys.executable, "-c", code),
        port=free_port(),
        log_path=tmp_path / f"{name}.log",
        startup_timeout_s=timeout_s,
    )


FAKE_SERVER = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/metrics":
            n = len(os.environ.get("PROMETHEUS_MULTIPROC_DIR", ""))
            data = (
                "# TYPE afd_param_bytes gauge\n"
                f'afd_param_bytes{{role="ffn",rank="0"}} {n}\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"data": [{"id": "fake-model"}]})
        else:
            self._send(404, {})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0.0 and req["return_token_ids"] is True
        ids = [len(req["prompt"]) + i for i in range(req["max_tokens"])]
        choice = {"text": req["prompt"].upper(), "token_ids": ids}
        if req["prompt"] == "no-ids":
            del choice["token_ids"]
        self._send(200, {"model": req["model"], "choices": [choice]})

print("fake server up", flush=True)
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _fake_server(tmp_path: Path) -> VLLMServer:
    port = free_port()
    cfg = ServerConfig(
        name="fake",
        argv=(sys.executable, "-c", FAKE_SERVER, str(port)),
        port=port,
        log_path=tmp_path / "fake.log",
        startup_timeout_s=60,
    )
    return VLLMServer(cfg)


def test_ffn_role_args_are_the_documented_launch() -> None:
    args = afd_role_args(
        "ffn", afd_port=29555, num_attention_ranks=2, num_ffn_ranks=1, gate_on_attention=True
    )
    assert args[0] == "--additional-config"
    assert len(args) == 2
    assert json.loads(args[1]) == {
        "afd": {
            "role": "ffn",
            "port": 29555,
            "num_attention_ranks": 2,
            "num_ffn_ranks": 1,
            "ffn_rank": 0,
            "compute_gate_on_attention": True,
        }
    }


def test_ffn_rank_is_emitted_for_the_ffn_role_only() -> None:
    ffn = afd_config(
        "ffn",
        afd_port=29555,
        num_attention_ranks=1,
        num_ffn_ranks=4,
        gate_on_attention=True,
        ffn_rank=3,
    )
    assert ffn == {
        "role": "ffn",
        "port": 29555,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 4,
        "ffn_rank": 3,
        "compute_gate_on_attention": True,
    }
    attention = afd_config(
        "attention", afd_port=29555, num_attention_ranks=1, num_ffn_ranks=4, gate_on_attention=True
    )
    assert attention == {
        "role": "attention",
        "port": 29555,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 4,
        "compute_gate_on_attention": True,
    }
    args = afd_role_args(
        "ffn",
        afd_port=29555,
        num_attention_ranks=1,
        num_ffn_ranks=2,
        gate_on_attention=True,
        ffn_rank=1,
    )
    assert args == [
        "--additional-config",
        '{"afd": {"compute_gate_on_attention": true, "ffn_rank": 1, "num_attention_ranks": 1, '
        '"num_ffn_ranks": 2, "port": 29555, "role": "ffn"}}',
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ffn_rank": 2, "num_ffn_ranks": 2}, "ffn_rank=2 must be in 0..1 (num_ffn_ranks=2)"),
        ({"ffn_rank": -1, "num_ffn_ranks": 2}, "ffn_rank=-1 must be in 0..1 (num_ffn_ranks=2)"),
        ({"ffn_rank": 1}, "ffn_rank=1 must be in 0..0 (num_ffn_ranks=1)"),
        ({"ffn_rank": True, "num_ffn_ranks": 2}, "ffn_rank=True must be an int"),
        (
            {"role": "attention", "ffn_rank": 1, "num_ffn_ranks": 2},
            "ffn_rank=1 is an FFN-role field; role='attention' needs 0",
        ),
        (
            {"num_ffn_ranks": 2, "gate_on_attention": False},
            "num_ffn_ranks=2 > 1 needs gate_on_attention=True",
        ),
        ({"num_ffn_ranks": 2, "extra": {"ffn_rank": 1}}, "extra key 'ffn_rank' would override"),
        (
            {"role": "attention", "num_ffn_ranks": 2, "extra": {"ffn_rank": 1}},
            "extra key 'ffn_rank' would override",
        ),
    ],
)
def test_ffn_rank_validation(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, Any] = {
        "role": "ffn",
        "afd_port": 1234,
        "num_attention_ranks": 1,
        "gate_on_attention": True,
    }
    base.update(kwargs)
    role = base.pop("role")
    for build in (afd_config, afd_role_args):
        with pytest.raises(ValueError) as err:
            build(role, **base)
        assert str(err.value).startswith(message)


def test_attention_role_args_add_data_parallel_only_for_several_ranks() -> None:
    one = afd_role_args("attention", afd_port=1234, num_attention_ranks=1, gate_on_attention=False)
    two = afd_role_args("attention", afd_port=1234, num_attention_ranks=2, gate_on_attention=False)
    assert "--data-parallel-size" not in one
    assert two[2:] == ["--data-parallel-size", "2", "--api-server-count", "1"]
    assert json.loads(two[1])["afd"]["role"] == "attention"
    assert json.loads(one[1])["afd"]["compute_gate_on_attention"] is False


def test_attention_tp_size_reaches_both_roles_and_the_attention_servers_tp_flag() -> None:
    kwargs = {"afd_port": 1234, "num_attention_ranks": 1, "gate_on_attention": False}
    extra = {"attention_tp_size": 2}
    att = afd_role_args("attention", extra=extra, **kwargs)  # type: ignore[arg-type]
    ffn = afd_role_args("ffn", extra=extra, **kwargs)  # type: ignore[arg-type]
    assert att[2:] == ["--tensor-parallel-size", "2"]
    assert ffn[2:] == []  # an FFN server is one FFN rank: no TP flag
    assert json.loads(att[1])["afd"]["attention_tp_size"] == 2
    assert json.loads(ffn[1])["afd"]["attention_tp_size"] == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "moe"}, "role"),
        ({"afd_port": 0}, "afd_port"),
        ({"num_attention_ranks": 0}, "num_attention_ranks"),
        ({"num_ffn_ranks": 0}, "num_ffn_ranks"),
        ({"extra": {"role": "ffn"}}, "role"),
    ],
)
def test_role_args_validation_names_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, Any] = {
        "role": "ffn",
        "afd_port": 1234,
        "num_attention_ranks": 1,
        "gate_on_attention": False,
    }
    base.update(kwargs)
    role = base.pop("role")
    with pytest.raises(ValueError, match=field):
        afd_role_args(role, **base)  # type: ignore[arg-type]


def test_afd_servers_share_one_afd_port_and_engine_options(tmp_path: Path) -> None:
    opts = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=256)
    att, ffns = afd_servers(
        "/m", log_dir=tmp_path, options=opts, num_attention_ranks=2, gate_on_attention=True
    )
    assert len(ffns) == 1
    (ffn,) = ffns
    assert (att.name, ffn.name) == ("afd-attention", "afd-ffn")
    assert ffn.config.log_path == tmp_path / "afd-ffn.log"
    a_cfg = json.loads(att.config.argv[att.config.argv.index("--additional-config") + 1])
    f_cfg = json.loads(ffn.config.argv[ffn.config.argv.index("--additional-config") + 1])
    assert a_cfg["afd"]["port"] == f_cfg["afd"]["port"]
    assert (a_cfg["afd"]["role"], f_cfg["afd"]["role"]) == ("attention", "ffn")
    assert att.config.port != ffn.config.port
    for s in (att, ffn):
        argv = list(s.config.argv)
        assert argv[1:5] == ["-m", "afd_models.cli", "serve", "/m"]
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert "--enforce-eager" in argv
        assert argv[argv.index("--max-model-len") + 1] == "256"
        assert s.config.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "--data-parallel-size" in att.config.argv
    assert "--data-parallel-size" not in ffn.config.argv
    assert f_cfg["afd"]["ffn_rank"] == 0
    assert "ffn_rank" not in a_cfg["afd"]


def _afd(server: VLLMServer) -> dict[str, object]:
    argv = server.config.argv
    cfg: dict[str, object] = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
    return cfg


def test_afd_servers_build_one_server_per_ffn_rank(tmp_path: Path) -> None:
    opts = EngineOptions(max_model_len=256)
    att, ffns = afd_servers(
        "/m",
        log_dir=tmp_path,
        options=opts,
        num_attention_ranks=1,
        num_ffn_ranks=3,
        gate_on_attention=True,
        prefix="ep",
    )
    assert isinstance(ffns, tuple)
    assert att.name == "ep-attention"
    assert [s.name for s in ffns] == ["ep-ffn0", "ep-ffn1", "ep-ffn2"]
    assert [s.config.log_path for s in ffns] == [tmp_path / f"ep-ffn{i}.log" for i in range(3)]
    assert [_afd(s)["ffn_rank"] for s in ffns] == [0, 1, 2]
    assert {_afd(s)["role"] for s in ffns} == {"ffn"}
    assert {_afd(s)["num_ffn_ranks"] for s in (att, *ffns)} == {3}
    assert {_afd(s)["compute_gate_on_attention"] for s in (att, *ffns)} == {True}
    afd_ports = {_afd(s)["port"] for s in (att, *ffns)}
    assert len(afd_ports) == 1
    http_ports = [s.config.port for s in (att, *ffns)]
    assert len(set(http_ports)) == 4
    assert afd_ports.isdisjoint(http_ports)
    for s in (att, *ffns):
        argv = list(s.config.argv)
        assert argv[argv.index("--port") + 1] == str(s.config.port)
        assert argv[argv.index("--max-model-len") + 1] == "256"
        assert s.base_url == f"http://127.0.0.1:{s.config.port}"
    assert "ffn_rank" not in _afd(att)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_ffn_ranks": 0}, "num_ffn_ranks=0 must be >= 1"),
        ({"num_ffn_ranks": 2, "gate_on_attention": False}, "num_ffn_ranks=2 > 1 needs"),
    ],
)
def test_afd_servers_reject_bad_ffn_ranks(
    tmp_path: Path, kwargs: dict[str, object], message: str
) -> None:
    base: dict[str, object] = {"num_attention_ranks": 1, "gate_on_attention": True}
    base.update(kwargs)
    with pytest.raises(ValueError) as err:
        afd_servers("/m", log_dir=tmp_path, options=EngineOptions(), **base)  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


QUANT_FIELDS = {"ffn_compute": "mega", "expert_quant": "w4a8", "expert_quant_group_size": 32}


def test_ffn_extra_reaches_the_ffn_role_mapping_only() -> None:
    common: dict[str, Any] = {
        "afd_port": 29555,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 2,
        "gate_on_attention": True,
        # Mega over two FFN ranks dispatches among them itself: an agreement field of both.
        "extra": {"timeout_s": 30.0, "expert_dispatch": "ffn"},
        "ffn_extra": QUANT_FIELDS,
    }
    ffn = afd_config("ffn", ffn_rank=1, **common)
    assert ffn == {
        "role": "ffn",
        "port": 29555,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 2,
        "ffn_rank": 1,
        "compute_gate_on_attention": True,
        "timeout_s": 30.0,
        "expert_dispatch": "ffn",
        **QUANT_FIELDS,
    }
    attention = afd_config("attention", **common)
    assert attention == {
        "role": "attention",
        "port": 29555,
        "num_attention_ranks": 1,
        "num_ffn_ranks": 2,
        "compute_gate_on_attention": True,
        "timeout_s": 30.0,
        "expert_dispatch": "ffn",
    }
    assert json.loads(afd_role_args("ffn", **common)[1])["afd"]["expert_quant"] == "w4a8"
    att_args = afd_role_args("attention", **common)
    assert not set(QUANT_FIELDS) & set(json.loads(att_args[1])["afd"])
    # Both are valid afd-core configs (the FFN-local fields are outside the agreement).
    from afd_core.config import AFDConfig

    f, a = AFDConfig.from_mapping(ffn), AFDConfig.from_mapping(attention)
    assert (f.ffn_compute, f.expert_quant, f.expert_quant_group_size) == ("mega", "w4a8", 32)
    assert (a.ffn_compute, a.expert_quant) == ("native", "none")
    assert f.agreement_hash() == a.agreement_hash()


@pytest.mark.parametrize("role", ["ffn", "attention"])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"ffn_extra": {"ffn_rank": 1}},
            "ffn_extra key 'ffn_rank' would override a core AFD field",
        ),
        ({"ffn_extra": {"role": "ffn"}}, "ffn_extra key 'role' would override a core AFD field"),
        ({"ffn_extra": {"port": 1}}, "ffn_extra key 'port' would override a core AFD field"),
        (
            {"ffn_extra": {"num_ffn_ranks": 2}},
            "ffn_extra key 'num_ffn_ranks' would override a core AFD field",
        ),
        (
            {"ffn_extra": {"compute_gate_on_attention": True}},
            "ffn_extra key 'compute_gate_on_attention' would override a core AFD field",
        ),
        (
            {"extra": {"expert_quant": "w8a8"}, "ffn_extra": {"expert_quant": "w4a8"}},
            "ffn_extra key 'expert_quant' is also an extra key",
        ),
    ],
)
def test_ffn_extra_cannot_override_core_fields(
    role: Any, kwargs: dict[str, Any], message: str
) -> None:
    base: dict[str, Any] = {"afd_port": 1234, "num_attention_ranks": 1, "gate_on_attention": False}
    for build in (afd_config, afd_role_args):
        with pytest.raises(ValueError) as err:
            build(role, **base, **kwargs)
        assert str(err.value) == message


def test_afd_servers_give_ffn_extra_and_ffn_env_to_the_ffn_servers_only(tmp_path: Path) -> None:
    opts = EngineOptions(env={"VLLM_CPU_KVCACHE_SPACE": "1", "SHARED": "engine"})
    att, ffns = afd_servers(
        "/m",
        log_dir=tmp_path,
        options=opts,
        num_attention_ranks=1,
        num_ffn_ranks=2,
        gate_on_attention=True,
        afd_extra={"timeout_s": 30.0},
        ffn_extra=QUANT_FIELDS,
        ffn_env={"AFD_REPORT_QUANT_ERROR": "1", "SHARED": "ffn"},
    )
    assert len(ffns) == 2
    for rank, ffn in enumerate(ffns):
        cfg = _afd(ffn)
        assert {k: cfg[k] for k in QUANT_FIELDS} == QUANT_FIELDS
        assert (cfg["ffn_rank"], cfg["timeout_s"]) == (rank, 30.0)
        assert dict(ffn.config.env) == {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "SHARED": "ffn",
            "AFD_REPORT_QUANT_ERROR": "1",
        }
    att_cfg = _afd(att)
    assert not set(QUANT_FIELDS) & set(att_cfg)
    assert att_cfg["timeout_s"] == 30.0
    assert dict(att.config.env) == {"VLLM_CPU_KVCACHE_SPACE": "1", "SHARED": "engine"}
    # Without them the servers are exactly as before.
    att, (ffn,) = afd_servers(
        "/m", log_dir=tmp_path, options=opts, num_attention_ranks=1, gate_on_attention=False
    )
    assert not set(QUANT_FIELDS) & set(_afd(ffn))
    assert dict(ffn.config.env) == dict(att.config.env) == dict(opts.env)


def test_afd_servers_run_the_ffn_under_a_prefix_on_its_own_http_host(tmp_path: Path) -> None:
    prefix = ("ip", "netns", "exec", "afd-test-ns")
    att, (ffn,) = afd_servers(
        "/m",
        log_dir=tmp_path,
        options=EngineOptions(),
        num_attention_ranks=1,
        gate_on_attention=False,
        ffn_argv_prefix=prefix,
        ffn_http_host="10.231.0.2",
    )
    assert ffn.config.argv[:4] == prefix
    assert ffn.config.argv[4:7] == (sys.executable, "-m", "afd_models.cli")
    argv = list(ffn.config.argv)
    assert argv[argv.index("--host") + 1] == "10.231.0.2"
    assert ffn.base_url == f"http://10.231.0.2:{ffn.config.port}"
    # The Attention server is untouched: no prefix, loopback HTTP.
    assert att.config.argv[0] == sys.executable
    att_argv = list(att.config.argv)
    assert att_argv[att_argv.index("--host") + 1] == "127.0.0.1"
    assert att.base_url == f"http://127.0.0.1:{att.config.port}"


def test_afd_servers_reject_core_ffn_extra_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ffn_extra key 'ffn_rank' would override"):
        afd_servers(
            "/m",
            log_dir=tmp_path,
            options=EngineOptions(),
            num_attention_ranks=1,
            gate_on_attention=False,
            ffn_extra={"ffn_rank": 0},
        )


def test_free_ports_are_distinct() -> None:
    ports = free_ports(16)
    assert len(ports) == 16 and len(set(ports)) == 16
    assert all(0 < p < 65536 for p in ports)
    with pytest.raises(ValueError, match="count=0"):
        free_ports(0)


def test_ffn_stats_are_read_per_rank_from_metrics() -> None:
    text = (
        MetricsText()
        .ffn(0, steps=10, calls=40, tokens=250, nbytes=51200, peers=2, layers=4)
        .ffn(1, steps=3, calls=6, tokens=9, nbytes=999, peers=1, layers=4)
        .param_bytes("ffn", 0, 5)
        .text()
    )
    stats = parse_ffn_stats(text)
    assert set(stats) == {0, 1}
    s0, s1 = stats[0], stats[1]
    assert (s0.rank, s0.steps, s0.compute_calls, s0.tokens, s0.bytes, s0.peers, s0.layers) == (
        0,
        10,
        40,
        250,
        51200,
        2,
        4,
    )
    assert (s0.tokens_per_step, s0.bytes_per_step, s0.calls_per_step) == (25.0, 5120.0, 4.0)
    assert (s1.tokens, s1.bytes, s1.tokens_per_step, s1.bytes_per_step) == (9, 999, 3.0, 333.0)
    # 6 calls over 4 layers: layers 0 and 1 computed twice.
    assert s1.layer_calls == ((0, 2), (1, 2), (2, 1), (3, 1))
    # Other processes' series (vLLM's own) are ignored; no AFD series: no rank.
    assert parse_ffn_stats('# TYPE vllm:x counter\nvllm:x_total{a="b"} 3.0\n') == {}


def test_ffn_stats_means_are_zero_before_the_first_step() -> None:
    text = MetricsText().ffn(0, steps=0, calls=0, tokens=0, nbytes=0, peers=1, layers=4).text()
    (s,) = parse_ffn_stats(text).values()
    assert (s.steps, s.compute_calls, s.layer_calls) == (0, 0, ())
    assert (s.tokens_per_step, s.bytes_per_step, s.calls_per_step, s.tokens_per_call) == (
        0.0,
        0.0,
        0.0,
        0.0,
    )


def test_attention_stats_are_read_from_metrics() -> None:
    from afd_models.demo.servers import parse_attention_stats

    metrics = MetricsText()
    for rank in (0, 1):
        m = metrics.role("attention", rank)
        m.connected()
        m.steps.inc(5)
        m.step_tokens.inc(20)
        m.sent.inc(1000 * (rank + 1))
        m.received.inc(500)
        for layer in (1, 2):
            m.ffn_wait(layer, 0.002)
    metrics.role("attention", 1).reconnects.inc()
    metrics.role("attention", 1).link_up.set(0)
    got = parse_attention_stats(metrics.text())
    assert [(a.rank, a.steps, a.tokens, a.sent_bytes, a.waits) for a in got.values()] == [
        (0, 5, 20, 1000, 2),
        (1, 5, 20, 2000, 2),
    ]
    assert [(a.link_up, a.reconnects) for a in got.values()] == [(True, 0), (False, 1)]
    assert got[0].mean_wait_s == pytest.approx(0.002)


def test_first_mismatch() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    assert first_mismatch([], [4]) == 0


def test_compare_parity_reports_each_prompt() -> None:
    base = [Completion("a", "", (1, 2, 3), 0.1), Completion("b", "", (4, 5, 6), 0.1)]
    cand = [Completion("a", "", (1, 2, 3), 0.1), Completion("b", "", (4, 9, 6), 0.1)]
    result = compare_parity(base, cand)
    assert not result.ok
    assert [p.mismatch_index for p in result.prompts] == [None, 1]
    assert [p.prompt for p in result.mismatches] == ["b"]
    assert "DIFF 'b' at token 1" in result.describe()
    assert compare_parity(base, base).ok
    with pytest.raises(ValueError, match="same prompts"):
        compare_parity(base, cand[::-1])


def test_parse_param_bytes_per_role_and_rank() -> None:
    text = (
        MetricsText()
        .param_bytes("attention", 1, 1001)
        .param_bytes("attention", 0, 1000)
        .param_bytes("ffn", 0, 52)
        .text()
    )
    assert parse_param_bytes(text) == {"attention": (1000, 1001), "ffn": (52,)}
    assert parse_param_bytes("") == {}
    assert afd_series_count(text) > 0 and afd_series_count("") == 0


def test_parse_quantized_reads_each_ffn_ranks_quant_metrics() -> None:
    from afd_models.demo.servers import QuantReport

    text = (
        MetricsText()
        .quantized(0, "layered", "w8a8", 0, 540672, 1048576, 4)
        .quantized(1, "mega", "w4a8_per_group", 32, 294912, 1048576, 4)
        .ffn(0, steps=1, calls=4, tokens=8, nbytes=1, peers=1, layers=4)
        .quantized(2, "mega", "w4a8_per_channel", 0, 0, 0, 4)
        .text()
    )
    got = parse_quantized(text)
    assert got == {
        0: QuantReport(0, "layered", "w8a8", 0, 540672, 1048576, 4),
        1: QuantReport(1, "mega", "w4a8_per_group", 32, 294912, 1048576, 4),
        2: QuantReport(2, "mega", "w4a8_per_channel", 0, 0, 0, 4),
    }
    assert got[0].ratio_vs_bf16 == 540672 / 1048576
    assert got[1].ratio_vs_bf16 == 0.28125
    assert got[2].ratio_vs_bf16 == 0.0
    assert parse_quantized(MetricsText().param_bytes("ffn", 0, 1).text()) == {}


def test_parse_quant_error_keeps_each_ranks_worst_layer() -> None:
    text = (
        MetricsText()
        .quant_error(0, 0, 9, 0.028)
        .quant_error(1, 1, 3, 0.31)
        .quant_error(1, 2, 1, 0.05)
        .text()
    )
    assert parse_quant_error(text) == {0: (0, 9, 2.8e-2), 1: (1, 3, 3.1e-1)}
    assert parse_quant_error(MetricsText().quant_error(0, 0, 2, 0.0).text()) == {0: (0, 2, 0.0)}
    quant_only = MetricsText().quantized(0, "layered", "w8a8", 0, 1, 2, 4).text()
    assert parse_quant_error(quant_only) == {}


def test_parse_layer_signatures_per_rank_and_layer() -> None:
    metrics = MetricsText()
    metrics.role("ffn", 0).signature(0, "mega", "0f" * 32)
    metrics.role("ffn", 0).signature(1, "mega", "3c" * 32)
    metrics.role("ffn", 1).signature(0, "mega", "2d" * 32)
    assert parse_layer_signatures(metrics.text()) == {
        0: {0: "0f" * 32, 1: "3c" * 32},
        1: {0: "2d" * 32},
    }
    assert parse_layer_signatures(MetricsText().param_bytes("ffn", 0, 1).text()) == {}


@pytest.mark.timeout(60)
def test_metrics_text_reads_slash_metrics_and_servers_get_no_inherited_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale PROMETHEUS_MULTIPROC_DIR of the caller never reaches a server (the fake server
    reports the length of the value it got as afd_param_bytes)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "stale"))
    with _fake_server(tmp_path) as server:
        text = server.metrics_text()
        assert parse_param_bytes(text) == {"ffn": (0,)}
    with pytest.raises(MetricsUnavailableError, match=r"fake.*/metrics did not answer"):
        server.metrics_text(timeout_s=2)


@pytest.mark.timeout(60)
def test_crashing_server_is_reported_at_once_with_code_and_log(tmp_path: Path) -> None:
    server = VLLMServer(
        _config(tmp_path, "import sys; print('fatal: bad flag', flush=True); sys.exit(7)")
    )
    server.start()
    t0 = time.monotonic()
    with pytest.raises(ServerExitedError) as err:
        wait_until_healthy([server], poll_interval_s=0.1)
    assert time.monotonic() - t0 < 30  # far below the 60 s startup timeout
    assert err.value.exit_code == 7
    assert "fatal: bad flag" in err.value.log_tail
    assert "'fake' exited with code 7" in str(err.value)
    assert server.stop().exit_code == 7


@pytest.mark.timeout(60)
def test_context_manager_surfaces_crash(tmp_path: Path) -> None:
    with (
        pytest.raises(ServerExitedError, match="code 3"),
        VLLMServer(_config(tmp_path, "raise SystemExit(3)")),
    ):
        pass


@pytest.mark.timeout(60)
def test_startup_timeout_then_sigterm_stop(tmp_path: Path) -> None:
    server = VLLMServer(_config(tmp_path, "import time; time.sleep(120)", timeout_s=1.0))
    server.start()
    with pytest.raises(ServerStartTimeoutError, match="not healthy after 1s"):
        wait_until_healthy([server], poll_interval_s=0.1)
    result = server.stop(timeout_s=20)
    assert result.exit_code == -signal.SIGTERM
    assert result.forced is False
    assert server.stop() is result


@pytest.mark.timeout(60)
def test_stop_escalates_to_sigkill_and_reaps_the_session(tmp_path: Path) -> None:
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'])\n"
        "print('child', child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    server = VLLMServer(_config(tmp_path, code))
    server.start()
    deadline = time.monotonic() + 30
    while "child" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    child_pid = int(server.log_text().split()[1])
    result = server.stop(timeout_s=1)
    assert result.forced is True
    assert result.exit_code == -signal.SIGKILL
    time.sleep(0.2)
    assert not psutil.pid_exists(child_pid) or (
        psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    )


@pytest.mark.timeout(60)
def test_client_against_openai_shaped_server(tmp_path: Path) -> None:
    with _fake_server(tmp_path) as server:
        batch = complete_many(server.base_url, ["ab", "abcd", "x"], max_tokens=3, concurrency=2)
        assert [c.prompt for c in batch.completions] == ["ab", "abcd", "x"]
        assert [c.token_ids for c in batch.completions] == [(2, 3, 4), (4, 5, 6), (1, 2, 3)]
        assert batch.completions[1].text == "ABCD"
        assert batch.generated_tokens == 9
        with pytest.raises(CompletionError, match="no token_ids"):
            complete(server.base_url, "no-ids", model="fake-model")
        with pytest.raises(ValueError, match="max_tokens=0"):
            complete(server.base_url, "x", model="fake-model", max_tokens=0)
        assert process_tree_rss(server.pid or 0) > 0
    assert server.stop_result is not None
    assert server.stop_result.forced is False


def test_process_tree_rss_of_missing_process_is_zero() -> None:
    assert process_tree_rss(2**22 + 12345) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": ""}, "name"),
        ({"argv": ()}, "argv"),
        ({"port": 0}, "port"),
        ({"startup_timeout_s": 0}, "startup_timeout_s"),
    ],
)
def test_server_config_validation(tmp_path: Path, kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {
        "name": "x",
        "argv": ("true",),
        "port": 8000,
        "log_path": tmp_path / "x.log",
    }
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        ServerConfig(**base)  # type: ignore[arg-type]


def test_parity_options_serialize_batch_variant_models_only(tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    qw = tmp_path / "qw"
    for path, model_type in ((ds, "deepseek_v2"), (qw, "qwen3_moe")):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    opts = EngineOptions()
    assert parity_options(ds, opts).max_num_seqs == 1
    assert "--max-num-seqs" in parity_options(ds, opts).args()
    assert parity_options(qw, opts) == opts
    assert parity_options(tmp_path / "missing", opts) == opts
    assert parity_options(ds, EngineOptions(max_num_seqs=4)).max_num_seqs == 4


def test_parity_options_pick_the_reference_cpu_mla_backend_on_vllm_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AMX MLA (vLLM's choice on CPUs with AMX tiles) rejects float32 weights."""
    from afd_models.demo import servers

    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    opts = EngineOptions()
    monkeypatch.setattr(servers, "_vllm_cpu_build", lambda: True)
    args = parity_options(ds, opts).args()
    assert args[args.index("--attention-backend") + 1] == "CPU_MLA"
    mine = EngineOptions(extra_args=("--attention-backend", "TRITON_MLA"))
    assert parity_options(ds, mine).extra_args == ("--attention-backend", "TRITON_MLA")
    monkeypatch.setattr(servers, "_vllm_cpu_build", lambda: False)
    assert "--attention-backend" not in parity_options(ds, opts).args()


def test_sample_total_sums_a_counter_over_its_label_sets() -> None:
    text = (
        "# HELP vllm:prompt_tokens Prompt tokens.\n"
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 11.0\n'
        'vllm:prompt_tokens_total{engine="1",model_name="m"} 4.0\n'
        'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9\n'
        "# HELP vllm:prompt_tokens_cached Cached prompt tokens.\n"
        "# TYPE vllm:prompt_tokens_cached counter\n"
        'vllm:prompt_tokens_cached_total{engine="0"} 100.0\n'
    )
    assert sample_total(text, "vllm:prompt_tokens_total") == 15.0
    assert sample_total(text, "vllm:generation_tokens_total") == 0.0
