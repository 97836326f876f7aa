"""Faults (issue #18, items 1 and 3): SIGTERM in every state, an FFN failing during its startup.

Item 1. SIGTERM to either role while it waits for its peer (an Attention role with no FFN, an FFN
role with no Attention, an FFN whose Attention left), while idle (Attention first) and while
serving (FFN first): exit 0 within :data:`STOP_BOUND_S`, no SIGKILL needed, no process of the
server's session left, none of the ``/dev/shm`` segments its processes had open left behind, and
nothing listening on its HTTP port or the AFD port.

Item 3. An FFN role whose checkpoint cannot be loaded (weights file corrupt, config readable)
or whose load raises (``AFD_INJECT_FAULT=ffn_load``): the Attention role exits non-zero with the
FFN's message (world rank 1, stage ``load``) within its ``startup_timeout_s`` (short here).

Issue #31 item 6. An FFN whose service dies of a fatal error while serving
(``AFD_INJECT_FAULT=ffn_compute``), with ``ffn_loss_grace_s: 0`` (no hold): the request fails with
HTTP 500 carrying the FFN's error, the Attention role stays up, and the FFN server exits non-zero (not a healthy-looking process that
serves nothing).

Engine starts are few: every case shares servers where it can.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")
pytest.importorskip("psutil")

import psutil
from afd_models.demo.client import complete_many, served_model_id
from afd_models.demo.servers import (
    EngineOptions,
    ServerExitedError,
    StopResult,
    VLLMServer,
    afd_servers,
    free_port,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

#: The issue's bound: SIGTERM to exit (the whole process session gone).
STOP_BOUND_S = 30.0
#: The second Attention deployment's ``ffn_loss_grace_s``: its requests held when the FFN
#: leaves fail after this long instead of AFD's default 60 s.
LOSS_GRACE_S = 2.0
#: How long an engine may take to start here (2 shared cores: 30-90 s, slower under load).
ENGINE_START_S = 300.0
#: Short startup timeout of the item-3 deployments ("within the startup timeout").
FAILING_STARTUP_TIMEOUT_S = 120.0
OPTIONS = EngineOptions(
    dtype="float32", enforce_eager=True, max_model_len=512, startup_timeout_s=ENGINE_START_S
)
#: Logged (for humans) by an AFD worker once its model is loaded (an Attention role then waits
#: for the FFN); a lifecycle point before the API server serves /metrics, so it is read in the log.
LOADED = "AFD role={role} param_bytes="
#: Logged by an AFD worker once its connector waits for the peer role (signals cancel the wait).
WAITING = "waiting for its peers (SIGTERM/SIGINT cancel the wait)"


def _root(tmp_path_factory: pytest.TempPathFactory, env: str, name: str) -> Path:
    value = os.environ.get(env)
    return Path(value) if value else tmp_path_factory.getbasetemp() / name


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(
        TinySpec("qwen3_moe"), _root(tmp_path_factory, "AFD_TINY_CACHE", "tiny")
    )


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _root(tmp_path_factory, "AFD_E2E_LOG_DIR", "engine-logs")


@pytest.fixture
def cleanup() -> Iterator[list[VLLMServer]]:
    """Servers a test started; whatever it did not stop is stopped (and killed) at the end."""
    started: list[VLLMServer] = []
    yield started
    stop_all(started, timeout_s=10.0)


# ------------------------------------------------------------------------------------ helpers


def _afd(server: VLLMServer) -> dict[str, Any]:
    argv = list(server.config.argv)
    afd: dict[str, Any] = json.loads(argv[argv.index("--additional-config") + 1])["afd"]
    return afd


def afd_port(server: VLLMServer) -> int:
    """The AFD ``port`` of a role server (from its ``--additional-config``)."""
    return int(_afd(server)["port"])


def owned_ports(server: VLLMServer) -> tuple[int, ...]:
    """The ports ``server`` listens on: its HTTP port and, for the Attention role (world rank 0
    serves the rendezvous store), the AFD port. An FFN role only connects to the AFD port, which
    stays open while its Attention role runs."""
    if _afd(server)["role"] == "attention":
        return (server.config.port, afd_port(server))
    return (server.config.port,)


def _session_shm(server: VLLMServer) -> set[str]:
    """``/dev/shm`` files the server's processes have mapped or open now."""
    paths: set[str] = set()
    for pid in server._session_members():
        try:
            proc = psutil.Process(pid)
            paths.update(m.path for m in proc.memory_maps(grouped=True))
            paths.update(f.path for f in proc.open_files())
        except (psutil.Error, OSError):
            continue
    return {p.split(" (deleted)")[0] for p in paths if p.startswith("/dev/shm/")}


def _listening(port: int) -> bool:
    return any(
        c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        for c in psutil.net_connections(kind="tcp")
    )


class Snapshot:
    """What a running server holds: its session's /dev/shm segments and its ports."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.shm = _session_shm(server)
        self.ports = owned_ports(server)


def assert_stopped_cleanly(
    result: StopResult, snap: Snapshot, bound_s: float = STOP_BOUND_S
) -> None:
    """Exit 0 within ``bound_s`` without SIGKILL, no process, segment or listener left."""
    server = snap.server
    print(result)
    assert result.exit_code == 0, (result, server.log_tail(30))
    assert not result.forced, (result, server.log_tail(30))
    assert result.elapsed_s <= bound_s, result
    assert server._session_members() == [], server._session_describe()
    leaked = sorted(p for p in snap.shm if os.path.exists(p))
    assert not leaked, f"{server.name} left {leaked}"
    for port in snap.ports:
        assert not _listening(port), f"{server.name}: something still listens on {port}"


def wait_for(
    predicate: Callable[[], bool], what: str, timeout_s: float, *servers: VLLMServer
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for s in servers:
            s.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(1.0)


def wait_loaded_and_waiting(server: VLLMServer, role: str) -> None:
    """Until the role loaded its model and its connector waits for the peer role (the worker
    logs both; SIGTERM cancels the wait from the second line on)."""
    wait_for(
        lambda: LOADED.format(role=role) in server.log_text() and WAITING in server.log_text(),
        f"{server.name} loaded and waiting for its peers",
        ENGINE_START_S,
        server,
    )


def wait_idle(server: VLLMServer) -> None:
    """Until ``server`` runs no request and its ``afd_*`` series stood still between two reads
    a second apart (:func:`wait_for`'s poll)."""
    from afd_models.demo.servers import afd_samples, sample_total

    last: object = None

    def idle() -> bool:
        nonlocal last
        text = server.metrics_text()
        snapshot = afd_samples(text)
        still = snapshot == last and sample_total(text, "vllm:num_requests_running") == 0
        last = snapshot
        return still

    wait_for(idle, f"{server.name} idle", 60.0, server)


def roles(model: Path, log_dir: Path, prefix: str, **kw: Any) -> tuple[VLLMServer, VLLMServer]:
    attention, (ffn,) = afd_servers(
        model,
        log_dir=log_dir,
        options=OPTIONS,
        num_attention_ranks=1,
        gate_on_attention=False,
        prefix=prefix,
        progress=print,
        **kw,
    )
    return attention, ffn


# ------------------------------------------------------------------------ item 1: shutdown


@pytest.mark.timeout(900)
def test_sigterm_while_each_role_waits_for_its_peer(
    model: Path, log_dir: Path, cleanup: list[VLLMServer]
) -> None:
    """An Attention role with no FFN (its engine core waits in the connector's init, its API
    server in vLLM's engine-ready wait) and an FFN role with no Attention (its service retries
    init), started together on different AFD ports so they never pair."""
    attention, _ = roles(model, log_dir, "wait-a")
    _, ffn = roles(model, log_dir, "wait-f")
    cleanup += [attention, ffn]
    attention.start()
    ffn.start()
    wait_loaded_and_waiting(attention, "attention")
    wait_until_healthy([ffn])  # an FFN without Attention is up (it waits in its service)
    assert not attention.healthy()
    a_snap, f_snap = Snapshot(attention), Snapshot(ffn)
    a_res = attention.stop(timeout_s=2 * STOP_BOUND_S)
    f_res = ffn.stop(timeout_s=2 * STOP_BOUND_S)
    print(a_res, f_res)
    assert_stopped_cleanly(a_res, a_snap)
    assert_stopped_cleanly(f_res, f_snap)
    assert "startup cancelled by SIGTERM while waiting for its peers" in attention.log_text()


@pytest.mark.timeout(1200)
def test_sigterm_idle_attention_first_then_serving_ffn_first(
    model: Path, log_dir: Path, cleanup: list[VLLMServer]
) -> None:
    """One FFN, two Attention deployments in turn:

    1. both up and idle: SIGTERM the Attention role (exit 0 within the bound, clean);
    2. the FFN, now waiting for a new deployment, serves a restarted Attention role;
    3. while that one streams requests, SIGTERM the FFN (exit 0 within the bound, clean);
       the Attention role stays up; SIGTERM it (exit 0 within the bound, clean)."""
    attention, ffn = roles(model, log_dir, "idle")
    cleanup += [attention, ffn]
    ffn.start()
    attention.start()
    wait_until_healthy([ffn, attention])
    complete_many(attention.base_url, DEMO_PROMPTS[:2], max_tokens=4, concurrency=2)
    wait_idle(attention)
    snap = Snapshot(attention)
    assert_stopped_cleanly(attention.stop(timeout_s=2 * STOP_BOUND_S), snap)
    assert ffn.healthy()

    # A new Attention deployment on the same FFN (same AFD port, new HTTP port). Its requests
    # held at the FFN's loss fail after a short grace (the hold itself is the FFN-loss tests').
    second = variant(
        attention,
        name="idle-attention2",
        http_port=free_port(),
        afd={"ffn_loss_grace_s": LOSS_GRACE_S},
    )
    cleanup.append(second)
    second.start()
    wait_until_healthy([second])

    errors: list[BaseException] = []

    def load() -> None:
        try:
            complete_many(second.base_url, DEMO_PROMPTS * 4, max_tokens=64, concurrency=4)
        except BaseException as err:  # the FFN leaves mid-stream: requests fail
            errors.append(err)

    from afd_models.demo.servers import afd_samples, parse_ffn_stats

    def served() -> tuple[int, int]:
        """(Attention deployments paired, steps served) from the FFN's /metrics."""
        text = ffn.metrics_text()
        key = ("afd_connections_total", frozenset({("role", "ffn"), ("rank", "0")}))
        return int(afd_samples(text).get(key, 0)), parse_ffn_stats(text)[0].steps

    connections, steps = served()
    assert connections == 2, connections  # the second deployment paired with the same FFN
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    wait_for(lambda: served()[1] > steps, "serving", 120.0, ffn, second)
    f_snap = Snapshot(ffn)
    f_res = ffn.stop(timeout_s=2 * STOP_BOUND_S)
    print(f_res)
    assert_stopped_cleanly(f_res, f_snap)
    # The Attention role lost its FFN mid-stream: it stays up (reconnecting, /health 503) and
    # still stops cleanly on SIGTERM.
    loader.join(LOSS_GRACE_S + 60)
    assert not loader.is_alive() and errors, "the requests held at the FFN's loss never failed"
    assert second.poll() is None, second.log_tail(30)
    a_snap = Snapshot(second)
    assert_stopped_cleanly(second.stop(timeout_s=2 * STOP_BOUND_S), a_snap)


# ------------------------------------------------------------ item 3: FFN fails in startup


def _corrupt_copy(model: Path, dest: Path) -> Path:
    """A copy of ``model`` whose weights files are garbage (the config stays readable)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model, dest)
    weights = sorted(dest.glob("*.safetensors"))
    assert weights, f"no safetensors in {model}"
    for w in weights:
        w.write_bytes(b"\x00not a safetensors file\xff" * 64)
    return dest


@pytest.mark.timeout(1200)
def test_ffn_failing_to_load_fails_the_attention_role_with_its_message(
    model: Path, log_dir: Path, cleanup: list[VLLMServer], tmp_path: Path
) -> None:
    """Two deployments at once: an FFN whose weights file is corrupt, and an FFN whose load
    raises (``AFD_INJECT_FAULT=ffn_load``). Each Attention role exits non-zero naming FFN world
    rank 1, stage ``load`` and the FFN's error, within its startup timeout (after its engine
    start), not vLLM's 600 s."""
    extra = {"startup_timeout_s": FAILING_STARTUP_TIMEOUT_S}
    corrupt = _corrupt_copy(model, tmp_path / "corrupt")
    att_c, _ = roles(model, log_dir, "load-corrupt", afd_extra=extra)
    _, ffn_c = roles(corrupt, log_dir, "load-corrupt-f", afd_extra=extra)
    # The corrupt FFN must use the Attention role's AFD port: rebuild its argv on that port.
    ffn_c = variant(ffn_c, name="load-corrupt-ffn", port=afd_port(att_c))
    att_i, ffn_i = roles(
        model, log_dir, "load-inject", afd_extra=extra, ffn_env={"AFD_INJECT_FAULT": "ffn_load"}
    )
    cleanup += [att_c, ffn_c, att_i, ffn_i]
    t0 = time.monotonic()
    for s in (ffn_c, ffn_i, att_c, att_i):
        s.start()
    cases = {
        att_c: ("SafetensorError", "header"),
        att_i: (
            "InjectedFaultError",
            "AFD FFN rank 0 model load failed (injected: AFD_INJECT_FAULT=ffn_load)",
        ),
    }
    for attention, (kind, text) in cases.items():
        with pytest.raises(ServerExitedError) as err:
            wait_until_healthy([attention])
        elapsed = time.monotonic() - t0
        assert err.value.name == attention.name
        assert attention.poll() not in (None, 0)
        log = attention.log_text()
        print(attention.name, f"exited after {elapsed:.0f}s")
        # Engine start (up to ENGINE_START_S here) plus at most the startup timeout.
        assert elapsed < ENGINE_START_S + FAILING_STARTUP_TIMEOUT_S, elapsed
        assert "AFDStartupError" in log and "world rank 1 failed during 'load'" in log, log[-3000:]
        assert kind in log and text in log, log[-3000:]
    for ffn in (ffn_c, ffn_i):
        assert "failed to load" in ffn.log_text()
        wait_for(lambda f=ffn: f.poll() is not None, f"{ffn.name} exits", 120.0)
        assert ffn.poll() != 0


def variant(
    server: VLLMServer,
    *,
    name: str,
    http_port: int | None = None,
    port: int | None = None,
    afd: dict[str, Any] | None = None,
) -> VLLMServer:
    """An unstarted copy of ``server`` named ``name`` on another HTTP port and/or AFD port,
    with the AFD config fields in ``afd`` replaced."""
    argv = list(server.config.argv)
    if http_port is not None:
        argv[argv.index("--port") + 1] = str(http_port)
    fields = {**(afd or {}), **({} if port is None else {"port": port})}
    if fields:
        i = argv.index("--additional-config") + 1
        cfg = json.loads(argv[i])
        cfg["afd"].update(fields)
        argv[i] = json.dumps(cfg, sort_keys=True)
    config = dataclasses.replace(
        server.config,
        name=name,
        argv=tuple(argv),
        port=http_port or server.config.port,
        log_path=server.config.log_path.with_name(f"{name}.log"),
    )
    return VLLMServer(config, print)


# -------------------------------------------------------- issue 31 item 6: fatal service error


@pytest.mark.timeout(900)
def test_ffn_service_error_fails_the_request_and_the_ffn_exits_nonzero(
    model: Path, log_dir: Path, cleanup: list[VLLMServer]
) -> None:
    import requests

    attention, ffn = roles(
        model,
        log_dir,
        "compute-fault",
        ffn_env={"AFD_INJECT_FAULT": "ffn_compute"},
        # Fail the request at once (no hold for an FFN that would come back: none does here).
        afd_extra={"ffn_loss_grace_s": 0},
    )
    cleanup += [attention, ffn]
    ffn.start()
    attention.start()
    wait_until_healthy([attention, ffn])
    resp = requests.post(
        f"{attention.base_url}/v1/completions",
        json={
            "model": served_model_id(attention.base_url),
            "prompt": "Hello",
            "max_tokens": 4,
            "temperature": 0.0,
        },
        timeout=120,
    )
    assert resp.status_code == 500, resp.text
    assert "AFD FFN role unavailable" in resp.text, resp.text
    injected = "compute of layer"
    assert injected in resp.text or injected in attention.log_text(), resp.text
    wait_for(lambda: ffn.poll() is not None, f"{ffn.name} exits", 120.0)
    assert ffn.poll() not in (None, 0), ffn.poll()
    assert "AFD FFN service loop failed" in ffn.log_text()
    assert "(injected: AFD_INJECT_FAULT=ffn_compute)" in ffn.log_text()
    # The Attention role outlives its FFN's failure: up, and /health tells the FFN is gone.
    assert attention.poll() is None
    assert requests.get(f"{attention.base_url}/health", timeout=10).status_code == 503
    result = attention.stop(timeout_s=STOP_BOUND_S)
    assert not result.forced
