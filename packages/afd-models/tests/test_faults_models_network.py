"""Faults E2E: the two roles on a real network, gated by the deployment secret.

The FFN role runs in a network namespace of its own, joined to the root namespace (where the
Attention role runs) by a veth pair: 10.231.0.1/24 (root end, the AFD ``host``: the store gate
and the Attention role's gloo listener) and 10.231.0.2/24 (namespace end: the FFN role's gloo
listener and its HTTP server). The host is not loopback, so both roles get ``AFD_SECRET``. The
greedy tokens of the tiny Qwen3-MoE must equal plain vLLM's.

The test skips with the reason where namespaces (``ip netns add``) are not allowed (listed in
CONTRIBUTING); the namespace and the veth pair are removed in a finalizer even on failure. Only
the addresses above, on interfaces this module creates, are used. (Delays between the roles are
covered by the two-stage parity case's injected delays; ``tc netem`` is not available on the CI
hosts, so no case here depends on it.)
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import BatchResult, complete_many
from afd_models.demo.parity import compare_parity
from afd_models.demo.servers import (
    EngineOptions,
    afd_servers,
    parity_options,
    plain_server,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

MAX_TOKENS = 16
OPTIONS = EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512)
ROOT_ADDR = "10.231.0.1"
NS_ADDR = "10.231.0.2"
SECRET = "afd-network-e2e-deployment-secret"


@dataclass(frozen=True)
class Net:
    namespace: str
    root_if: str
    ns_if: str


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


def _must(*argv: str) -> None:
    done = _run(*argv)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


@contextmanager
def veth_namespace() -> Iterator[Net]:
    """A namespace holding one end of a veth pair (the other in the root namespace), both up
    with :data:`ROOT_ADDR` / :data:`NS_ADDR`; removed on exit, whatever happened."""
    tag = str(os.getpid() % 100000)
    net = Net(f"afd-e2e-{tag}", f"afdr{tag}", f"afdn{tag}")
    if ROOT_ADDR in _run("ip", "-o", "addr", "show").stdout:
        pytest.fail(f"{ROOT_ADDR} is already configured on this machine (a stale run?)")
    added = _run("ip", "netns", "add", net.namespace)
    if added.returncode != 0:
        pytest.skip(
            f"network namespaces are not allowed here: `ip netns add` said {added.stderr!r}"
        )
    try:
        _must("ip", "link", "add", net.root_if, "type", "veth", "peer", "name", net.ns_if)
        _must("ip", "link", "set", net.ns_if, "netns", net.namespace)
        _must("ip", "addr", "add", f"{ROOT_ADDR}/24", "dev", net.root_if)
        _must("ip", "link", "set", net.root_if, "up")
        _must("ip", "-n", net.namespace, "addr", "add", f"{NS_ADDR}/24", "dev", net.ns_if)
        _must("ip", "-n", net.namespace, "link", "set", net.ns_if, "up")
        _must("ip", "-n", net.namespace, "link", "set", "lo", "up")  # vLLM's own local sockets
        yield net
    finally:
        _run("ip", "link", "del", net.root_if)  # removes both ends
        _run("ip", "netns", "del", net.namespace)


def _log_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    env = os.environ.get("AFD_E2E_LOG_DIR")
    return Path(env) if env else tmp_path_factory.getbasetemp() / "engine-logs"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    return ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root)


_BASELINE: list[BatchResult] = []


def _baseline(checkpoint: Path, log_dir: Path) -> BatchResult:
    """Plain vLLM's outputs (its engine runs once per module, never beside an AFD pair)."""
    if not _BASELINE:
        server = plain_server(
            checkpoint,
            log_dir=log_dir,
            options=parity_options(checkpoint, OPTIONS),
            name="net-plain-qwen3_moe",
            progress=print,
        )
        server.start()
        try:
            wait_until_healthy([server])
            _BASELINE.append(
                complete_many(server.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3)
            )
        finally:
            server.stop()
    return _BASELINE[0]


@pytest.mark.timeout(1800)
def test_roles_in_two_namespaces_give_plain_vllm_tokens(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log_dir = _log_root(tmp_path_factory)
    with veth_namespace() as net:
        expected = _baseline(checkpoint, log_dir)
        base = parity_options(checkpoint, OPTIONS)
        options = dataclasses.replace(base, env={**base.env, "AFD_SECRET": SECRET})
        attention, (ffn,) = afd_servers(
            checkpoint,
            log_dir=log_dir,
            options=options,
            num_attention_ranks=1,
            gate_on_attention=False,
            afd_extra={"host": ROOT_ADDR},
            ffn_argv_prefix=("ip", "netns", "exec", net.namespace),
            ffn_http_host=NS_ADDR,
            prefix="net-veth",
            progress=print,
        )
        afd_port = _afd_port(attention.config.argv)
        ffn.start()
        attention.start()
        try:
            wait_until_healthy([ffn, attention])
            actual = complete_many(
                attention.base_url, DEMO_PROMPTS, max_tokens=MAX_TOKENS, concurrency=3
            )
            # The roles talk over the veth pair: the FFN's connections in its namespace go
            # from NS_ADDR to ROOT_ADDR, and the store gate listens on ROOT_ADDR only.
            peers = _run("ip", "netns", "exec", net.namespace, "ss", "-tnH", "state", "established")
            pairs = [line.split()[-2:] for line in peers.stdout.splitlines() if line.strip()]
            assert any(
                local.startswith(f"{NS_ADDR}:") and remote.startswith(f"{ROOT_ADDR}:")
                for local, remote in pairs
            ), peers.stdout
            listeners = _run("ss", "-ltnH", f"sport = :{afd_port}").stdout.split()
            assert f"{ROOT_ADDR}:{afd_port}" in listeners, listeners
            assert f"*:{afd_port}" not in listeners and f"0.0.0.0:{afd_port}" not in listeners
        finally:
            print(stop_all([attention, ffn]))
    parity = compare_parity(expected.completions, actual.completions)
    assert all(len(c.token_ids) == MAX_TOKENS for c in expected.completions)
    assert parity.ok, parity.describe()


def _afd_port(argv: tuple[str, ...]) -> int:
    import json

    config = json.loads(argv[list(argv).index("--additional-config") + 1])
    return int(config["afd"]["port"])


#: A role refused for a missing secret must exit within this many seconds of its start.
REFUSAL_BOUND_S = 300.0


@pytest.mark.timeout(900)
def test_non_loopback_host_without_secret_is_refused_at_startup(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An Attention role configured with a host that is not loopback but no ``AFD_SECRET``
    exits non-zero naming the variable, before it opens the store (no address is contacted:
    the name is refused before it is resolved)."""
    import time

    base = parity_options(checkpoint, OPTIONS)
    env = {k: v for k, v in base.env.items() if k != "AFD_SECRET"}
    attention, _ = afd_servers(
        checkpoint,
        log_dir=_log_root(tmp_path_factory),
        options=dataclasses.replace(base, env=env),
        num_attention_ranks=1,
        gate_on_attention=False,
        afd_extra={"host": "afd-store.invalid"},
        prefix="net-nosecret",
        progress=print,
    )
    saved = os.environ.pop("AFD_SECRET", None)
    try:
        attention.start()
    finally:
        if saved is not None:
            os.environ["AFD_SECRET"] = saved
    started = time.monotonic()
    try:
        while attention.poll() is None and time.monotonic() - started < REFUSAL_BOUND_S:
            time.sleep(1.0)
        code = attention.poll()
        elapsed = time.monotonic() - started
    finally:
        print(attention.stop())
    log = attention.log_text()
    assert code is not None and code != 0, (code, attention.log_tail())
    assert "AFD_SECRET" in log and "afd-store.invalid" in log, attention.log_tail()
    assert "not a loopback address" in log
    print(f"refused after {elapsed:.1f}s")
