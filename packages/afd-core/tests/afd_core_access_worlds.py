"""Rank functions and the rogue of afd-core's access tests (imported by spawned children by name).

A 1:1 pair does exact round trips until the test's rogue is done (``<workdir>/stop``), reporting
its listening sockets (``<workdir>/rank<r>.json``) so the rogue can aim at them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDAccessError, AFDError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session.access import SECRET_ENV, StoreTunnel
from afd_core.session.startup import _MASTER_STORES
from afd_core.topology import AFDTopology

HIDDEN = 8
LAST_ROUND_TOKENS = 1  # the Attention rank's last round: the FFN rank returns after it
ROUND_TOKENS = 4


def _hex_ip(text: str) -> str:
    raw = bytes.fromhex(text)
    # /proc/net/tcp* print each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int | None = None) -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket ``pid`` (default: this process) listens on (/proc)."""
    base = Path("/proc", str(pid or os.getpid()))
    inodes = set()
    for fd in (base / "fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = (base / "net" / table).read_text().splitlines()[1:]
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ip, port = cols[1].split(":")
                found.append((_hex_ip(ip), int(port, 16)))
    return sorted(found)


def _set_secret(secret: str | None) -> None:
    if secret is None:
        os.environ.pop(SECRET_ENV, None)
    else:
        os.environ[SECRET_ENV] = secret


def _payload(round_idx: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(round_idx)
    return torch.randn(n, HIDDEN, generator=gen)


def pair_rank(
    rank: int,
    host: str,
    port: int,
    secret: str | None,
    workdir: str,
    joiner_delay_s: float,
    max_run_s: float,
) -> dict[str, Any]:
    """1:1 pair on ``host:port``; round trips (exactly checked) until ``<workdir>/stop``."""
    _set_secret(secret)
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = AFDConfig(role=role, host=host, port=port, timeout_s=30.0, startup_timeout_s=90.0)
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    if rank == 1:
        time.sleep(joiner_delay_s)  # the rogue is at work while the pair initialises
    started = time.monotonic()
    conn.init()
    report: dict[str, Any] = {"init_s": time.monotonic() - started, "listening": listening()}
    if rank == 0:
        served = _MASTER_STORES[(host, port)]
        report["store_port"] = int(served.store.port)
    Path(workdir, f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), **report}))
    stop = Path(workdir, "stop")
    deadline = time.monotonic() + max_run_s
    rounds = mismatches = 0
    try:
        while True:
            if role is AFDRole.ATTENTION:
                last = stop.exists() or time.monotonic() > deadline
                n = LAST_ROUND_TOKENS if last else ROUND_TOKENS
                sent = _payload(rounds, n)
                conn.send_control(AFDControlMessage(((n,),)))
                handle = conn.send_dispatch([AFDPayload(sent)], AFDTransferMetadata(0, 0, (n,)))
                got = conn.recv_combine(handle)[0]
                mismatches += int(not torch.equal(got, sent * 2.0))
            else:
                ctl = conn.recv_control(timeout_s=30.0)
                meta, (payload,) = conn.recv_dispatch(0, 0)
                n = meta.num_tokens[0]
                mismatches += int(meta != ctl.transfer_metadata(0, 0))
                mismatches += int(not torch.equal(payload.hidden_states, _payload(rounds, n)))
                conn.send_combine([payload.hidden_states * 2.0], meta)
                last = n == LAST_ROUND_TOKENS
            rounds += 1
            if last:
                break
            time.sleep(0.01)
    except AFDError as err:
        report["error"] = f"{type(err).__name__}: {err}"
    report.update(rounds=rounds, mismatches=mismatches, stopped=stop.exists())
    if rank == 0:
        gate = _MASTER_STORES[(host, port)].gate
        report["gate"] = None if gate is None else [gate.admitted, gate.rejected]
        time.sleep(1.0)  # keep serving the store until the FFN rank has closed
    conn.close()
    return report


def secret_rank(rank: int, host: str, port: int, secrets: list[str | None]) -> dict[str, Any]:
    """1:1 pair whose ranks hold ``secrets[rank]``: report what ``init`` raised and when."""
    _set_secret(secrets[rank])
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = AFDConfig(role=role, host=host, port=port, timeout_s=20.0, startup_timeout_s=20.0)
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    started = time.monotonic()
    try:
        conn.init()
    except AFDError as err:
        return {
            "type": type(err).__name__,
            "message": str(err),
            "elapsed": time.monotonic() - started,
        }
    conn.close()
    return {"type": None, "elapsed": time.monotonic() - started}


# -- the rogue -----------------------------------------------------------------------------


def _junk(addr: tuple[str, int], payload: bytes, wait_s: float = 6.0) -> str:
    """Connect, send ``payload``, report what the listener did with it within ``wait_s``."""
    try:
        with socket.create_connection(addr, timeout=2.0) as sock:
            sock.sendall(payload)
            sock.settimeout(wait_s)
            try:
                return "closed" if sock.recv(4096) == b"" else "answered"
            except TimeoutError:
                return "kept"
            except OSError:
                return "reset"
    except OSError as err:
        return f"refused: {err}"


def _raw_store_client(host: str, port: int) -> str:
    """A plain torch store client: try to join, read the keys and claim rank 0."""
    try:
        store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=3))
    except Exception as err:
        return f"refused: {type(err).__name__}"
    try:
        keys = store.list_keys()
        store.add("afd/g1/claim/0", 1)
        store.set("afd/g1/failed/0", "connect\nrogue")
        return f"joined: {len(keys)} keys"
    except Exception as err:
        return f"dropped: {type(err).__name__}"


def rogue(host: str, port: int, workdir: str, wrong_secret: str, max_s: float) -> dict[str, Any]:
    """Attack ``host:port`` while the pair initialises and while it runs, then touch ``stop``.

    During init: junk, half-open connections and plain store clients at the store port until
    both ranks report. Running: the same again, a joiner with ``wrong_secret``, junk and
    half-open connections at every other listener of both ranks.
    """
    addr = (host, port)
    seen: dict[str, list[str]] = {"init_junk": [], "init_store_client": [], "store_client": []}
    held: list[socket.socket] = []
    deadline = time.monotonic() + max_s
    files = [Path(workdir, f"rank{r}.json") for r in range(2)]
    try:
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            try:
                held.append(socket.create_connection(addr, timeout=1.0))  # half-open: kept
            except OSError:
                time.sleep(0.05)
                continue
            seen["init_junk"].append(_junk(addr, os.urandom(256)))
            seen["init_store_client"].append(_raw_store_client(host, port))
        ranks = [json.loads(f.read_text()) for f in files]
        for _ in range(2):
            seen["store_client"].append(_raw_store_client(host, port))
        started = time.monotonic()
        try:
            StoreTunnel(host, port, wrong_secret.encode(), 10.0)
            seen["wrong_secret"] = ["joined"]
        except AFDAccessError as err:
            seen["wrong_secret"] = [f"AFDAccessError: {err}", f"{time.monotonic() - started}"]
        store_ports = {port, ranks[0].get("store_port")}
        targets = [(ip, p) for r in ranks for ip, p in r["listening"] if p not in store_ports]
        seen["data_plane_targets"] = [f"{ip}:{p}" for ip, p in targets]
        seen["data_plane_junk"] = []
        for target in [addr, *targets]:
            for payload in (b"\x00" * 8, b"\xff" * 64, os.urandom(4096), b"\x01" + b"\x00" * 7):
                seen["data_plane_junk"].append(_junk(target, payload, 0.5))
            with contextlib.suppress(OSError):
                held.append(socket.create_connection(target, timeout=1.0))
        time.sleep(2.0)  # the pair keeps doing round trips with the half-open sockets held
    finally:
        Path(workdir, "stop").touch()
        for sock in held:
            sock.close()
    seen["held"] = [str(len(held))]
    return seen
