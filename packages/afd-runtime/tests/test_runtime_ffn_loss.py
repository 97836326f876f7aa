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

ATTENTION = {"afd": {"role": "attention"}}
ERROR = AFDFFNUnavailableError(AFDPeerError(1, "recv_ffn_output", "Connection closed by peer"))


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

    def get_finished_reason(self) -> Any:
        from vllm.v1.engine import FinishReason

        return FinishReason.ERROR

    def take_events(self) -> None:
        return None


class _Scheduler:
    def __init__(self, requests: list[_Request]) -> None:
        self.requests = requests
        self.finished: list[Any] = []

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


def test_step_fails_every_request_with_the_error_text_and_keeps_the_engine() -> None:
    from vllm.v1.core.sched.output import SchedulerOutput  # noqa: F401  (vLLM importable)
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.request import RequestStatus

    engine = _engine(ATTENTION, ERROR)
    outputs, executed = EngineCore.step(engine)
    assert executed is False
    assert engine.scheduler.finished == [(None, RequestStatus.FINISHED_ERROR)]
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
