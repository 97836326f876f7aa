"""Rank functions for afd-runtime's service tests (imported by spawned children by name)."""

from __future__ import annotations

import time
from typing import Any

import torch
from afd_core.config import AFDConfig
from afd_runtime.attention_client import AFDRemoteFFNError, AttentionClient
from afd_runtime.ffn_service import FFNService
from afd_runtime.transport import AFDAgreementError

HIDDEN = 8
LAYERS = (1, 3)


def config(role: str, port: int, **kw: Any) -> AFDConfig:
    raw: dict[str, Any] = {"role": role, "port": port, "timeout_s": 20.0}
    raw.update(kw)
    return AFDConfig.from_mapping(raw)


def compute(layer: int, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
    out = hidden * (layer + 1)
    if logits is not None:
        out = out + logits.sum(dim=-1, keepdim=True).to(hidden.dtype)
    if layer == 3 and hidden.shape[0] == 7:
        raise ValueError("planted failure at 7 tokens")
    return out


def ffn_main(port: int, num_attention: int, expected_steps: int, q: Any) -> None:
    cfg = config("ffn", port, num_attention_ranks=num_attention)
    svc = FFNService(cfg, 0, LAYERS, HIDDEN, compute, startup_timeout_s=120.0)
    svc.start()
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and svc.steps_served < expected_steps and not svc.failed:
        time.sleep(0.1)
    time.sleep(1.0)  # let the goodbyes arrive
    err = svc._error
    svc.stop()
    q.put(("ffn", svc.steps_served, None if err is None else str(err)))


def attention_main(
    port: int, rank: int, num_attention: int, mode: str, q: Any, barrier: Any, tag: str = ""
) -> None:
    extra = {"compute_gate_on_attention": True} if mode == "disagree" else {}
    cfg = config("attention", port, num_attention_ranks=num_attention, **extra)
    client = AttentionClient(cfg, rank, startup_timeout_s=120.0)
    try:
        client.connect()
    except AFDAgreementError as exc:
        q.put((f"attention{rank}{tag}", False, str(exc)))
        time.sleep(5)  # keep hosting the store so the FFN can read our token too
        return
    results: list[bool] = []
    for n in (3, 1, 5):
        hidden = torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n + rank))
        logits = torch.randn(n, 4) if rank == 1 else None
        with client.step(n):
            for layer in LAYERS:
                got = client.exchange(layer, hidden, logits)
                want = hidden * (layer + 1)
                if logits is not None:
                    want = want + logits.sum(dim=-1, keepdim=True)
                results.append(torch.equal(got, want))
    error = None
    if mode == "fail":
        hidden = torch.ones(7, HIDDEN)
        try:
            with client.step(7):
                for layer in LAYERS:
                    client.exchange(layer, hidden, None)
        except AFDRemoteFFNError as exc:
            error = str(exc)
    barrier.wait(120)  # attention rank 0 hosts the store: nobody leaves before all are done
    client.close()
    q.put((f"attention{rank}{tag}", all(results), error))
