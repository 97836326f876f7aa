"""AFD's Prometheus metrics (``afd_*``), served on each role's vLLM ``/metrics`` endpoint.

Where the counters live: an AFD role's worker (and the FFN service thread) runs inside vLLM's
engine core process, while ``/metrics`` is served by the API server process. vLLM's own answer
to that is prometheus_client's multiprocess mode: with ``PROMETHEUS_MULTIPROC_DIR`` set, every
process writes its metric values to memory-mapped files in that directory and the API server's
``/metrics`` collects them all (``vllm.v1.metrics.prometheus.get_prometheus_registry``). vLLM
turns it on itself when it runs several API servers (``--data-parallel-size 2`` on one host);
:func:`enable_multiprocess_metrics` (called by patch (3) of :mod:`afd_runtime.patches` in the
API server process, in ``MPClient.__init__`` before it starts the engine cores) turns it on for
every AFD role with vLLM's own
:func:`~vllm.v1.metrics.prometheus.setup_multiprocess_prometheus`: a fresh temporary directory
per ``vllm serve`` process, removed when it exits, so no value of an earlier run leaks in. Each
FFN rank is its own ``vllm serve`` and so has its own directory and ``/metrics``. In the engine
core, the worker calls :func:`adopt_multiprocess_values` before it creates its series.

The metric objects (:data:`METRICS`, an :class:`AFDMetrics` in prometheus_client's default
registry) are created here at import; a labelled series is created (and picks
prometheus_client's value class) at its first use, in the engine core. Every series carries
``role`` (``attention`` / ``ffn``) and ``rank`` (the role rank); per-layer series add ``layer``
(the decoder layer index). Gauges use ``multiprocess_mode="mostrecent"``. The README's
"Metrics" table is the reference; ``test_runtime_metrics`` checks that the two agree.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Final

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, values

logger = logging.getLogger(__name__)

MULTIPROC_ENV: Final[str] = "PROMETHEUS_MULTIPROC_DIR"

_ROLE: Final[tuple[str, str]] = ("role", "rank")
_LAYER: Final[tuple[str, str, str]] = ("role", "rank", "layer")

#: Token-count buckets (tokens per FFN compute call).
TOKEN_BUCKETS: Final[tuple[float, ...]] = tuple(float(2**i) for i in range(15))
#: Wait buckets (seconds an Attention rank waits for one FFN reply).
WAIT_BUCKETS: Final[tuple[float, ...]] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
)  # fmt: skip


class AFDMetrics:
    """Every ``afd_*`` metric, registered in ``registry`` (the process's default registry for
    :data:`METRICS`; a test builds its own to render what a role exposes)."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        # -- both roles
        self.param_bytes = Gauge(
            "afd_param_bytes",
            "Weight bytes this role rank holds (afd_runtime.roles.model_param_bytes).",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.startup_phase = Gauge(
            "afd_startup_phase_timestamp_seconds",
            "Unix time this role rank reached a startup phase (load, loaded, connected).",
            (*_ROLE, "phase"),
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.link_up = Gauge(
            "afd_link_up",
            "1 while this role rank's connector is paired with its peer role, else 0.",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.connections = Counter(
            "afd_connections",
            "Connector initialisations that paired with the peer role (the first one included).",
            _ROLE,
            registry=registry,
        )
        self.reconnects = Counter(
            "afd_reconnects",
            "Attention side: re-pairings with the FFN role after a loss.",
            _ROLE,
            registry=registry,
        )
        self.refusals = Counter(
            "afd_refusals",
            "FFN side: Attention deployments refused at the handshake (it keeps waiting).",
            _ROLE,
            registry=registry,
        )
        self.steps = Counter(
            "afd_steps",
            "Steps served: Attention forwards announced, FFN control messages served.",
            _ROLE,
            registry=registry,
        )
        self.step_tokens = Counter(
            "afd_step_tokens",
            "Tokens announced per step, summed over stages (FFN: over every served Attention rank).",
            _ROLE,
            registry=registry,
        )
        self.bytes_received = Counter(
            "afd_received_bytes",
            "Payload bytes received (FFN: from its Attention ranks; Attention: FFN replies).",
            _ROLE,
            registry=registry,
        )
        self.bytes_sent = Counter(
            "afd_sent_bytes",
            "Payload bytes sent (FFN: replies; Attention: hidden states, logits, ids, top-k).",
            _ROLE,
            registry=registry,
        )

        # -- Attention role: requests held across an FFN loss (afd_runtime.ffn_loss)
        self.ffn_loss_holds = Counter(
            "afd_ffn_loss_holds",
            "Attention side: FFN losses that held this engine's requests (hold episodes).",
            _ROLE,
            registry=registry,
        )
        self.held_requests = Gauge(
            "afd_held_requests",
            "Attention side: requests held now while the FFN role is away (0 when serving).",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.ffn_loss_failed = Counter(
            "afd_ffn_loss_failed_requests",
            "Attention side: requests failed because the FFN role stayed away (past "
            "ffn_loss_grace_s, or at once with a grace of 0).",
            _ROLE,
            registry=registry,
        )

        # -- FFN role
        self.ffn_compute_calls = Counter(
            "afd_ffn_compute_calls",
            "FFN compute calls per MoE layer (one per (layer, stage) with tokens, batched over peers).",
            _LAYER,
            registry=registry,
        )
        self.ffn_tokens_per_call = Histogram(
            "afd_ffn_tokens_per_call",
            "Tokens of one FFN compute call (all served Attention ranks together).",
            _ROLE,
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.ffn_peers = Gauge(
            "afd_ffn_peers",
            "Attention ranks this FFN rank serves.",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.ffn_member = Gauge(
            "afd_ffn_member",
            "Attention: 1 while FFN slot ffn_rank serves this rank's current round, else 0 "
            "(elastic FFN ranks, expert_replicas > 1: a lost slot reads 0 until it rejoins).",
            (*_ROLE, "ffn_rank"),
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.experts_held = Gauge(
            "afd_experts_held",
            "FFN: routed experts this FFN rank holds (its share; with expert_replicas R, the "
            "ranges of R neighbouring slots).",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.ffn_layers = Gauge(
            "afd_ffn_layers",
            "MoE layers this FFN rank serves.",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.quant_expert_bytes = Gauge(
            "afd_ffn_quantized_expert_bytes",
            "Bytes of this FFN rank's quantized routed experts.",
            (*_ROLE, "compute", "scheme", "group_size"),
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.quant_bf16_bytes = Gauge(
            "afd_ffn_quantized_bf16_bytes",
            "Bytes the same routed experts take in bf16.",
            _ROLE,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.quant_error = Gauge(
            "afd_ffn_quant_error_max_rel",
            "Max over calls of max|y - ref| / max|ref| of a quantized layer against fp32 "
            "(only when the model measures it).",
            _LAYER,
            multiprocess_mode="mostrecent",
            registry=registry,
        )
        self.quant_error_calls = Counter(
            "afd_ffn_quant_error_calls",
            "Calls the quantized layer's error was measured on.",
            _LAYER,
            registry=registry,
        )
        self.compute_signature = Gauge(
            "afd_ffn_compute_signature_info",
            "1 for each layer's compute graph signature digest (label signature).",
            (*_LAYER, "compute", "signature"),
            multiprocess_mode="mostrecent",
            registry=registry,
        )

        # -- Attention role
        self.attention_ffn_wait = Histogram(
            "afd_attention_ffn_wait_seconds",
            "Seconds an Attention rank waited for the FFN reply of one (layer, stage).",
            _LAYER,
            buckets=WAIT_BUCKETS,
            registry=registry,
        )

    def all(self) -> tuple[Any, ...]:
        """Every metric, in the README table's order."""
        return (
            self.param_bytes,
            self.startup_phase,
            self.link_up,
            self.connections,
            self.reconnects,
            self.refusals,
            self.steps,
            self.step_tokens,
            self.bytes_received,
            self.bytes_sent,
            self.ffn_compute_calls,
            self.ffn_tokens_per_call,
            self.ffn_peers,
            self.ffn_member,
            self.experts_held,
            self.ffn_layers,
            self.quant_expert_bytes,
            self.quant_bf16_bytes,
            self.quant_error,
            self.quant_error_calls,
            self.compute_signature,
            self.ffn_loss_holds,
            self.held_requests,
            self.ffn_loss_failed,
            self.attention_ffn_wait,
        )


#: The metrics every AFD process publishes (prometheus_client's default registry).
METRICS: Final[AFDMetrics] = AFDMetrics()


def multiprocess_enabled() -> bool:
    """True when prometheus_client writes this process's values to ``PROMETHEUS_MULTIPROC_DIR``."""
    return bool(os.environ.get(MULTIPROC_ENV)) and values.ValueClass is not values.MutexValue


def enable_multiprocess_metrics() -> str:
    """Turn on prometheus_client's multiprocess mode in this (API server) process, the way vLLM
    does for several API servers; returns the directory. Idempotent.

    Without ``PROMETHEUS_MULTIPROC_DIR``, vLLM's ``setup_multiprocess_prometheus`` creates a
    fresh temporary directory (removed at exit) and sets the variable, which the engine core
    processes started next inherit. prometheus_client chose its value class when it was
    imported (before this runs), so it is chosen again here: metrics created from now on in
    this process (vLLM's stat loggers, built after the engine client) and in forked children
    write to the directory. A directory set by the user is kept (vLLM warns it must be empty)."""
    if not os.environ.get(MULTIPROC_ENV):
        from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

        setup_multiprocess_prometheus()
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.get_value_class()
    return os.environ[MULTIPROC_ENV]


def adopt_multiprocess_values() -> bool:
    """In an engine core: when ``PROMETHEUS_MULTIPROC_DIR`` is set but prometheus_client chose
    its in-memory values before (a process forked from one that imported it earlier), choose
    again, so this process's afd_* values reach the directory. True when multiprocess is on."""
    if os.environ.get(MULTIPROC_ENV) and values.ValueClass is values.MutexValue:
        values.ValueClass = values.get_value_class()
    return multiprocess_enabled()


class RoleMetrics:
    """The ``afd_*`` series of one role rank (labels bound once)."""

    def __init__(self, role: str, rank: int, metrics: AFDMetrics = METRICS) -> None:
        self.role = role
        self._m = m = metrics
        self.rank = rank
        self._labels = {"role": role, "rank": str(rank)}
        self.steps = m.steps.labels(**self._labels)
        self.step_tokens = m.step_tokens.labels(**self._labels)
        self.received = m.bytes_received.labels(**self._labels)
        self.sent = m.bytes_sent.labels(**self._labels)
        self.link_up = m.link_up.labels(**self._labels)
        self.connections = m.connections.labels(**self._labels)
        self.reconnects = m.reconnects.labels(**self._labels)
        self.refusals = m.refusals.labels(**self._labels)
        self.tokens_per_call = m.ffn_tokens_per_call.labels(**self._labels)
        self.ffn_loss_holds = m.ffn_loss_holds.labels(**self._labels)
        self.held_requests = m.held_requests.labels(**self._labels)
        self.ffn_loss_failed = m.ffn_loss_failed.labels(**self._labels)
        self._calls: dict[int, Any] = {}
        self._waits: dict[int, Any] = {}

    def phase(self, name: str) -> None:
        """Record that this rank reached startup phase ``name`` now."""
        self._m.startup_phase.labels(**self._labels, phase=name).set(time.time())

    def param_bytes(self, n: int) -> None:
        self._m.param_bytes.labels(**self._labels).set(n)

    def connected(self) -> None:
        """The connector paired with the peer role."""
        self.connections.inc()
        self.link_up.set(1)
        self.phase("connected")

    def ffn_members(self, num_slots: int, members: tuple[int, ...]) -> None:
        """Attention: which of the ``num_slots`` FFN slots serve the current round."""
        for slot in range(num_slots):
            self._m.ffn_member.labels(**self._labels, ffn_rank=str(slot)).set(
                1 if slot in members else 0
            )

    def experts_held(self, n: int) -> None:
        """FFN: how many routed experts this rank holds."""
        self._m.experts_held.labels(**self._labels).set(n)

    def ffn_shape(self, peers: int, layers: int) -> None:
        self._m.ffn_peers.labels(**self._labels).set(peers)
        self._m.ffn_layers.labels(**self._labels).set(layers)

    def compute_call(self, layer: int, tokens: int) -> None:
        """One FFN compute call of ``tokens`` tokens on ``layer``."""
        child = self._calls.get(layer)
        if child is None:
            child = self._calls[layer] = self._m.ffn_compute_calls.labels(
                **self._labels, layer=str(layer)
            )
        child.inc()
        self.tokens_per_call.observe(tokens)

    def ffn_wait(self, layer: int, seconds: float) -> None:
        """An Attention rank waited ``seconds`` for the FFN reply of ``layer``."""
        child = self._waits.get(layer)
        if child is None:
            child = self._waits[layer] = self._m.attention_ffn_wait.labels(
                **self._labels, layer=str(layer)
            )
        child.observe(seconds)

    def quantized(
        self, compute: str, scheme: str, group_size: int, nbytes: int, bf16_bytes: int
    ) -> None:
        self._m.quant_expert_bytes.labels(
            **self._labels, compute=compute, scheme=scheme, group_size=str(group_size)
        ).set(nbytes)
        self._m.quant_bf16_bytes.labels(**self._labels).set(bf16_bytes)

    def signature(self, layer: int, compute: str, digest: str) -> None:
        self._m.compute_signature.labels(
            **self._labels, layer=str(layer), compute=compute, signature=digest
        ).set(1)

    def quant_error(self, layer: int, max_rel: float) -> None:
        """One measured call of ``layer``; ``max_rel`` is the max so far."""
        self._m.quant_error_calls.labels(**self._labels, layer=str(layer)).inc()
        self._m.quant_error.labels(**self._labels, layer=str(layer)).set(max_rel)


def _tensor_bytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _payload_bytes(payload: Any) -> int:
    return sum(_tensor_bytes(t) for t in payload.tensors().values())


def instrument_attention_connector(connector: Any, metrics: RoleMetrics) -> None:
    """Count an Attention rank's traffic and time its waits for the FFN on this connector
    object (its own attributes; the class is untouched; idempotent): ``send_dispatch`` adds its
    payload bytes to ``afd_sent_bytes``; ``recv_combine`` observes its wait in
    ``afd_attention_ffn_wait_seconds`` (per layer) and adds the reply bytes to
    ``afd_received_bytes``."""
    if getattr(connector, "_afd_instrumented", False):
        return
    send = connector.send_dispatch
    receive = connector.recv_combine

    def send_dispatch(payloads: Any, metadata: Any) -> Any:
        handle = send(payloads, metadata)
        metrics.sent.inc(sum(_payload_bytes(p) for p in payloads))
        return handle

    def recv_combine(handle: Any) -> Any:
        t0 = time.perf_counter()
        replies = receive(handle)
        metrics.ffn_wait(int(handle.metadata.layer_idx), time.perf_counter() - t0)
        metrics.received.inc(sum(_tensor_bytes(t) for t in replies))
        return replies

    connector.send_dispatch = send_dispatch
    connector.recv_combine = recv_combine
    connector._afd_instrumented = True
