"""Access control of a P2P world: listeners bound to the configured host, the AFD_SECRET gate."""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDAccessError, AFDConfigError
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.access import (
    MIN_SECRET_CHARS,
    SECRET_ENV,
    StoreGate,
    StoreTunnel,
    deployment_secret,
    is_loopback_host,
    listen_socket,
)
from afd_core.session.startup import open_tcp_store, release_store_servers
from afd_core.testing import free_port, run_world

sys.path.insert(0, str(Path(__file__).parent))
import afd_core_access_worlds as worlds

SECRET = "s3cret-for-the-afd-access-tests"
# 127.0.0.2 is loopback (no secret needed) but not 127.0.0.1: a listener bound to it proves it
# follows the configured host rather than a default.
HOST = "127.0.0.2"


def _wait_closed(sock: socket.socket, bound_s: float) -> bool:
    sock.settimeout(bound_s)
    try:
        return sock.recv(64) == b""
    except OSError:
        return True


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "LOCALHOST", "::1"):
        assert is_loopback_host(host), host
    for host in ("10.231.0.1", "0.0.0.0", "::", "store.invalid"):
        assert not is_loopback_host(host), host


def test_deployment_secret_rules_never_show_the_secret() -> None:
    assert deployment_secret("127.0.0.1", {}) is None
    assert deployment_secret("127.0.0.1", {SECRET_ENV: SECRET}) == SECRET.encode()
    assert deployment_secret("10.231.0.1", {SECRET_ENV: SECRET}) == SECRET.encode()
    with pytest.raises(AFDConfigError) as unset:
        deployment_secret("10.231.0.1", {})
    assert unset.value.field == SECRET_ENV
    assert "10.231.0.1" in str(unset.value) and "not a loopback" in str(unset.value)
    short = "x" * (MIN_SECRET_CHARS - 1)
    with pytest.raises(AFDConfigError) as too_short:
        deployment_secret("10.231.0.1", {SECRET_ENV: short})
    assert too_short.value.field == SECRET_ENV
    assert short not in str(too_short.value)
    assert f"<{MIN_SECRET_CHARS - 1} characters>" in str(too_short.value)


def test_non_loopback_host_without_secret_fails_before_any_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    before = worlds.listening()
    cfg = AFDConfig(role=AFDRole.ATTENTION, host="store.invalid", port=free_port())
    conn = P2PConnector(
        cfg, payload_spec=AFDPayloadSpec(hidden_size=8, dtype=torch.float32), num_layers=1
    )
    with pytest.raises(AFDConfigError) as err:
        conn.init()
    assert err.value.field == SECRET_ENV
    assert not conn.is_initialized
    assert worlds.listening() == before


def test_open_store_listens_only_on_its_host() -> None:
    port = free_port()
    try:
        store = open_tcp_store(HOST, port, is_master=True, timeout_s=10.0)
        assert (HOST, port) in worlds.listening()
        assert [addr for addr in worlds.listening() if addr[1] == port] == [(HOST, port)]
        client = open_tcp_store(HOST, port, is_master=False, timeout_s=10.0)
        client.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        release_store_servers()


def test_gated_store_admits_the_secret_only() -> None:
    port = free_port()
    secret = SECRET.encode()
    try:
        store = open_tcp_store(HOST, port, is_master=True, timeout_s=10.0, secret=secret)
        mine = worlds.listening()
        assert [addr for addr in mine if addr[1] == port] == [(HOST, port)]
        assert all(ip in (HOST, "127.0.0.1") for ip, _ in mine), mine  # the store: loopback
        # The right secret joins and shares keys with the master.
        client = open_tcp_store(HOST, port, is_master=False, timeout_s=10.0, secret=secret)
        client.set("afd/k", "v")
        assert store.get("afd/k") == b"v"
        # A wrong secret is refused at once, naming the variable, never showing a secret.
        started = time.monotonic()
        with pytest.raises(AFDAccessError) as wrong:
            open_tcp_store(HOST, port, is_master=False, timeout_s=10.0, secret=b"w" * 20)
        assert time.monotonic() - started < 10.0  # no wait for the 5 s handshake timeout
        assert SECRET_ENV in str(wrong.value) and "different deployment secret" in str(wrong.value)
        assert SECRET not in str(wrong.value) and "w" * 20 not in str(wrong.value)
        # A plain store client never reaches the store.
        with pytest.raises(Exception):  # noqa: B017 - torch raises its own network errors
            dist.TCPStore(HOST, port, None, False, timeout=timedelta(seconds=3))
        # Junk is closed; a half-open connection is closed after the handshake timeout.
        with socket.create_connection((HOST, port)) as junk:
            junk.sendall(b"\xff" * 4096)
            assert _wait_closed(junk, 10.0)
        with socket.create_connection((HOST, port)) as half_open:
            assert _wait_closed(half_open, 10.0)
        assert store.get("afd/k") == b"v"
        assert store.num_keys() >= 1 and "afd/k" in store.list_keys()
        client.set("afd/k2", "still served")
        assert store.get("afd/k2") == b"still served"
    finally:
        release_store_servers()


def test_secret_joiner_at_an_open_store_gets_access_error() -> None:
    port = free_port()
    try:
        open_tcp_store(HOST, port, is_master=True, timeout_s=10.0)
        started = time.monotonic()
        with pytest.raises(AFDAccessError) as err:
            StoreTunnel(HOST, port, SECRET.encode(), 20.0)
        assert time.monotonic() - started < 10.0
        assert "serves without a deployment secret" in str(err.value)
    finally:
        release_store_servers()


def test_gate_caps_pending_handshakes() -> None:
    backend = listen_socket("127.0.0.1", 0)
    gate = StoreGate(
        listen_socket(HOST, 0), backend.getsockname()[:2], SECRET.encode(), max_pending=2
    )
    held = [socket.create_connection(gate.address) for _ in range(2)]
    try:
        with socket.create_connection(gate.address) as third:
            assert _wait_closed(third, 5.0)  # beyond max_pending: closed at once
        assert gate.rejected >= 1
    finally:
        for sock in held:
            sock.close()
        gate.close()
        backend.close()


def _ok(results: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
    for rank, outcome in results.items():
        assert outcome[0] == "ok", (rank, outcome)
    return {rank: outcome[1] for rank, outcome in results.items()}


@pytest.mark.faults  # item 7 of the faults suite (nox -s faults)
def test_pair_listens_only_on_host_without_secret(tmp_path: Path) -> None:
    port = free_port()
    (tmp_path / "stop").touch()  # a few round trips only
    results = _ok(
        run_world(worlds.pair_rank, 2, HOST, port, None, str(tmp_path), 0.0, 30.0, timeout_s=150)
    )
    for rank, report in results.items():
        assert "error" not in report, report
        assert report["mismatches"] == 0 and report["rounds"] >= 1
        assert report["listening"], rank
        assert {ip for ip, _ in report["listening"]} == {HOST}, (rank, report["listening"])
    assert (HOST, port) in results[0]["listening"]


@pytest.mark.faults  # item 7 of the faults suite (nox -s faults)
def test_rogue_cannot_join_stall_or_crash_a_gated_pair(tmp_path: Path) -> None:
    """With AFD_SECRET, a rogue knowing the port attacks during init and while the pair runs
    (junk, half-open connections, plain store clients claiming rank 0 and publishing a failure,
    a wrong secret, junk at the data-plane listeners): the pair initialises, every round trip is
    exact, and the rogue never joins."""
    port = free_port()
    rogue_out: dict[str, Any] = {}

    def attack() -> None:
        rogue_out.update(worlds.rogue(HOST, port, str(tmp_path), "a-wrong-secret-x" * 2, 120.0))

    attacker = threading.Thread(target=attack, daemon=True)
    attacker.start()
    time.sleep(0.5)
    started = time.monotonic()
    results = _ok(
        run_world(worlds.pair_rank, 2, HOST, port, SECRET, str(tmp_path), 6.0, 150.0, timeout_s=240)
    )
    elapsed = time.monotonic() - started
    attacker.join(timeout=30)
    assert not attacker.is_alive()
    for rank, report in results.items():
        assert "error" not in report, (rank, report)
        assert report["stopped"] and report["mismatches"] == 0, (rank, report)
        assert report["rounds"] >= 10, (rank, report)
        assert all(ip in (HOST, "127.0.0.1") for ip, _ in report["listening"]), report
    # The rogue: busy during init, never joined, refused with a clear error on a wrong secret.
    assert rogue_out["init_junk"], rogue_out
    assert all(r.startswith("refused") for r in rogue_out["init_store_client"]), rogue_out
    assert all(r.startswith("refused") for r in rogue_out["store_client"]), rogue_out
    assert rogue_out["wrong_secret"][0].startswith("AFDAccessError"), rogue_out
    assert float(rogue_out["wrong_secret"][1]) < 10.0
    assert len(rogue_out["data_plane_targets"]) >= 2, rogue_out  # gloo listeners of both ranks
    assert all(r in ("closed", "reset") for r in rogue_out["init_junk"]), rogue_out
    admitted, rejected = results[0]["gate"]
    assert admitted == 1  # the FFN rank's store client, nobody else
    assert rejected >= len(rogue_out["init_junk"]) + 3
    assert elapsed < 200


@pytest.mark.faults  # item 7 of the faults suite (nox -s faults)
def test_wrong_secret_joiner_gets_a_clear_error() -> None:
    port = free_port()
    results = _ok(
        run_world(worlds.secret_rank, 2, HOST, port, [SECRET, SECRET[::-1]], timeout_s=90)
    )
    joiner = results[1]
    assert joiner["type"] == "AFDAccessError", joiner
    assert SECRET_ENV in joiner["message"] and "different deployment secret" in joiner["message"]
    assert SECRET not in joiner["message"] and SECRET[::-1] not in joiner["message"]
    assert joiner["elapsed"] < 10.0  # at once: its startup timeout is 20 s
    assert results[0]["type"] == "AFDTimeoutError", results[0]  # its peer never arrived
