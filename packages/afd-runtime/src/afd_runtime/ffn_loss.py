"""What an Attention server does while its FFN role is lost: vLLM patches (0.32.x).

The Attention worker's :class:`~afd_runtime.attention_link.AttentionLink` turns every step that
the FFN role could not serve into :class:`~afd_runtime.attention_link.AFDFFNUnavailableError`
and reconnects in the background. Without these patches vLLM would treat that error as fatal
(the engine core dies, every request gets "EngineCore encountered an issue", the server exits).
With them, on the Attention role only:

1. ``EngineCore.step`` (:func:`fail_requests_on_ffn_loss`): the step's error finishes every
   request of the engine (running and waiting) with vLLM's request-level error status
   (``FINISHED_ERROR``); the engine stays up and serves again once the link is back. The
   requests' ``stop_reason`` carries the error text, prefixed :data:`STOP_REASON_PREFIX`.
2. ``OutputProcessor.process_outputs`` and ``GenerateBaseServing._raise_if_error`` (API server):
   a request that failed so answers HTTP 500 with that text ("AFD FFN role unavailable: ...")
   instead of vLLM's bare "Internal server error"; other errors are untouched.
3. ``EngineCore.afd_attention_health`` (a utility method) and ``AsyncLLM.check_health``: the
   server's ``/health`` answers 503 while any Attention rank's link is down (the workers'
   ``afd_attention_health``); a health RPC that gets no answer within
   :data:`HEALTH_RPC_TIMEOUT_S` (the engine is inside a long step) counts as healthy.

Invariants: each patch is idempotent (a marker attribute), installed only by
:func:`install_ffn_loss_patches` after the vLLM version check, and a no-op for servers without
an AFD Attention role.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from typing import Any, Final

from afd_core.config import AFDRole, parse_afd_config

from afd_runtime.attention_link import AFDFFNUnavailableError

logger = logging.getLogger(__name__)

#: ``stop_reason`` prefix of requests failed by an FFN loss (the rest is the error text).
STOP_REASON_PREFIX: Final[str] = "afd_ffn_unavailable: "
#: How long ``/health`` waits for the engine's answer before counting it as healthy.
HEALTH_RPC_TIMEOUT_S: Final[float] = 5.0
#: How many failed requests' texts the API server remembers until their response is written.
_REMEMBERED: Final[int] = 4096
_MARK: Final[str] = "_afd_ffn_loss_patched"


def _is_attention(vllm_config: Any) -> bool:
    cfg = parse_afd_config(getattr(vllm_config, "additional_config", None))
    return cfg is not None and cfg.role is AFDRole.ATTENTION


def fail_requests_on_ffn_loss(engine_core: Any, error: AFDFFNUnavailableError) -> dict[int, Any]:
    """Finish every request of ``engine_core`` with ``FINISHED_ERROR``; their outputs by client.

    Each output's ``stop_reason`` is :data:`STOP_REASON_PREFIX` + ``str(error)``."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.request import RequestStatus

    reason = STOP_REASON_PREFIX + str(error)
    failed = engine_core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[Any]] = collections.defaultdict(list)
    for request in failed:
        by_client[request.client_index].append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                stop_reason=reason,
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )
    logger.error("AFD Attention: %d request(s) failed: %s", len(failed), error)
    return {client: EngineCoreOutputs(outputs=outs) for client, outs in by_client.items()}


class _FailedRequests:
    """API server side: the error text of requests failed by an FFN loss, by external id."""

    def __init__(self) -> None:
        self._texts: collections.OrderedDict[str, str] = collections.OrderedDict()

    def note(self, request_id: str, text: str) -> None:
        self._texts[request_id] = text
        while len(self._texts) > _REMEMBERED:
            self._texts.popitem(last=False)

    def pop(self, request_id: str) -> str | None:
        """The text of ``request_id`` or of one of its sub-requests (``<id>-<n>``)."""
        text = self._texts.pop(request_id, None)
        if text is not None:
            return text
        prefix = request_id + "-"
        for key in [k for k in self._texts if k.startswith(prefix)]:
            text = self._texts.pop(key)
        return text


FAILED_REQUESTS = _FailedRequests()


def _health_error(reason: str) -> Exception:
    """vLLM's ``EngineDeadError`` (what ``/health`` turns into 503) carrying ``reason``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    err = EngineDeadError()
    err.args = (reason,)
    return err


def _patch(owner: Any, name: str, make: Any) -> None:
    original = getattr(owner, name, None)
    if original is not None and getattr(original, _MARK, False):
        return
    patched = make(original)
    setattr(patched, _MARK, True)
    setattr(owner, name, patched)


def install_ffn_loss_patches() -> None:
    """Install the patches of the module docstring (idempotent; caller checked the version)."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.output_processor import OutputProcessor

    def make_step(original: Any) -> Any:
        @functools.wraps(original)
        def step(self: Any) -> Any:
            try:
                return original(self)
            except AFDFFNUnavailableError as err:
                if not _is_attention(self.vllm_config):
                    raise
                return fail_requests_on_ffn_loss(self, err), False

        return step

    def make_health_rpc(original: Any) -> Any:
        def afd_attention_health(self: Any) -> str | None:
            for reason in self.model_executor.collective_rpc("afd_attention_health"):
                if reason:
                    return str(reason)
            return None

        return afd_attention_health

    def make_check_health(original: Any) -> Any:
        @functools.wraps(original)
        async def check_health(self: Any) -> None:
            await original(self)
            if not _is_attention(self.vllm_config):
                return
            client = self.engine_core
            call = getattr(client, "call_utility_all_async", None)
            try:
                if call is not None:
                    reasons = await asyncio.wait_for(
                        call("afd_attention_health"), HEALTH_RPC_TIMEOUT_S
                    )
                else:
                    reasons = [
                        await asyncio.wait_for(
                            client.call_utility_async("afd_attention_health"),
                            HEALTH_RPC_TIMEOUT_S,
                        )
                    ]
            except TimeoutError:
                return
            for reason in reasons:
                if reason:
                    raise _health_error(str(reason))

        return check_health

    def make_process_outputs(original: Any) -> Any:
        @functools.wraps(original)
        def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kw: Any) -> Any:
            for out in engine_core_outputs:
                reason = out.stop_reason
                if isinstance(reason, str) and reason.startswith(STOP_REASON_PREFIX):
                    state = self.request_states.get(out.request_id)
                    external = getattr(state, "external_req_id", None) or out.request_id
                    FAILED_REQUESTS.note(external, reason[len(STOP_REASON_PREFIX) :])
            return original(self, engine_core_outputs, *args, **kw)

        return process_outputs

    def make_raise_if_error(original: Any) -> Any:
        @functools.wraps(original)
        def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
            if finish_reason == "error":
                text = FAILED_REQUESTS.pop(request_id)
                if text is not None:
                    from vllm.exceptions import GenerationError

                    logger.error("Request %s failed: %s", request_id, text)
                    raise GenerationError(text)
            return original(self, finish_reason, request_id)

        return _raise_if_error

    _patch(EngineCore, "step", make_step)
    _patch(EngineCore, "afd_attention_health", make_health_rpc)
    _patch(AsyncLLM, "check_health", make_check_health)
    _patch(OutputProcessor, "process_outputs", make_process_outputs)
    _patch(GenerateBaseServing, "_raise_if_error", make_raise_if_error)


def ffn_loss_patches_applied() -> bool:
    """True when every patch of this module is installed."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.output_processor import OutputProcessor

    return all(
        getattr(getattr(owner, name, None), _MARK, False)
        for owner, name in (
            (EngineCore, "step"),
            (EngineCore, "afd_attention_health"),
            (AsyncLLM, "check_health"),
            (OutputProcessor, "process_outputs"),
            (GenerateBaseServing, "_raise_if_error"),
        )
    )
