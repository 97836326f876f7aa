"""Stand-ins for :class:`afd_models.demo.servers.VLLMServer` in harness tests (no engine).

:class:`FakeServer` records ``start`` / ``stop`` / ``alive`` / ``metrics`` events in order and
answers a fixed text for both its log and its ``/metrics``, so a test can check which servers a
driver started, waited for, read and stopped, and what it parsed. :class:`MetricsText` renders
what an AFD role's ``/metrics`` shows, with afd-runtime's own metric definitions
(:class:`afd_runtime.metrics.AFDMetrics` in a fresh registry, so values start at zero).
"""

from __future__ import annotations

from afd_runtime.metrics import AFDMetrics, RoleMetrics
from prometheus_client import CollectorRegistry, generate_latest


class FakeServer:
    def __init__(self, name: str, text: str, events: list[str]) -> None:
        self.name = name
        self.base_url = f"http://fake/{name}"
        self.pid = None
        self._text = text
        self._events = events

    def start(self) -> None:
        self._events.append(f"start {self.name}")

    def stop(self, timeout_s: float = 60.0) -> None:
        self._events.append(f"stop {self.name}")

    def restarted(self) -> FakeServer:
        self._events.append(f"restarted {self.name}")
        return FakeServer(self.name, self._text, self._events)

    def check_alive(self) -> None:
        self._events.append(f"alive {self.name}")

    def log_text(self) -> str:
        return self._text

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        self._events.append(f"metrics {self.name}")
        return self._text


class MetricsText:
    """One server's ``/metrics`` text, built through afd-runtime's :class:`RoleMetrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.metrics = AFDMetrics(self.registry)

    def role(self, role: str, rank: int) -> RoleMetrics:
        return RoleMetrics(role, rank, self.metrics)

    def param_bytes(self, role: str, rank: int, n: int) -> MetricsText:
        self.role(role, rank).param_bytes(n)
        return self

    def ffn(
        self,
        rank: int,
        *,
        steps: int,
        calls: int,
        tokens: int,
        nbytes: int,
        peers: int,
        layers: int,
    ) -> MetricsText:
        """An FFN rank that served ``steps`` steps and ``calls`` compute calls (spread over
        layers ``0..layers-1`` in turn) of ``tokens`` tokens, receiving ``nbytes``."""
        m = self.role("ffn", rank)
        m.ffn_shape(peers, layers)
        m.steps.inc(steps)
        m.received.inc(nbytes)
        for i in range(calls):
            m.compute_call(i % layers, tokens if i == 0 else 0)
        return self

    def quantized(
        self, rank: int, kind: str, scheme: str, group: int, nbytes: int, bf16: int, layers: int
    ) -> MetricsText:
        m = self.role("ffn", rank)
        m.quantized(kind, scheme, group, nbytes, bf16)
        for layer in range(layers):
            m.signature(layer, kind, f"{rank:02x}{layer:02x}" * 16)
        return self

    def quant_error(self, rank: int, layer: int, calls: int, max_rel: float) -> MetricsText:
        m = self.role("ffn", rank)
        for _ in range(calls):
            m.quant_error(layer, max_rel)
        return self

    def text(self) -> str:
        return generate_latest(self.registry).decode()
