"""Rank functions for afd-runtime's service tests (imported by spawned children by name).

The Attention ranks drive afd-core's P2P connector directly (control message, then per layer
``send_attn_output`` / ``recv_ffn_output``), as the Attention worker and afd-remote's proxy do in
serving; the FFN rank runs :class:`afd_runtime.ffn_service.FFNService` on the same connector.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from afd_core.config import AFDConfig
from afd_core.connector import create_connector
from afd_core.errors import AFDHandshakeError, AFDPeerError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_runtime.ffn_service import FFNService

HIDDEN = 8
EXPERTS = 4
LAYERS = (1, 3)
STEPS = (3, 1, 5)


def config(role: str, port: int, **kw: Any) -> AFDConfig:
    raw: dict[str, Any] = {"role": role, "port": port, "timeout_s": 20.0, "startup_timeout_s": 60}
    raw.update(kw)
    return AFDConfig.from_mapping(raw)


def spec(gate_on_attention: bool) -> AFDPayloadSpec:
    return AFDPayloadSpec(
        hidden_size=HIDDEN,
        dtype=torch.float32,
        router_logits_width=EXPERTS if gate_on_attention else None,
        router_logits_dtype=torch.float32 if gate_on_attention else None,
    )


def connector(cfg: AFDConfig, rank: int) -> Any:
    return create_connector(
        cfg, rank, payload_spec=spec(cfg.compute_gate_on_attention), num_layers=max(LAYERS) + 1
    )


class StepRecordingCompute:
    """A stepped FFN compute (``afd_runtime.compute.SteppedFFNCompute``) that records, per
    step, the ``num_tokens`` it was entered with and the calls made inside it."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []  # (num_tokens, calls inside the step)
        self.calls_outside_steps = 0
        self._open: list[int] | None = None

    @contextlib.contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        self._open = [num_tokens, 0]
        try:
            yield
        finally:
            self.steps.append((self._open[0], self._open[1]))
            self._open = None

    def __call__(
        self, layer: int, hidden: torch.Tensor, logits: torch.Tensor | None
    ) -> torch.Tensor:
        if self._open is None:
            self.calls_outside_steps += 1
        else:
            self._open[1] += 1
        out = hidden * (layer + 1)
        if logits is not None:
            out = out + logits.sum(dim=-1, keepdim=True).to(hidden.dtype)
        if layer == 3 and hidden.shape[0] == 13:
            raise ValueError("planted failure at 13 tokens")
        return out


compute = StepRecordingCompute()


def ffn_main(port: int, num_attention: int, expected_steps: int, gate: bool, q: Any) -> None:
    cfg = config("ffn", port, num_attention_ranks=num_attention, compute_gate_on_attention=gate)
    svc = FFNService(cfg, 0, LAYERS, compute, lambda: connector(cfg, 0))
    svc.start()
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and svc.stats.steps < expected_steps and not svc.failed:
        time.sleep(0.05)
    time.sleep(1.0)  # let the goodbyes arrive
    err = svc._error
    stats = svc.stats
    svc.stop()
    q.put(
        (
            "ffn",
            (stats.steps, stats.compute_calls, stats.tokens, svc.deployments),
            None if err is None else f"{type(err).__name__}: {err}",
        )
    )
    q.put(("ffn-steps", compute.steps, compute.calls_outside_steps))


def _hidden(n: int, rank: int, step: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 * step + n + rank))


def attention_main(
    port: int, rank: int, num_attention: int, mode: str, q: Any, barrier: Any, tag: str = ""
) -> None:
    cfg = config(
        "attention",
        port,
        num_attention_ranks=num_attention,
        compute_gate_on_attention=mode == "disagree",
    )
    conn = connector(cfg, rank)
    try:
        conn.init()
    except AFDHandshakeError as exc:
        q.put((f"attention{rank}{tag}", False, f"{type(exc).__name__}: {exc}"))
        time.sleep(5)  # keep hosting the store so the FFN can read our handshake too
        return
    results: list[bool] = []
    for step, n in enumerate(STEPS):
        n = n + rank  # the ranks of one step carry different counts
        hidden = _hidden(n, rank, step)
        conn.send_control(AFDControlMessage(((n,),)))
        for layer in LAYERS:
            meta = AFDTransferMetadata(layer, 0, (n,))
            got = conn.recv_ffn_output(conn.send_attn_output(AFDPayload(hidden), meta))
            results.append(torch.equal(got, hidden * (layer + 1)))
    error = None
    if mode == "fail":
        hidden = torch.ones(13, HIDDEN)
        try:
            conn.send_control(AFDControlMessage(((13,),)))
            for layer in LAYERS:
                meta = AFDTransferMetadata(layer, 0, (13,))
                conn.recv_ffn_output(conn.send_attn_output(AFDPayload(hidden), meta))
        except AFDPeerError as exc:
            error = f"{type(exc).__name__}: {exc}"
    barrier.wait(120)  # attention rank 0 hosts the store: nobody leaves before all are done
    if error is None:
        conn.send_control(AFDControlMessage.shutdown_message())
    conn.close()
    q.put((f"attention{rank}{tag}", all(results), error))
