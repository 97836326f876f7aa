"""afd_core.testing's port chooser: never inside the OS's ephemeral range, never twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from afd_core import testing
from afd_core.testing import ephemeral_port_range, free_port, free_ports


def test_ports_are_below_the_ephemeral_range_and_free() -> None:
    low, high = ephemeral_port_range()
    ports = free_ports(32)
    assert len(set(ports)) == 32
    for port in ports:
        assert testing.LOWEST_PORT <= port < low, (port, low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # still free: nothing kept it bound


def test_no_port_is_handed_out_twice_in_a_process() -> None:
    seen = set(free_ports(64))
    for _ in range(64):
        port = free_port()
        assert port not in seen
        seen.add(port)


def _busy_port_before_a_free_one() -> socket.socket:
    """A listening socket on a port whose successor was free a moment ago (the OS hands out
    ports in its ephemeral range, where another socket may already hold the successor)."""
    for _ in range(50):
        busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        busy.bind(("127.0.0.1", 0))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", busy.getsockname()[1] + 1))
            except OSError:
                busy.close()
                continue
        busy.listen()
        return busy
    raise AssertionError("no port with a free successor found in 50 tries")


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with _busy_port_before_a_free_one() as busy:
        taken = busy.getsockname()[1]
        # A window of two ports, one of them taken: the other one comes back.
        monkeypatch.setattr(testing, "_candidate_window", lambda low, high: range(taken, taken + 2))
        monkeypatch.setattr(testing, "_handed_out", set())
        assert free_ports(1) == (taken + 1,)


def test_range_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_port_range(f) == (40000, 50000)
    assert ephemeral_port_range(tmp_path / "missing") == testing.DEFAULT_EPHEMERAL_RANGE
    # A range that starts low leaves the ports above it.
    assert testing._candidate_window(1024, 30000) == range(30001, 65536)
    with pytest.raises(ValueError, match="ip_local_port_range=1024 65000"):
        testing._candidate_window(1024, 65000)


def test_bad_count_names_it() -> None:
    with pytest.raises(ValueError, match="count=0"):
        free_ports(0)
