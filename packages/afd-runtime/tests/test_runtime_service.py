"""FFN service loop <-> attention client over real gloo pair groups (two spawned processes)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from afd_runtime.attention_client import AttentionClient
from afd_runtime.ffn_service import FFNService

# Spawned children import the rank functions by module name (pytest's importlib mode gives this
# test module a name they cannot import).
sys.path.insert(0, str(Path(__file__).parent))
import afd_runtime_service_ranks as ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    num_attention: int, mode: str, expected_steps: int, sessions: int = 1
) -> dict[str, tuple[Any, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    ffn = ctx.Process(target=ranks.ffn_main, args=(port, num_attention, expected_steps, q))
    ffn.start()
    out = {}
    for s in range(sessions):
        barrier = ctx.Barrier(num_attention)
        procs = [
            ctx.Process(
                target=ranks.attention_main,
                args=(port, r, num_attention, mode, q, barrier, f"s{s}" if s else ""),
            )
            for r in range(num_attention)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(200)
    for _ in range(num_attention * sessions + 1):
        name, a, b = q.get(timeout=200)
        out[name] = (a, b)
    ffn.join(30)
    return out


@pytest.mark.timeout(240)
def test_service_round_trip_two_attention_ranks() -> None:
    out = _run(2, "ok", expected_steps=6)
    assert out["attention0"] == (True, None)
    assert out["attention1"] == (True, None)
    assert out["ffn"] == (6, None)  # 3 steps per attention rank


@pytest.mark.timeout(240)
def test_compute_error_reaches_attention_and_service() -> None:
    out = _run(1, "fail", expected_steps=99)
    ok, err = out["attention0"]
    assert ok is True
    assert err is not None
    assert "failed at layer 3" in err
    assert "planted failure at 7 tokens" in err
    steps, ffn_err = out["ffn"]
    assert steps == 3
    assert ffn_err is not None and "planted failure" in ffn_err


@pytest.mark.timeout(240)
def test_ffn_outlives_an_attention_restart() -> None:
    out = _run(1, "ok", expected_steps=6, sessions=2)
    assert out["attention0"] == (True, None)
    assert out["attention0s1"] == (True, None)
    assert out["ffn"] == (6, None)


@pytest.mark.timeout(240)
def test_config_disagreement_is_refused_on_both_sides() -> None:
    out = _run(1, "disagree", expected_steps=99)
    ok, err = out["attention0"]
    assert ok is False
    assert err is not None and "disagreement" in err
    steps, ffn_err = out["ffn"]
    assert steps == 0
    assert ffn_err is not None and "disagreement" in ffn_err


def test_client_rejects_rank_outside_topology() -> None:
    cfg = ranks.config("attention", 12345)
    with pytest.raises(ValueError, match="1"):
        AttentionClient(cfg, 1)


def test_service_rejects_empty_layers() -> None:
    cfg = ranks.config("ffn", 12345)
    with pytest.raises(ValueError, match="layer_indices"):
        FFNService(cfg, 0, (), ranks.HIDDEN, ranks.compute)
