"""Rank functions for afd-runtime's service tests: run as threads of the test process on afd-core's
in-process connector (``CONNECTOR``), or by spawned children by name (the SIGTERM test).

The Attention ranks drive afd-core's connector directly (control message, then per layer
``send_dispatch`` / ``recv_combine``), as the Attention worker and afd-remote's proxy do in
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


#: The connector the service tests run on: both roles as threads of one process, no gloo (the
#: P2P transport itself is proven by afd-core's and afd-remote's tests).
CONNECTOR = "inprocess"


def config(role: str, port: int, **kw: Any) -> AFDConfig:
    raw: dict[str, Any] = {"role": role, "port": port, "timeout_s": 20.0, "startup_timeout_s": 60}
    raw["connector"] = kw.pop("connector", CONNECTOR)
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


def _afd_counters(since: dict[str, float] | None = None) -> dict[str, float]:
    """This process's afd_* counters of FFN rank 0 (prometheus_client's default registry), minus
    ``since`` (the ranks may share one process with earlier services)."""
    from prometheus_client import REGISTRY

    labels = {"role": "ffn", "rank": "0"}
    names = ("afd_steps_total", "afd_connections_total", "afd_refusals_total")
    base = since or {}
    return {n: (REGISTRY.get_sample_value(n, labels) or 0.0) - base.get(n, 0.0) for n in names}


def ffn_main(port: int, num_attention: int, expected_steps: int, gate: bool, q: Any) -> None:
    cfg = config("ffn", port, num_attention_ranks=num_attention, compute_gate_on_attention=gate)
    compute = StepRecordingCompute()  # per service (the ranks may share one process)
    before = _afd_counters()
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
            (
                stats.steps,
                stats.compute_calls,
                stats.tokens,
                svc.deployments,
                svc.refusals,
                _afd_counters(before),
            ),
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
            got = conn.recv_combine(conn.send_dispatch([AFDPayload(hidden)], meta))[0]
            results.append(torch.equal(got, hidden * (layer + 1)))
    error = None
    if mode == "fail":
        hidden = torch.ones(13, HIDDEN)
        try:
            conn.send_control(AFDControlMessage(((13,),)))
            for layer in LAYERS:
                meta = AFDTransferMetadata(layer, 0, (13,))
                conn.recv_combine(conn.send_dispatch([AFDPayload(hidden)], meta))
        except AFDPeerError as exc:
            error = f"{type(exc).__name__}: {exc}"
    barrier.wait(120)  # attention rank 0 hosts the store: nobody leaves before all are done
    if error is None:
        conn.send_control(AFDControlMessage.shutdown_message())
    conn.close()
    q.put((f"attention{rank}{tag}", all(results), error))


# -- expert parallel (2 Attention ranks : 2 FFN ranks) -----------------------------------------

EP_TOP_K = 2
EP_STEPS = (4, 3, 6)


def ep_config(role: str, port: int, ffn_rank: int = 0) -> AFDConfig:
    kw: dict[str, Any] = {"num_attention_ranks": 2, "num_ffn_ranks": 2}
    kw["compute_gate_on_attention"] = True
    if role == "ffn":
        kw["ffn_rank"] = ffn_rank
    return config(role, port, **kw)


def ep_connector(cfg: AFDConfig, rank: int) -> Any:
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32, top_k=EP_TOP_K)
    return create_connector(cfg, rank, payload_spec=spec, num_layers=max(LAYERS) + 1)


def toy_experts(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` is ``x * (e + 1)``; exact for the small integers and eighths used here."""
    out = torch.zeros_like(hidden)
    for k in range(weights.shape[1]):
        out += weights[:, k : k + 1] * hidden * (experts[:, k : k + 1].float() + 1)
    return out


class ExpertParallelToyCompute:
    """FFN compute of one expert-parallel rank: its own experts' share of the toy sum."""

    def __init__(self, ffn_rank: int) -> None:
        from afd_core.topology import AFDTopology

        self.ffn_rank = ffn_rank
        self.map = AFDTopology(2, 2).expert_map(EXPERTS)
        self.calls: list[tuple[int, int]] = []  # (layer, tokens)

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        assert logits is None and topk is not None
        weights, ids = self.map.localise(self.ffn_rank, *topk)
        mine = torch.tensor(self.map.local_experts(self.ffn_rank))
        self.calls.append((layer, int(hidden.shape[0])))
        return toy_experts(hidden, weights, mine[ids.long()])


def ep_ffn_main(port: int, ffn_rank: int, q: Any) -> None:
    cfg = ep_config("ffn", port, ffn_rank)
    compute = ExpertParallelToyCompute(ffn_rank)
    svc = FFNService(cfg, ffn_rank, LAYERS, compute, lambda: ep_connector(cfg, ffn_rank))
    svc.start()
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and svc.stats.steps < len(EP_STEPS) and not svc.failed:
        time.sleep(0.05)
    time.sleep(1.0)
    err = svc._error
    svc.stop()
    q.put((f"ffn{ffn_rank}", (svc.stats.steps, compute.calls), None if err is None else str(err)))


def ep_routing(n: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 routes every token to experts 0 and 1 (FFN rank 0): rank 1 gets nothing."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + n)
    hidden = torch.randint(-8, 8, (n, HIDDEN), generator=gen).float()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:EP_TOP_K] for _ in range(n)])
    if step == 1:
        ids = torch.tensor([[0, 1]] * n)
    weights = torch.randint(1, 8, (n, EP_TOP_K), generator=gen).float() / 8
    return hidden, weights, ids.to(torch.int32)


def ep_attention_main(port: int, rank: int, q: Any, barrier: Any) -> None:
    from afd_core.topology import AFDTopology

    cfg = ep_config("attention", port)
    conn = ep_connector(cfg, rank)
    conn.init()
    owners = AFDTopology(2, 2).expert_map(EXPERTS).owner_table()
    results: list[bool] = []
    counts: list[tuple[int, ...]] = []
    for step, n in enumerate(EP_STEPS):
        n = n + rank
        conn.send_control(AFDControlMessage(((n,),)))
        for layer in LAYERS:
            hidden, weights, ids = ep_routing(n, rank, step)
            rows = [torch.nonzero((owners[ids.long()] == f).any(1)).flatten() for f in range(2)]
            parts = [AFDPayload(hidden[r], topk_ids=ids[r], topk_weights=weights[r]) for r in rows]
            meta = AFDTransferMetadata(layer, 0, tuple(int(r.numel()) for r in rows))
            counts.append(meta.num_tokens)
            outs = conn.recv_combine(conn.send_dispatch(parts, meta))
            got = torch.zeros_like(hidden)
            for r, out in zip(rows, outs, strict=True):
                got.index_add_(0, r, out)
            results.append(torch.equal(got, toy_experts(hidden, weights, ids)))
    barrier.wait(120)
    conn.send_control(AFDControlMessage.shutdown_message())
    conn.close()
    q.put((f"attention{rank}", (all(results), counts), None))


# -- token ids on the wire (2 Attention ranks : 1 FFN rank, gate on FFN) -----------------------

IDS_VOCAB = 50


def ids_connector(cfg: AFDConfig, rank: int) -> Any:
    spec = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32, input_ids=True)
    return create_connector(cfg, rank, payload_spec=spec, num_layers=max(LAYERS) + 1)


def _ids(n: int, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 * step + rank)
    return torch.randint(0, IDS_VOCAB, (n,), generator=gen, dtype=torch.int64)


class TokenIdCompute:
    """A compute that routes by token id: ``hidden * (layer + 1) + id`` per row (exact in
    float32 for these small values), so a row paired with another row's id shows."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (layer, tokens) of calls given input_ids
        self.calls_without_ids = 0

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        topk: Any = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids is None:
            self.calls_without_ids += 1
            return hidden
        assert input_ids.dtype == torch.int64 and input_ids.shape == (hidden.shape[0],)
        self.calls.append((layer, int(hidden.shape[0])))
        return hidden * (layer + 1) + input_ids.unsqueeze(1).to(hidden.dtype)


def ids_ffn_main(port: int, q: Any) -> None:
    cfg = config("ffn", port, num_attention_ranks=2)
    compute = TokenIdCompute()
    svc = FFNService(cfg, 0, LAYERS, compute, lambda: ids_connector(cfg, 0))
    svc.start()
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and svc.stats.steps < len(STEPS) and not svc.failed:
        time.sleep(0.05)
    time.sleep(1.0)
    err = svc._error
    svc.stop()
    q.put(
        (
            "ffn",
            (compute.calls, compute.calls_without_ids),
            None if err is None else f"{type(err).__name__}: {err}",
        )
    )


def ids_attention_main(port: int, rank: int, q: Any, barrier: Any) -> None:
    cfg = config("attention", port, num_attention_ranks=2)
    conn = ids_connector(cfg, rank)
    conn.init()
    results: list[bool] = []
    for step, n in enumerate(STEPS):
        n = n + rank
        hidden = _hidden(n, rank, step)
        ids = _ids(n, rank, step)
        conn.send_control(AFDControlMessage(((n,),)))
        for layer in LAYERS:
            meta = AFDTransferMetadata(layer, 0, (n,))
            payload = AFDPayload(hidden, input_ids=ids)
            got = conn.recv_combine(conn.send_dispatch([payload], meta))[0]
            results.append(torch.equal(got, hidden * (layer + 1) + ids.unsqueeze(1).float()))
    barrier.wait(120)
    conn.send_control(AFDControlMessage.shutdown_message())
    conn.close()
    q.put((f"attention{rank}", all(results), len(results)))


def ffn_waiting_then_sigterm(port: int, q: Any) -> None:
    """An FFN service waiting for an Attention role that never comes; SIGTERM (handled like the
    FFN engine does: cancel startup, then the previous handler) must end the service thread
    without an error, well before its 60 s startup timeout."""
    import os
    import signal
    import threading
    import time

    from afd_runtime.signals import cancel_startup_on_signals

    signal.signal(signal.SIGTERM, lambda *_: None)  # stands in for vLLM's recording handler
    assert cancel_startup_on_signals()
    cfg = config("ffn", port, startup_timeout_s=60.0, connector="p2p")  # a real store wait
    svc = FFNService(cfg, 0, LAYERS, lambda *a: a[1], lambda: connector(cfg, 0))
    svc.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    ended = svc.wait(20.0)
    q.put(("ffn", ended, (time.monotonic() - t0, svc.failed, svc.deployments)))


#: Speculative decoding: target steps run LAYERS, draft steps (the MTP layer) only DRAFT_LAYER.
DRAFT_LAYER = 4
DRAFT_STEPS = ((6, False), (2, True), (2, True), (9, False), (3, True))


def draft_connector(cfg: AFDConfig, rank: int) -> Any:
    return create_connector(
        cfg, rank, payload_spec=spec(False), num_layers=DRAFT_LAYER + 1, num_draft_layers=1
    )


def draft_ffn_main(port: int, q: Any) -> None:
    cfg = config("ffn", port, connector="p2p")
    calls: list[tuple[int, int]] = []

    def compute(layer: int, hidden: torch.Tensor, logits: Any) -> torch.Tensor:
        calls.append((layer, int(hidden.shape[0])))
        return hidden * (layer + 1)

    svc = FFNService(
        cfg,
        0,
        (*LAYERS, DRAFT_LAYER),
        compute,
        lambda: draft_connector(cfg, 0),
        draft_layer_indices=(DRAFT_LAYER,),
    )
    svc.start()
    deadline = time.monotonic() + 200
    while time.monotonic() < deadline and svc.stats.steps < len(DRAFT_STEPS) and not svc.failed:
        time.sleep(0.05)
    time.sleep(1.0)
    err = svc._error
    svc.stop()
    q.put(("ffn", calls, None if err is None else f"{type(err).__name__}: {err}"))


def draft_attention_main(port: int, q: Any) -> None:
    cfg = config("attention", port, connector="p2p")
    conn = draft_connector(cfg, 0)
    conn.init()
    results: list[bool] = []
    for step, (n, draft) in enumerate(DRAFT_STEPS):
        hidden = _hidden(n, 0, step)
        conn.send_control(AFDControlMessage(((n,),), is_draft=draft))
        for layer in (DRAFT_LAYER,) if draft else LAYERS:
            meta = AFDTransferMetadata(layer, 0, (n,))
            got = conn.recv_combine(conn.send_dispatch([AFDPayload(hidden)], meta))[0]
            results.append(torch.equal(got, hidden * (layer + 1)))
    conn.send_control(AFDControlMessage.shutdown_message())
    conn.close()
    q.put(("attention", all(results), len(results)))


#: Steps served before the FFN rank stops while its Attention rank stays up (the FFN-first stop).
LEAVE_STEPS = (4, 2)


def leaving_ffn_main(port: int, q: Any) -> None:
    """An FFN service serves LEAVE_STEPS, then idles in ``recv_control`` and is stopped while
    its Attention rank stays up; ``stop()`` must return with the service thread ended (ended
    by the Attention rank closing after this rank's goodbye), without an error. Reports how
    long ``stop()`` took; the process then exits (its exit code is the test's other check)."""
    cfg = config("ffn", port, connector="p2p")
    svc = FFNService(
        cfg, 0, LAYERS, lambda layer, hidden, logits: hidden * 2, lambda: connector(cfg, 0)
    )
    svc.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and svc.stats.steps < len(LEAVE_STEPS) and not svc.failed:
        time.sleep(0.05)
    time.sleep(0.5)  # idle: blocked in the next recv_control
    t0 = time.monotonic()
    svc.stop()
    stopped_in = time.monotonic() - t0
    q.put(("ffn", svc.stats.steps, svc.wait(0.0), svc.failed, stopped_in))


def staying_attention_main(port: int, q: Any) -> None:
    """The Attention side of :func:`leaving_ffn_main`: steps through an AttentionLink, then
    stays up until its link reports the FFN rank gone (the supervisor closed the connector)."""
    from afd_runtime.attention_link import AttentionLink

    cfg = config("attention", port, connector="p2p")
    link = AttentionLink(connector(cfg, 0))
    link.connect()
    for step, n in enumerate(LEAVE_STEPS):
        with link.step() as conn:
            conn.send_control(AFDControlMessage(((n,),)))
            for layer in LAYERS:
                meta = AFDTransferMetadata(layer, 0, (n,))
                conn.recv_combine(conn.send_dispatch([AFDPayload(_hidden(n, 0, step))], meta))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and link.health() is None:
        time.sleep(0.05)
    down = link.health()
    # The supervisor now initialises the connector again, waiting for the FFN rank to return;
    # close() must end that wait and the thread (an exit with the thread inside a store call
    # aborted the process: exit code -6, seen in CI).
    time.sleep(0.3)
    reconnecting = link.is_reconnecting
    link.close()
    q.put(("attention", down, reconnecting, link.is_supervising, None))
