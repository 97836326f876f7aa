"""A stand-in for :class:`afd_models.demo.servers.VLLMServer` in harness tests (no engine).

It records ``start`` / ``stop`` / ``alive`` events in order and returns a fixed log text, so a
test can check which servers a driver started, waited for and stopped, and what it parsed.
"""

from __future__ import annotations


class FakeServer:
    def __init__(self, name: str, log: str, events: list[str]) -> None:
        self.name = name
        self.base_url = f"http://fake/{name}"
        self.pid = None
        self._log = log
        self._events = events

    def start(self) -> None:
        self._events.append(f"start {self.name}")

    def stop(self, timeout_s: float = 60.0) -> None:
        self._events.append(f"stop {self.name}")

    def check_alive(self) -> None:
        self._events.append(f"alive {self.name}")

    def log_text(self) -> str:
        return self._log
