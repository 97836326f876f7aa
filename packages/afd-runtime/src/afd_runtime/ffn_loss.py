"""What an Attention server does while its FFN role is lost: vLLM patches (0.32.x).

The Attention worker's :class:`~afd_runtime.attention_link.AttentionLink` turns every step that
the FFN role could not serve into :class:`~afd_runtime.attention_link.AFDFFNUnavailableError`
and reconnects in the background. Without these patches vLLM would treat that error as fatal
(the engine core dies, every request gets "EngineCore encountered an issue", the server exits).
With them, on the Attention role only:

1. ``EngineCore.step`` (:class:`FFNLossHold`): the step's error **holds** the engine's requests
   instead of failing them. Every running request is preempted the way vLLM preempts for lack of
   KV blocks (recompute: its KV freed, back to the waiting queue with its tokens so far; the
   prefix cache is reset too, since the failed step may have written part of its KV), new
   requests queue up, and no step is scheduled while any Attention rank's link is down (the
   workers' ``afd_attention_health``, polled every :data:`HOLD_POLL_S`). When the link is back
   the held requests resume (their prompts and tokens so far are prefilled again), so a
   streaming client sees a pause, not an error. If the link stays down for the Attention
   config's ``ffn_loss_grace_s`` (default 60 s), every request of the engine finishes with
   vLLM's request-level error status (``FINISHED_ERROR``, :func:`fail_requests_on_ffn_loss`), and
   so does every request that arrives until the link is back; ``ffn_loss_grace_s: 0`` fails them
   at the first failed step. The requests' ``stop_reason`` carries the error text, prefixed
   :data:`STOP_REASON_PREFIX`.
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
import time
from typing import Any, Final

from afd_core.config import AFDRole, parse_afd_config

from afd_runtime.attention_link import AFDFFNUnavailableError
from afd_runtime.metrics import RoleMetrics

logger = logging.getLogger(__name__)

#: ``stop_reason`` prefix of requests failed by an FFN loss (the rest is the error text).
STOP_REASON_PREFIX: Final[str] = "afd_ffn_unavailable: "
#: How long ``/health`` waits for the engine's answer before counting it as healthy.
HEALTH_RPC_TIMEOUT_S: Final[float] = 5.0
#: How often a holding engine asks its workers whether the FFN link is back.
HOLD_POLL_S: Final[float] = 0.2
#: How many failed requests' texts the API server remembers until their response is written.
_REMEMBERED: Final[int] = 4096
_MARK: Final[str] = "_afd_ffn_loss_patched"


def _is_attention(vllm_config: Any) -> bool:
    cfg = parse_afd_config(getattr(vllm_config, "additional_config", None))
    return cfg is not None and cfg.role is AFDRole.ATTENTION


def fail_requests_on_ffn_loss(
    engine_core: Any, error: AFDFFNUnavailableError | str
) -> dict[int, Any]:
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


def _link_down_reason(engine_core: Any) -> str | None:
    """Why an Attention rank of ``engine_core`` has no FFN link (the first worker's reason), or
    ``None`` when every link is up."""
    for reason in engine_core.model_executor.collective_rpc("afd_attention_health"):
        if reason:
            return str(reason)
    return None


def hold_running_requests(engine_core: Any) -> int:
    """Preempt every running request of ``engine_core`` back to its waiting queue (recompute:
    KV freed; vLLM's own preemption, as ``reset_prefix_cache(reset_running_requests=True)``
    runs it) and reset the prefix cache; returns how many requests the engine now holds.

    The failed step was scheduled but will never report an output: its tokens are taken off
    each request's in-flight count first (else the preemption would mark them as a stale output
    still to drain, and the next real step's accounting would go negative)."""
    scheduler = engine_core.scheduler
    for request in scheduler.running:
        request.num_in_flight_tokens = 0
    scheduler.reset_prefix_cache(reset_running_requests=True)
    return int(scheduler.get_num_unfinished_requests())


class FFNLossHold:
    """The hold-and-resume state of one Attention engine core (see the module docstring).

    ``down_since``: when a step first failed for want of the FFN role (monotonic seconds;
    ``None`` while the link is up). ``expired``: the link stayed down past ``grace_s``; until it
    is back every request fails at once."""

    def __init__(
        self,
        grace_s: float,
        clock: Any = time.monotonic,
        sleep: Any = time.sleep,
        metrics: RoleMetrics | None = None,
    ):
        self.grace_s = float(grace_s)
        self.metrics = metrics
        self.down_since: float | None = None
        self.expired = False
        self.holds = 0  # hold episodes started
        self.resumes = 0  # hold episodes ended by the link coming back
        self._clock = clock
        self._sleep = sleep

    def step(self, engine_core: Any, original: Any) -> tuple[dict[int, Any], bool]:
        """One engine step under the hold rules (``original``: vLLM's ``EngineCore.step``)."""
        if self.down_since is not None:
            reason = _link_down_reason(engine_core)
            if reason is None:
                held = engine_core.scheduler.get_num_unfinished_requests()
                logger.warning(
                    "AFD Attention: the FFN role is back after %.1fs; resuming %d held request(s)",
                    self._clock() - self.down_since,
                    held,
                )
                self.down_since, self.expired = None, False
                self.resumes += 1
                self._held(0)
            elif not engine_core.scheduler.has_unfinished_requests():
                # Nothing to hold (all failed, finished or aborted): vLLM's own step flushes the
                # finished requests without a forward; without it they would keep the engine
                # "busy" (a SIGTERM's drain would never end).
                self._held(0)
                return original(engine_core)
            elif self.expired or self._clock() - self.down_since >= self.grace_s:
                text = f"{reason} (requests held {self.grace_s:g}s: ffn_loss_grace_s)"
                return self._expire(engine_core, text, f"stayed away for {self.grace_s:g}s"), False
            elif int(getattr(engine_core, "shutdown_state", 0)) != 0:  # vLLM's RUNNING is 0
                # The engine is stopping: its drain cannot finish a held request, so it fails
                # now instead of at the drain's timeout (which kills the engine core).
                text = f"{reason} (the Attention server is stopping)"
                return self._expire(engine_core, text, "is away while the server stops"), False
            else:
                self._held(engine_core.scheduler.get_num_unfinished_requests())
                self._sleep(HOLD_POLL_S)
                return {}, False
        try:
            return original(engine_core)
        except AFDFFNUnavailableError as err:
            now = self._clock()
            if self.grace_s <= 0:
                # The failed step's blocks are in the prefix cache with KV never (fully)
                # written: reset it before the requests go, as the hold does.
                hold_running_requests(engine_core)
                return self._failed(fail_requests_on_ffn_loss(engine_core, err)), False
            if self.down_since is None:
                self.down_since = now
                self.holds += 1
                if self.metrics is not None:
                    self.metrics.ffn_loss_holds.inc()
            held = hold_running_requests(engine_core)
            self._held(held)
            logger.warning(
                "AFD Attention: FFN role unavailable (%s); holding %d request(s), KV freed, "
                "for up to %gs (ffn_loss_grace_s)",
                err,
                held,
                self.grace_s,
            )
            return {}, False

    def _expire(self, engine_core: Any, text: str, why: str) -> dict[int, Any]:
        """Fail every request of the engine with ``text`` (and every new one until the link is
        back); ``why``: what the log says of the FFN role."""
        if not self.expired:
            logger.error(
                "AFD Attention: the FFN role %s; failing the held requests and every new one "
                "until it is back",
                why,
            )
            self.expired = True
        hold_running_requests(engine_core)  # nothing may stay scheduled on a dead link
        self._held(0)
        return self._failed(fail_requests_on_ffn_loss(engine_core, text))

    def _held(self, count: int) -> None:
        if self.metrics is not None:
            self.metrics.held_requests.set(count)

    def _failed(self, outputs: dict[int, Any]) -> dict[int, Any]:
        if self.metrics is not None:
            self.metrics.ffn_loss_failed.inc(sum(len(o.outputs) for o in outputs.values()))
        return outputs


def _hold_of(engine_core: Any) -> FFNLossHold | None:
    """The engine's :class:`FFNLossHold` (created on first use); ``None`` off the Attention role."""
    hold = engine_core.__dict__.get("_afd_hold", False)
    if hold is False:
        cfg = parse_afd_config(getattr(engine_core.vllm_config, "additional_config", None))
        hold = None
        if cfg is not None and cfg.role is AFDRole.ATTENTION:
            parallel = getattr(engine_core.vllm_config, "parallel_config", None)
            rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
            hold = FFNLossHold(cfg.ffn_loss_grace_s, metrics=RoleMetrics("attention", rank))
        engine_core.__dict__["_afd_hold"] = hold
    return hold


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
            hold = _hold_of(self)
            if hold is None:
                return original(self)
            return hold.step(self, original)

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
