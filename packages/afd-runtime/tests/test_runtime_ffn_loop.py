"""The FFN engine loop: bounded waits on the service, client requests between, quiet readers."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest
from afd_runtime import patches


class _Cond:
    def __init__(self, is_reader: bool) -> None:
        self.is_reader = is_reader
        self.busy_loop_s = 1


class _Engine:
    """Records the RPCs and client requests the loop issues; stops after ``waits`` waits."""

    def __init__(self, waits: int, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.handled: list[tuple[Any, Any]] = []
        self.input_queue: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.readers = [_Cond(True), _Cond(True)]
        self.model_executor = SimpleNamespace(
            response_mqs=[SimpleNamespace(_spin_condition=c) for c in self.readers]
        )
        self._waits = waits
        self._fail_at = fail_at

    def is_running(self) -> bool:
        return sum(1 for c in self.calls if c[0] == "afd_ffn_wait") < self._waits

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        self.calls.append((method, args))
        waits = sum(1 for c in self.calls if c[0] == "afd_ffn_wait")
        if method == "afd_ffn_wait" and waits == 1:
            self.input_queue.put(("UTILITY", "ping"))
        if method == "afd_ffn_wait" and waits == self._fail_at:
            raise RuntimeError("Worker failed with error 'AFD FFN service loop failed: boom'")
        return [True]

    def _handle_client_request(self, req_type: Any, req: Any) -> None:
        self.handled.append((req_type, req))


def test_ffn_loop_waits_serves_requests_and_stops() -> None:
    engine = _Engine(waits=3)
    with pytest.raises(SystemExit):
        patches.ffn_busy_loop(engine)
    assert engine.calls == [
        ("afd_ffn_start", ()),
        ("afd_ffn_wait", (patches.FFN_WAIT_S,)),
        ("afd_ffn_wait", (patches.FFN_WAIT_S,)),
        ("afd_ffn_wait", (patches.FFN_WAIT_S,)),
        ("afd_ffn_stop", ()),
    ]
    assert engine.handled == [("UTILITY", "ping")]
    assert [c.busy_loop_s for c in engine.readers] == [0, 0]
    assert patches.FFN_WAIT_S > 1  # above vLLM's reader spin window: the worker reads asleep


def test_ffn_loop_in_process_executor_has_no_readers_to_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(patches.logger, "warning", lambda msg, *a: warnings.append(msg % a))
    engine = _Engine(waits=1)
    engine.model_executor = SimpleNamespace()  # vLLM's UniProcExecutor: no response queues
    with pytest.raises(SystemExit):
        patches.ffn_busy_loop(engine)
    assert engine.calls == [
        ("afd_ffn_start", ()),
        ("afd_ffn_wait", (patches.FFN_INPROCESS_WAIT_S,)),
        ("afd_ffn_stop", ()),
    ]
    assert warnings == []
    engine = _Engine(waits=1)
    engine.model_executor = SimpleNamespace(response_mqs=[])  # multiprocess, none found
    with pytest.raises(SystemExit):
        patches.ffn_busy_loop(engine)
    assert len(warnings) == 1 and "keep spinning" in warnings[0]


def test_ffn_loop_raises_the_service_error() -> None:
    engine = _Engine(waits=5, fail_at=2)
    with pytest.raises(RuntimeError, match="AFD FFN service loop failed: boom"):
        patches.ffn_busy_loop(engine)
    assert ("afd_ffn_stop", ()) not in engine.calls


def test_quiet_rpc_readers_only_touches_reader_conditions() -> None:
    reader, writer = _Cond(True), _Cond(False)
    executor = SimpleNamespace(
        response_mqs=[
            SimpleNamespace(_spin_condition=reader),
            SimpleNamespace(_spin_condition=writer),
        ]
    )
    assert patches.quiet_rpc_readers(executor) == 1
    assert (reader.busy_loop_s, writer.busy_loop_s) == (0, 1)
    assert patches.quiet_rpc_readers(executor) == 1  # idempotent
    assert patches.quiet_rpc_readers(SimpleNamespace()) == 0


def test_quiet_rpc_readers_matches_this_vllm() -> None:
    """The attributes quiet_rpc_readers relies on exist in the installed vLLM."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition

    assert "busy_loop_s" in inspect.signature(SpinCondition.__init__).parameters
    assert "_spin_condition" in inspect.getsource(MessageQueue.__init__)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    assert "response_mqs" in inspect.getsource(MultiprocExecutor)
