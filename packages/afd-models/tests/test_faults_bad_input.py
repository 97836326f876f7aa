"""Faults: bad input to an AFD role is a clear error or a clean HTTP 400, never a hang, and never
takes a healthy peer down.

Startup refusals (one ``afd serve`` process each, no peer): malformed ``--additional-config``
JSON, an unknown key, a misspelt role and wrong types exit with status 2 before vLLM starts
(``afd serve``'s check, :func:`afd_models.vllm_cli.check_serve_args`); ``num_attention_ranks``
disagreeing with ``--data-parallel-size`` exits with status 2 before any engine starts
(``afd_runtime.patches.check_role_parallelism``, when vLLM builds its config); an AFD ``port`` another process listens on
fails the Attention role's startup naming ``port`` and the value. Each case asserts the exit
status, the message naming the field, a time bound, and that the process left nothing behind.

Requests to a running 1:1 pair (one pair for the module): a prompt longer than
``--max-model-len`` (as text and as token ids), an empty prompt and an empty token list each get
HTTP 400 with vLLM's message naming the problem, answered by the Attention role's API server
before any engine step (so the FFN role never sees them); after each, the next normal request returns exactly
the tokens it returned before any bad input, and both roles are still up and healthy.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

import requests
from afd_models.demo.client import Completion, complete, served_model_id
from afd_models.demo.servers import (
    DEFAULT_ENGINE_ENV,
    EngineOptions,
    ServerConfig,
    VLLMServer,
    afd_role_args,
    afd_servers,
    free_ports,
    stop_all,
    vllm_serve_command,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_MODEL_LEN: Final[int] = 512
OPTIONS: Final[EngineOptions] = EngineOptions(
    dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN
)
#: ``afd serve`` refuses bad AFD config before importing vLLM (measured 11-19 s on the loaded
#: 2-core host, most of it importing torch).
CLI_REFUSAL_S: Final[float] = 120.0
#: vLLM parses its arguments and builds its config, then the AFD patch refuses (no engine;
#: measured 51-80 s on the loaded host).
CONFIG_REFUSAL_S: Final[float] = 300.0
#: The Attention engine starts (model load) before its connector binds the AFD port (measured
#: 92-194 s on the loaded host); below :data:`PORT_TEST_STARTUP_TIMEOUT_S`, so a refusal within
#: it cannot be the startup timeout expiring.
ENGINE_REFUSAL_S: Final[float] = 600.0
PORT_TEST_STARTUP_TIMEOUT_S: Final[float] = 1800.0
#: A bad request must be answered (not hang) well within this.
HTTP_ANSWER_S: Final[float] = 30.0
GOOD_PROMPT: Final[str] = DEMO_PROMPTS[0]
GOOD_MAX_TOKENS: Final[int] = 8


def _log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("AFD_E2E_LOG_DIR")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "engine-logs"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    return ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root)


@dataclass(frozen=True)
class Refusal:
    """How a server that must refuse to start ended."""

    exit_code: int
    elapsed_s: float
    log: str


def run_until_exit(name: str, argv: list[str], port: int, log_dir: Path, bound_s: float) -> Refusal:
    """Start one server that must exit on its own within ``bound_s``; a server still running
    then is a hang (the test fails after killing it). Every process of its session must be gone
    when it has exited (no orphan left to the harness's SIGKILL)."""
    server = VLLMServer(
        ServerConfig(
            name=name,
            argv=tuple(argv),
            port=port,
            log_path=log_dir / f"{name}.log",
            env=dict(DEFAULT_ENGINE_ENV),
            startup_timeout_s=bound_s,
        ),
        progress=print,
    )
    server.start()
    try:
        while server.poll() is None and server.elapsed_s() < bound_s:
            time.sleep(0.5)
        elapsed = server.elapsed_s()
        code = server.poll()
    finally:
        stopped = server.stop(timeout_s=30.0)
    log = server.log_text()
    assert code is not None, f"{name} still running after {bound_s:.0f}s (hang):\n{log[-3000:]}"
    assert not stopped.forced, f"{name} exited {code} but left processes behind: {stopped}"
    return Refusal(code, elapsed, log)


def _serve_argv(model: Path, port: int, extra: list[str]) -> list[str]:
    return vllm_serve_command(
        model, port, extra_args=[*OPTIONS.args(), *extra], max_model_len=MAX_MODEL_LEN
    )


# ------------------------------------------------------------------------------------------
# Startup refusals


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("case", "text", "message"),
    [
        (
            "malformed_json",
            '{"afd": {"role": "ffn", "port": 29700',
            "invalid AFD config field '--additional-config': got "
            '\'{"afd": {"role": "ffn", "port": 29700\'',
        ),
        (
            "unknown_key",
            '{"afd": {"role": "ffn", "prot": 29700}}',
            "invalid AFD config field 'prot': got 29700; allowed: known keys",
        ),
        (
            "misspelt_role",
            '{"afd": {"role": "atention", "port": 29700}}',
            "invalid AFD config field 'role': got 'atention'",
        ),
        (
            "port_wrong_type",
            '{"afd": {"role": "ffn", "port": [29700]}}',
            "invalid AFD config field 'port': got [29700]; allowed: an integer",
        ),
        (
            "ranks_wrong_type",
            '{"afd": {"role": "attention", "num_attention_ranks": 1.5}}',
            "invalid AFD config field 'num_attention_ranks': got 1.5; allowed: an integer",
        ),
    ],
)
def test_bad_additional_config_exits_2_before_vllm(
    model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    case: str,
    text: str,
    message: str,
) -> None:
    (port,) = free_ports(1)
    argv = _serve_argv(model, port, ["--additional-config", text])
    out = run_until_exit(f"bad-input-{case}", argv, port, _log_dir(tmp_path_factory), CLI_REFUSAL_S)
    assert out.exit_code == 2, out.log[-3000:]
    assert out.elapsed_s < CLI_REFUSAL_S
    assert f"afd serve: error: {message}" in out.log, out.log[-3000:]
    assert "Traceback" not in out.log and "non-default args" not in out.log  # vLLM never ran
    if case == "malformed_json":
        assert "line 1 column 38 (char 37)" in out.log
    print(f"{case}: exit {out.exit_code} after {out.elapsed_s:.1f}s")


@pytest.mark.timeout(600)
def test_attention_ranks_disagreeing_with_data_parallel_size_exits(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``num_attention_ranks: 2`` without ``--data-parallel-size 2``: refused at config time
    (before, this role waited for ranks that never came until vLLM's 600 s timeout)."""
    afd_port, port = free_ports(2)
    role = afd_role_args(
        "attention", afd_port=afd_port, num_attention_ranks=2, gate_on_attention=False
    )
    assert "--data-parallel-size" in role
    role = role[: role.index("--data-parallel-size")]  # drop it: the mismatch under test
    out = run_until_exit(
        "bad-input-dp-mismatch",
        _serve_argv(model, port, role),
        port,
        _log_dir(tmp_path_factory),
        CONFIG_REFUSAL_S,
    )
    # The patch's AFDConfigError reaches `afd serve` (vLLM builds its config in the API server
    # process): a usage error, no traceback.
    assert out.exit_code == 2, out.log[-3000:]
    assert out.elapsed_s < CONFIG_REFUSAL_S
    assert "Traceback" not in out.log
    assert (
        "afd serve: error: invalid AFD config field 'num_attention_ranks': got 2; allowed: the Attention "
        "server's --data-parallel-size (1)" in out.log
    ), out.log[-3000:]
    assert "EngineCore" not in out.log  # refused before any engine process started
    print(f"dp mismatch: exit {out.exit_code} after {out.elapsed_s:.1f}s")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--pipeline-parallel-size", "2"),
            "afd serve: error: invalid AFD config field '--pipeline-parallel-size': got 2; "
            "allowed: 1 (scale the Attention role",
        ),
        (
            ("--tensor-parallel-size", "2"),
            "afd serve: error: invalid AFD config field 'attention_tp_size': got 1; allowed: "
            "the Attention server's --tensor-parallel-size (2)",
        ),
    ],
    ids=["pipeline_parallel", "tp_without_attention_tp_size"],
)
def test_parallelism_the_config_does_not_describe_exits(
    model: Path, tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, str], message: str
) -> None:
    """Pipeline parallelism, or a --tensor-parallel-size the AFD config does not announce
    (``attention_tp_size``; the FFN ranks would wait for peers that never come): refused with
    the field, the value and what is allowed, before any engine process starts."""
    afd_port, port = free_ports(2)
    role = afd_role_args(
        "attention", afd_port=afd_port, num_attention_ranks=1, gate_on_attention=False
    )
    out = run_until_exit(
        f"bad-input-{flags[0].strip('-')}",
        _serve_argv(model, port, [*role, *flags]),
        port,
        _log_dir(tmp_path_factory),
        CONFIG_REFUSAL_S,
    )
    assert out.exit_code == 2, out.log[-3000:]
    assert "Traceback" not in out.log
    assert message in out.log, out.log[-3000:]
    assert "EngineCore" not in out.log  # refused before any engine process started


@pytest.mark.timeout(900)
def test_afd_port_in_use_fails_attention_naming_port(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Another process listens on the AFD port: the Attention role (whose first rank serves
    the rendezvous store there) exits non-zero naming ``port`` and the value, without waiting
    for its startup timeout, and the other process's socket is untouched."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        afd_port = squatter.getsockname()[1]
        (port,) = free_ports(1)
        role = afd_role_args(
            "attention",
            afd_port=afd_port,
            num_attention_ranks=1,
            gate_on_attention=False,
            # The startup timeout would be the bound of a wait: the refusal must come first.
            extra={"startup_timeout_s": PORT_TEST_STARTUP_TIMEOUT_S},
        )
        out = run_until_exit(
            "bad-input-port-in-use",
            _serve_argv(model, port, role),
            port,
            _log_dir(tmp_path_factory),
            ENGINE_REFUSAL_S,
        )
        assert squatter.getsockname()[1] == afd_port and squatter.fileno() >= 0
    assert out.exit_code == 1, out.log[-3000:]
    assert out.elapsed_s < ENGINE_REFUSAL_S
    expected = f"invalid AFD config field 'port': got {afd_port}; allowed: a TCP port free on"
    assert expected in out.log, out.log[-3000:]
    assert f"127.0.0.1:{afd_port} is already in use by another process" in out.log
    print(f"port in use: exit {out.exit_code} after {out.elapsed_s:.1f}s")


# ------------------------------------------------------------------------------------------
# Bad requests to a running pair


@dataclass(frozen=True)
class Pair:
    attention: VLLMServer
    ffn: VLLMServer
    model_id: str
    reference: Completion

    @property
    def afd_port(self) -> int:
        """The AFD port in the Attention server's ``--additional-config``."""
        argv = list(self.attention.config.argv)
        text = argv[argv.index("--additional-config") + 1]
        return int(json.loads(text)["afd"]["port"])


@pytest.fixture(scope="module")
def pair(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    attention, (ffn,) = afd_servers(
        model,
        log_dir=_log_dir(tmp_path_factory),
        options=OPTIONS,
        num_attention_ranks=1,
        gate_on_attention=False,
        prefix="bad-input-pair",
        progress=print,
    )
    ffn.start()
    attention.start()
    try:
        wait_until_healthy([ffn, attention])
        model_id = served_model_id(attention.base_url)
        reference = complete(
            attention.base_url, GOOD_PROMPT, model=model_id, max_tokens=GOOD_MAX_TOKENS
        )
        assert len(reference.token_ids) == GOOD_MAX_TOKENS
        yield Pair(attention, ffn, model_id, reference)
    finally:
        print(stop_all([attention, ffn]))


def _post_completion(pair: Pair, payload: dict[str, Any]) -> tuple[requests.Response, float]:
    began = time.monotonic()
    resp = requests.post(
        f"{pair.attention.base_url}/v1/completions",
        json={"model": pair.model_id, "temperature": 0.0, **payload},
        timeout=HTTP_ANSWER_S,
    )
    return resp, time.monotonic() - began


def _assert_pair_serves(pair: Pair) -> None:
    """Both roles up and healthy, and the reference request gives its reference tokens."""
    pair.attention.check_alive()
    pair.ffn.check_alive()
    assert pair.attention.healthy() and pair.ffn.healthy()
    again = complete(
        pair.attention.base_url, GOOD_PROMPT, model=pair.model_id, max_tokens=GOOD_MAX_TOKENS
    )
    assert again.token_ids == pair.reference.token_ids


LONG_PROMPT: Final[str] = " ".join(["mixture"] * (MAX_MODEL_LEN * 2))


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("case", "payload", "message"),
    [
        (
            "prompt_longer_than_max_model_len",
            {"prompt": LONG_PROMPT, "max_tokens": 4},
            f"maximum context length is {MAX_MODEL_LEN} tokens",
        ),
        (
            "prompt_tokens_longer_than_max_model_len",
            {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 4},
            f"maximum context length is {MAX_MODEL_LEN} tokens",
        ),
        (
            "empty_prompt",
            {"prompt": "", "max_tokens": 4},
            "Either prompt or prompt_embeds must be provided and non-empty",
        ),
        ("empty_token_list", {"prompt": [], "max_tokens": 4}, "You must pass at least one prompt"),
    ],
)
def test_bad_request_is_http_400_and_the_pair_keeps_serving(
    pair: Pair, case: str, payload: dict[str, Any], message: str
) -> None:
    resp, elapsed = _post_completion(pair, payload)
    print(f"{case}: HTTP {resp.status_code} after {elapsed:.2f}s: {resp.text[:400]}")
    assert resp.status_code == 400, resp.text[:1000]
    assert elapsed < HTTP_ANSWER_S
    error = resp.json()["error"]
    assert message in error["message"], error
    _assert_pair_serves(pair)


@pytest.mark.timeout(1200)
def test_bad_roles_started_beside_a_running_pair_do_not_disturb_it(
    pair: Pair, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A second FFN role with malformed config, a well-formed second FFN role for the rank the
    pair serves, then a second Attention role on the running pair's AFD port (held by the
    pair's own rendezvous store): each is refused (exit 2 naming ``--additional-config``; exit 1
    naming ``ffn_rank``; exit 1 naming ``port``) and the pair keeps serving."""
    log_dir = _log_dir(tmp_path_factory)
    (port,) = free_ports(1)
    text = '{"afd": {"role": "ffn", "port": ' + str(pair.afd_port)  # unterminated JSON
    ffn = run_until_exit(
        "bad-input-second-ffn",
        _serve_argv(model, port, ["--additional-config", text]),
        port,
        log_dir,
        CLI_REFUSAL_S,
    )
    assert ffn.exit_code == 2, ffn.log[-3000:]
    assert "afd serve: error: invalid AFD config field '--additional-config'" in ffn.log
    _assert_pair_serves(pair)

    # A well-formed second FFN server for the FFN rank the pair serves (issue #31 item 6): it
    # loads, reaches the store, finds the rank's claim held by a live heartbeat and exits 1
    # naming ffn_rank; the pair's round is untouched.
    (port,) = free_ports(1)
    role = afd_role_args(
        "ffn", afd_port=pair.afd_port, num_attention_ranks=1, gate_on_attention=False
    )
    stray = run_until_exit(
        "bad-input-stray-ffn", _serve_argv(model, port, role), port, log_dir, ENGINE_REFUSAL_S
    )
    assert stray.exit_code == 1, stray.log[-3000:]
    assert "AFDRankServedError" in stray.log, stray.log[-3000:]
    assert "invalid AFD config field 'ffn_rank': got 0" in stray.log
    assert "world rank 1 (ffn 0) is served by another live process" in stray.log
    _assert_pair_serves(pair)

    (port,) = free_ports(1)
    role = afd_role_args(
        "attention", afd_port=pair.afd_port, num_attention_ranks=1, gate_on_attention=False
    )
    attention = run_until_exit(
        "bad-input-second-attention",
        _serve_argv(model, port, role),
        port,
        log_dir,
        ENGINE_REFUSAL_S,
    )
    assert attention.exit_code == 1, attention.log[-3000:]
    assert f"invalid AFD config field 'port': got {pair.afd_port}" in attention.log
    assert attention.elapsed_s < ENGINE_REFUSAL_S
    print(
        f"beside a running pair: second FFN exit {ffn.exit_code} after {ffn.elapsed_s:.1f}s, "
        f"stray FFN exit {stray.exit_code} after {stray.elapsed_s:.1f}s, "
        f"second Attention exit {attention.exit_code} after {attention.elapsed_s:.1f}s"
    )
    _assert_pair_serves(pair)
