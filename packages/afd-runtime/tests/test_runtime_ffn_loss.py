"""The Attention server while its FFN role is lost (afd_runtime.ffn_loss), on vLLM's classes.

Fakes stand in for the engine core, its scheduler and the API server's engine client; the
patched methods are vLLM's own classes' attributes after :func:`install_ffn_loss_patches`.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from afd_core.errors import AFDPeerError
from afd_runtime import ffn_loss
from afd_runtime.attention_link import AFDFFNUnavailableError
from afd_runtime.ffn_loss import (
    FAILED_REQUESTS,
    STOP_REASON_PREFIX,
    ffn_loss_patches_applied,
    install_ffn_loss_patches,
)

pytestmark = pytest.mark.vllm_runtime

ATTENTION = {"afd": {"role": "attention", "ffn_loss_grace_s": 0}}  # fail at once (pre-0.6)
ERROR = AFDFFNUnavailableError(AFDPeerError(1, "recv_combine", "Connection closed by peer"))


@pytest.fixture(autouse=True)
def installed() -> None:
    install_ffn_loss_patches()
    install_ffn_loss_patches()  # idempotent
    assert ffn_loss_patches_applied()


class _Request:
    def __init__(self, rid: str, client: int) -> None:
        self.request_id = rid
        self.client_index = client
        self.trace_headers = None
        self.num_in_flight_tokens = 1  # the failed step scheduled one token for it

    def get_finished_reason(self) -> Any:
        from vllm.v1.engine import FinishReason

        return FinishReason.ERROR

    def take_events(self) -> None:
        return None


class _Scheduler:
    def __init__(self, requests: list[_Request]) -> None:
        self.requests = requests
        self.finished: list[Any] = []
        self.running: list[_Request] = list(requests)
        self.prefix_resets = 0

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert reset_running_requests
        self.prefix_resets += 1
        self.running = []
        return True

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_requests(self) -> bool:
        return True

    def schedule(self, throttle: bool) -> str:
        return "scheduler-output"

    def finish_requests(self, ids: Any, status: Any) -> list[_Request]:
        self.finished.append((ids, status))
        return self.requests


def _engine(additional_config: dict[str, Any], error: BaseException) -> Any:
    def execute_model(output: Any, non_block: bool = False) -> Any:
        raise error

    return SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config=additional_config),
        scheduler=_Scheduler([_Request("a", 0), _Request("b", 1), _Request("c", 0)]),
        model_executor=SimpleNamespace(execute_model=execute_model),
        _should_throttle_prefills=lambda: False,
    )


def test_with_no_grace_a_step_fails_every_request_with_the_error_text_and_keeps_the_engine() -> (
    None
):
    from vllm.v1.core.sched.output import SchedulerOutput  # noqa: F401  (vLLM importable)
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import RequestStatus

    engine = _engine(ATTENTION, ERROR)
    outputs, executed = EngineCore.step(engine)
    assert executed is False
    assert engine.scheduler.finished == [(None, RequestStatus.FINISHED_ERROR)]
    # The failed step's half-written blocks leave the prefix cache before the requests go.
    assert engine.scheduler.prefix_resets == 1
    assert sorted(outputs) == [0, 1]
    by_id = {o.request_id: o for outs in outputs.values() for o in outs.outputs}
    assert sorted(by_id) == ["a", "b", "c"]
    assert [o.request_id for o in outputs[0].outputs] == ["a", "c"]
    for out in by_id.values():
        assert out.finish_reason == FinishReason.ERROR and out.new_token_ids == []
        assert out.stop_reason == STOP_REASON_PREFIX + str(ERROR)


def test_step_reraises_other_errors_and_other_roles() -> None:
    from vllm.v1.engine.core import EngineCore

    with pytest.raises(ValueError, match="bug"):
        EngineCore.step(_engine(ATTENTION, ValueError("bug")))
    with pytest.raises(AFDFFNUnavailableError):  # not an AFD Attention server
        EngineCore.step(_engine({}, ERROR))


class _HoldScheduler(_Scheduler):
    """A scheduler with running and waiting requests and vLLM's preempt-all (recompute)."""

    def __init__(self, running: list[_Request], waiting: list[_Request]) -> None:
        super().__init__([])
        self.running, self.waiting = list(running), list(waiting)
        self.resets = 0

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        assert reset_running_requests
        self.resets += 1
        self.waiting[:0] = self.running
        self.running = []
        return True

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def finish_requests(self, ids: Any, status: Any) -> list[_Request]:
        done = self.running + self.waiting
        self.running, self.waiting = [], []
        self.finished.append((ids, status))
        return done


class _HoldWorld:
    """An Attention engine core whose FFN link is up or down, a clock and a sleep recorder."""

    def __init__(self, grace_s: float) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []
        self.link: str | None = None  # the workers' afd_attention_health reason
        from afd_runtime.metrics import AFDMetrics, RoleMetrics
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.hold = ffn_loss.FFNLossHold(
            grace_s,
            clock=lambda: self.now,
            sleep=self.sleeps.append,
            metrics=RoleMetrics("attention", 0, AFDMetrics(self.registry)),
        )
        self.scheduler = _HoldScheduler([_Request("a", 0), _Request("b", 0)], [_Request("c", 0)])
        self.engine = SimpleNamespace(
            scheduler=self.scheduler,
            model_executor=SimpleNamespace(collective_rpc=lambda name: [self.link]),
        )
        self.executed = 0
        self.flushes = 0

    def original(self, engine: Any) -> tuple[dict[int, Any], bool]:
        if not engine.scheduler.has_unfinished_requests():
            self.flushes += 1  # vLLM's step with nothing to run: no forward, finished flushed
            return {}, False
        if self.link is not None:
            raise ERROR
        self.executed += 1
        engine.scheduler.running = engine.scheduler.running + engine.scheduler.waiting
        engine.scheduler.waiting = []
        return {0: "outputs"}, True

    def step(self) -> tuple[dict[int, Any], bool]:
        return self.hold.step(self.engine, self.original)

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(name, {"role": "attention", "rank": "0"})


def test_an_ffn_loss_holds_the_requests_and_they_resume_when_the_link_is_back() -> None:
    world = _HoldWorld(grace_s=60.0)
    world.link = "FFN world rank 1 lost"
    assert world.step() == ({}, False)  # the failed step: held, not failed
    sched = world.scheduler
    assert sched.resets == 1 and sched.running == [] and len(sched.waiting) == 3
    # The failed step's tokens never come back: no stale output is left to drain.
    assert [r.num_in_flight_tokens for r in sched.waiting] == [0, 0, 1]  # c was not running
    assert sched.finished == [] and world.hold.down_since == 100.0 and world.hold.holds == 1
    for _ in range(3):  # still down, within the grace: nothing scheduled, the engine waits
        world.now += 10.0
        assert world.step() == ({}, False)
    assert world.sleeps == [ffn_loss.HOLD_POLL_S] * 3 and world.executed == 0
    assert world.metric("afd_ffn_loss_holds_total") == 1 and world.metric("afd_held_requests") == 3
    sched.waiting.append(_Request("d", 1))  # a request arriving during the hold waits too
    world.step()
    assert world.metric("afd_held_requests") == 4
    world.link = None  # the FFN role is back: the held requests are scheduled again
    assert world.step() == ({0: "outputs"}, True)
    assert world.executed == 1 and len(sched.running) == 4 and sched.finished == []
    assert world.hold.down_since is None and world.hold.resumes == 1
    assert world.metric("afd_held_requests") == 0
    assert world.metric("afd_ffn_loss_failed_requests_total") == 0


def test_past_the_grace_the_held_requests_fail_and_new_ones_fail_fast_until_the_link_is_back() -> (
    None
):
    from vllm.v1.request import RequestStatus

    world = _HoldWorld(grace_s=30.0)
    world.link = "AFD FFN role unavailable: FFN world rank 1 lost"
    assert world.step() == ({}, False)
    world.now += 29.0
    assert world.step() == ({}, False) and world.scheduler.finished == []  # not before
    world.now += 1.0
    outputs, executed = world.step()
    assert executed is False and world.scheduler.finished == [(None, RequestStatus.FINISHED_ERROR)]
    texts = {o.stop_reason for outs in outputs.values() for o in outs.outputs}
    assert len(texts) == 1
    (text,) = texts
    assert text.startswith(STOP_REASON_PREFIX + "AFD FFN role unavailable: FFN world rank 1 lost")
    assert "requests held 30s: ffn_loss_grace_s" in text
    assert world.hold.expired
    assert world.metric("afd_ffn_loss_failed_requests_total") == 3
    assert world.metric("afd_held_requests") == 0
    world.scheduler.waiting.append(_Request("late", 0))  # still down: fails at the next step
    outputs, _ = world.step()
    assert [o.request_id for outs in outputs.values() for o in outs.outputs] == ["late"]
    assert world.metric("afd_ffn_loss_failed_requests_total") == 4
    # Nothing left to hold: vLLM's own step runs (it flushes the finished requests; a SIGTERM's
    # drain waits for that), no sleep, no forward.
    sleeps = len(world.sleeps)
    assert world.step() == ({}, False)
    assert world.flushes == 1 and len(world.sleeps) == sleeps
    world.link = None  # back: serving again, a fresh grace for the next loss
    world.scheduler.waiting.append(_Request("e", 0))
    assert world.step() == ({0: "outputs"}, True)
    assert not world.hold.expired and world.hold.down_since is None


def test_failed_request_answers_with_the_afd_text_others_keep_vllm_s() -> None:
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError

    FAILED_REQUESTS.note("cmpl-1-0", "AFD FFN role unavailable: FFN world rank 1 (...)")
    with pytest.raises(GenerationError, match=r"^AFD FFN role unavailable: FFN world rank 1"):
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-1")  # sub-request "-0"
    assert FAILED_REQUESTS.pop("cmpl-1") is None  # consumed
    with pytest.raises(GenerationError, match=r"^Internal server error$"):
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-2")
    GenerateBaseServing._raise_if_error(None, "length", "cmpl-3")  # no error: no raise


def test_output_processor_notes_the_text_under_the_external_request_id() -> None:
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    processor = SimpleNamespace(
        request_states={"int-7": SimpleNamespace(external_req_id="cmpl-7-0")},
    )
    out = EngineCoreOutput(
        request_id="int-7",
        new_token_ids=[],
        finish_reason=FinishReason.ERROR,
        stop_reason=STOP_REASON_PREFIX + "AFD FFN role unavailable: x",
    )
    # The wrapper notes the text, then runs vLLM's body, which the fake cannot satisfy.
    with pytest.raises(AttributeError):
        OutputProcessor.process_outputs(processor, [out])
    assert FAILED_REQUESTS.pop("cmpl-7") == "AFD FFN role unavailable: x"


def _client(reasons: list[Any], delay_s: float = 0.0) -> Any:
    async def call_all(method: str) -> list[Any]:
        assert method == "afd_attention_health"
        await asyncio.sleep(delay_s)
        return reasons

    return SimpleNamespace(
        errored=False,
        vllm_config=SimpleNamespace(additional_config=ATTENTION),
        engine_core=SimpleNamespace(call_utility_all_async=call_all),
    )


def test_health_is_unhealthy_while_any_rank_has_lost_its_ffn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    asyncio.run(AsyncLLM.check_health(_client([None, None])))  # healthy
    with pytest.raises(EngineDeadError) as err:
        asyncio.run(AsyncLLM.check_health(_client([None, "AFD FFN role unavailable: gone"])))
    assert str(err.value) == "AFD FFN role unavailable: gone"
    # An engine busy in a long step does not answer in time: counted healthy.
    monkeypatch.setattr(ffn_loss, "HEALTH_RPC_TIMEOUT_S", 0.05)
    asyncio.run(AsyncLLM.check_health(_client(["late"], delay_s=1.0)))


def test_engine_health_rpc_reports_the_first_rank_reason() -> None:
    from vllm.v1.engine.core import EngineCore

    def rpc(results: list[Any]) -> Any:
        return SimpleNamespace(model_executor=SimpleNamespace(collective_rpc=lambda name: results))

    assert EngineCore.afd_attention_health(rpc([None])) is None
    assert EngineCore.afd_attention_health(rpc([None, "down"])) == "down"


def test_a_stopping_engine_fails_its_held_requests_at_once() -> None:
    """vLLM's SIGTERM drain cannot finish a held request: the hold fails them before the grace
    instead of leaving the drain to time out and kill the engine core."""
    from vllm.v1.engine.core import EngineShutdownState

    world = _HoldWorld(grace_s=60.0)
    world.link = "AFD FFN role unavailable: FFN world rank 1 lost"
    assert world.step() == ({}, False)
    world.engine.shutdown_state = EngineShutdownState.REQUESTED
    world.now += 1.0
    outputs, _ = world.step()
    texts = {o.stop_reason for outs in outputs.values() for o in outs.outputs}
    assert len(texts) == 1 and "the Attention server is stopping" in texts.pop()
    assert not world.scheduler.has_unfinished_requests()
