"""Role behaviour shared by the AFD workers of every platform (mixed into the platform worker).

Both roles obtain their connector from afd-core's registry (``AFDConfig.connector``, see
:func:`afd_runtime.workers.base.build_connector`) and speak only its contract.

``AFDAttentionWorkerMixin`` keeps vLLM's scheduler, KV cache and sampling untouched; after the
model is loaded it reports the parameter bytes, initialises the connector (waiting up to
``startup_timeout_s`` for the FFN role) under an :class:`~afd_runtime.attention_link.AttentionLink`
(which reconnects after an FFN loss) and wraps the model's ``forward`` so that every forward
(real, dummy or profiling) announces its token count (``send_control``) and runs with the AFD
forward metadata installed (afd-core); the model's MoE layers then call afd-remote's proxy,
which sends and receives through that connector. On shutdown it says goodbye (a shutdown
control message) and closes the connector.

``AFDFFNWorkerMixin`` declares no KV cache (vLLM then skips memory profiling and allocates no
blocks), never runs scheduler-driven steps, and runs :class:`afd_runtime.ffn_service.FFNService`
instead. The engine waits on :meth:`AFDFFNWorkerMixin.afd_ffn_wait` (see
:mod:`afd_runtime.patches`), so a loop failure stops the engine with a non-zero exit.

Invariants: each mixin must precede the vLLM worker class in the MRO; ``shutdown`` is safe to
call more than once.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from afd_core.collectives import rows_per_tp_rank, tp_slice_rows
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import (
    AFDConnectorBase,
    create_connector,
    get_connector_class,
)
from afd_core.errors import AFDCancelledError, AFDModelError, AFDPayloadError, AFDStateError
from afd_core.forward_context import AFDForwardMetadata, set_afd_forward_metadata
from afd_core.metadata import AFDControlMessage, AFDPayloadSpec
from afd_core.topology import AFDTopology

from afd_runtime import stage_hooks
from afd_runtime.attention_link import AFDFFNUnavailableError, AttentionLink
from afd_runtime.compute import AFDFFNModel, select_ffn_compute
from afd_runtime.faults import raise_if_injected
from afd_runtime.ffn_service import FFNService
from afd_runtime.identity import config_identity, model_identity
from afd_runtime.metrics import (
    RoleMetrics,
    adopt_multiprocess_values,
    instrument_attention_connector,
)
from afd_runtime.quantized import QuantizedFFNCompute
from afd_runtime.roles import report_param_bytes, require_afd_config, role_rank
from afd_runtime.signals import cancel_startup_on_signals
from afd_runtime.stages import (
    install_stage_split,
    run_stages,
    stage_token_counts,
    staged_forward_context,
)

logger = logging.getLogger(__name__)


def _route_afd_logs_to_vllm() -> None:
    """Make ``afd_runtime.*`` INFO logs appear in vLLM's log stream (idempotent)."""
    from vllm.logger import init_logger

    init_logger("vllm.afd")  # ensures vLLM's logging configuration ran
    afd_logger = logging.getLogger("afd_runtime")
    if afd_logger.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        afd_logger.addHandler(handler)
    afd_logger.setLevel(logging.INFO)
    afd_logger.propagate = False


_route_afd_logs_to_vllm()

FFN_EXECUTE_ERROR = (
    "AFD FFN workers are connector-driven; scheduler-driven execute_model() is not supported."
)


def _num_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is not None:
        return int(input_ids.shape[0])
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None:
        return int(embeds.shape[0])
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if positions is None:
        raise AFDPayloadError(
            "positions", None, "input_ids, inputs_embeds or positions (to infer num_tokens)"
        )
    return int(positions.shape[-1])


def build_connector(
    cfg: AFDConfig,
    rank: int,
    payload_spec: AFDPayloadSpec,
    layers: tuple[int, ...],
    device: torch.device | str | None,
    *,
    role_agreement: Mapping[str, Any] | None = None,
    model_identity: Mapping[str, Any] | None = None,
    draft_layers: tuple[int, ...] = (),
) -> AFDConnectorBase:
    """The connector ``cfg.connector`` for this role rank (constructed, not initialised).

    ``draft_layers``: the MoE layers of the checkpoint's draft model (DeepSeek's MTP layers),
    the last layer indices; ``layers`` holds them too. The connector's ``num_draft_layers``
    (compared in the handshake) is their count.

    ``num_layers`` is ``max(layers) + 1``: the connector's layer index is the decoder layer
    index, which both roles derive from the same checkpoint config. ``role_agreement``: see
    :class:`afd_core.connector.AFDConnectorBase` (the FFN role's quantized compute's geometry);
    ``model_identity``: what both roles serve
    (:func:`afd_runtime.identity.model_identity`), compared across every rank at init."""
    last = max(layers)
    if draft_layers and tuple(draft_layers) != tuple(range(last + 1 - len(draft_layers), last + 1)):
        raise AFDModelError(
            "draft_layers",
            list(draft_layers),
            f"the last {len(draft_layers)} layer indices up to {last} (the draft model's layers "
            "follow the target's)",
        )
    return create_connector(
        cfg,
        rank,
        payload_spec=payload_spec,
        num_layers=max(layers) + 1,
        device=device,
        role_agreement=role_agreement,
        model_identity=model_identity,
        num_draft_layers=len(draft_layers),
    )


def _afd_drafter_model(model_runner: Any, draft_layers: tuple[int, ...]) -> Any:
    """The speculative drafter's model when it sends the checkpoint's draft layers to the FFN
    role (an AFD drafter, e.g. afd-models' DeepSeek MTP: ``afd_draft_layer_indices``), else None:
    a drafter without a model (n-gram) or without MoE layers (a dense draft model) runs here.

    Raises:
        AFDModelError: the drafter has MoE layers AFD does not serve (its routed experts are
            not on this role), or other draft layers than the target model's.
    """
    drafter = getattr(model_runner, "drafter", None)
    model = getattr(drafter, "model", None)
    if model is None:
        return None
    layers = tuple(getattr(model, "afd_draft_layer_indices", ()))
    if not layers:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
            MoERunnerInterface,
        )

        moe_types = (RoutedExperts, MoERunnerInterface)
        if any(isinstance(m, moe_types) for m in model.modules()):
            raise AFDModelError(
                "speculative draft model",
                type(model).__qualname__,
                "a drafter whose MoE layers AFD serves (DeepSeek MTP: method deepseek_mtp), or "
                "one without MoE layers",
                detail="its routed experts would run on the Attention role, which holds none",
            )
        return None
    if layers != tuple(draft_layers):
        raise AFDModelError(
            "speculative draft model",
            list(layers),
            f"the target model's draft layers {list(draft_layers)}",
        )
    return model


def _tp_rank(cfg: AFDConfig) -> int:
    """This Attention worker's rank in vLLM's TP group (0 without tensor parallelism)."""
    if cfg.attention_tp_size == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _worker_device(worker: Any) -> torch.device | str:
    device = getattr(worker, "device", None)
    return device if isinstance(device, torch.device | str) else "cpu"


_FORWARD_ARGS = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")


def install_step_hook(
    model: torch.nn.Module,
    link: AttentionLink,
    num_stages: int = 1,
    timeout_s: float = 120.0,
    vllm_config: Any = None,
    tp_size: int = 1,
    *,
    draft: bool = False,
    tp_rank: int = 0,
) -> None:
    """Wrap ``model.forward``: announce the step, install the AFD forward metadata, run.

    With ``tp_size`` T > 1 (this worker, ``tp_rank``, is one of T Attention TP workers holding
    the same tokens), each stage's announced count is this worker's routed-TP slice,
    :func:`afd_core.collectives.tp_slice_rows` of the stage's tokens: the real rows its MoE
    layers send (afd-remote's routed TP padding slices by the same rule), so the workers'
    counts add up to the stage's tokens. ``afd_step_tokens`` counts the rows announced.

    ``draft``: ``model`` is a speculative drafter (DeepSeek's MTP model): every forward is a
    step announced ``is_draft`` (the FFN ranks run only the draft layers for it).

    Every call runs inside ``link.step()`` (it fails at once with
    :class:`~afd_runtime.attention_link.AFDFFNUnavailableError` while the FFN role is
    unavailable), announces every stage's token count with ``send_control`` (when the connector
    has a control plane) and runs with the AFD forward metadata installed (afd-core).

    With ``num_stages == 2`` (``vllm_config`` required): a step the runner split (see :mod:`afd_runtime.stages`) announces
    both stages' counts and runs them overlapped (:func:`afd_runtime.stages.run_stages`; a stage
    blocked past ``timeout_s`` fails the step); any other step runs as stage 0 and announces
    zero tokens for stage 1 (the proxy then sends stage 1's empty transfers). Idempotent: a model
    wrapped once is not wrapped again.
    """
    if getattr(model, "_afd_step_hook", False):
        return
    inner: Callable[..., Any] = model.forward
    announce = link.connector.has_control_plane
    empty_tail = (0,) * (num_stages - 1)
    steps, step_tokens = link.metrics.steps, link.metrics.step_tokens

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        n = _num_tokens(args, kwargs)
        parent = staged_forward_context() if num_stages > 1 else None
        with link.step() as connector:
            if parent is not None:
                counts = stage_token_counts(parent)
                rows = tuple(tp_slice_rows(c, tp_size, tp_rank) for c in counts)
                if announce:
                    connector.send_control(
                        AFDControlMessage(tuple((c,) for c in rows), is_draft=draft)
                    )
                steps.inc()
                step_tokens.inc(sum(rows))
                call = dict(zip(_FORWARD_ARGS, args, strict=False)) | kwargs
                return run_stages(inner, parent, connector, call, timeout_s, vllm_config)
            counts = (n, *empty_tail)
            rows = (tp_slice_rows(n, tp_size, tp_rank), *empty_tail)
            if announce:
                connector.send_control(AFDControlMessage(tuple((c,) for c in rows), is_draft=draft))
            steps.inc()
            step_tokens.inc(rows[0])
            meta = AFDForwardMetadata(connector=connector, num_stages=num_stages, num_tokens=counts)
            with set_afd_forward_metadata(meta):
                return inner(*args, **kwargs)

    model.forward = forward
    model._afd_step_hook = True  # type: ignore[assignment]


def init_or_exit_on_signal(connector: AFDConnectorBase, who: str) -> None:
    """``connector.init()``, ended by SIGTERM/SIGINT while it waits for the peer role.

    A cancelled init (:class:`AFDCancelledError`, see :mod:`afd_runtime.signals`) becomes
    ``SystemExit(0)``: the engine is being stopped, which is not a failure, and vLLM's engine
    core then exits with status 0 instead of waiting out ``startup_timeout_s``."""
    cancel_startup_on_signals()
    logger.info("%s: waiting for its peers (SIGTERM/SIGINT cancel the wait)", who)
    try:
        connector.init()
    except AFDCancelledError as err:
        logger.info("%s: startup cancelled by %s while waiting for its peers", who, err.reason)
        # Skip the interpreter's final cyclic-GC pass over the loaded engine (measured: seconds
        # under load, past vLLM's 5 s before it force-kills the engine core).
        gc.freeze()
        raise SystemExit(0) from err


def publish_load_failure(cfg: AFDConfig, rank: int, err: BaseException) -> bool:
    """Tell the Attention role that this FFN rank failed to load (stage ``load``), so its
    connector init fails at once with this message instead of waiting ``startup_timeout_s``.

    Waits at most ``startup_timeout_s`` for the Attention role's store (it may start later)."""
    reason = f"{type(err).__name__}: {err}"
    logger.error("AFD FFN rank %d failed to load: %s", rank, reason)
    cls = get_connector_class(cfg.connector)
    delivered = cls.publish_startup_failure(cfg, rank, "load", reason)
    if not delivered:
        logger.warning("AFD FFN rank %d: the load failure could not be published", rank)
    return delivered


class AFDAttentionWorkerMixin:
    """Attention role: upstream worker + the AFD connector around every model forward."""

    vllm_config: Any
    model_runner: Any
    _afd_link: AttentionLink | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        cfg = require_afd_config(self.vllm_config, AFDRole.ATTENTION)
        rank = role_rank(self.vllm_config, cfg, _tp_rank(cfg))
        adopt_multiprocess_values()  # this engine core's afd_* values reach /metrics
        metrics = RoleMetrics(AFDRole.ATTENTION.value, rank)
        metrics.phase("load")
        config = config_identity(self.vllm_config.model_config.hf_config)  # see the FFN role's
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self.model_runner.get_model()
        metrics.phase("loaded")
        drafter = _afd_drafter_model(
            self.model_runner, tuple(getattr(model, "afd_draft_layer_indices", ()))
        )
        # Only a drafter sends the checkpoint's draft layers: without one the Attention role
        # declares none, and the FFN role may serve them or not (the checkpoint may not ship them).
        draft = () if drafter is None else tuple(drafter.afd_draft_layer_indices)
        report_param_bytes(metrics, model, drafter)
        spec = getattr(model, "afd_payload_spec", None)
        layers = getattr(model, "afd_moe_layer_indices", None)
        if not isinstance(spec, AFDPayloadSpec) or not layers:
            raise AFDModelError(
                "model",
                type(model).__qualname__,
                "an AFD Attention model (afd_payload_spec, afd_moe_layer_indices)",
                detail="the Attention role loaded it; is the afd-models plugin installed?",
            )
        connector = build_connector(
            cfg,
            rank,
            spec,
            tuple(layers) + draft,
            _worker_device(self),
            model_identity=model_identity(self.vllm_config, config),
            draft_layers=draft,
        )
        instrument_attention_connector(connector, metrics)
        link = AttentionLink(connector, name=f"rank {rank}", metrics=metrics)
        link.connect(init=lambda: init_or_exit_on_signal(connector, f"AFD Attention rank {rank}"))
        self._afd_link = link
        stage_hooks.install()  # the AFD layers' stage, yield and metadata come from here
        install_stage_split(self.model_runner, cfg.num_stages)
        tp_rank = _tp_rank(cfg)
        install_step_hook(
            model,
            link,
            cfg.num_stages,
            cfg.timeout_s,
            self.vllm_config,
            cfg.attention_tp_size,
            tp_rank=tp_rank,
        )
        if drafter is not None:
            # Speculative decoding with the checkpoint's MTP layer: each drafter forward is an
            # AFD step of its own, announced is_draft (the FFN runs only the draft layers).
            install_step_hook(
                drafter,
                link,
                cfg.num_stages,
                cfg.timeout_s,
                self.vllm_config,
                cfg.attention_tp_size,
                draft=True,
                tp_rank=tp_rank,
            )
        logger.info("AFD Attention rank %d connected through connector %r", rank, connector.name)

    def execute_dummy_batch(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM data parallelism runs a dummy batch on an idle rank while another has requests;
        # while the FFN role is unavailable there is nothing to fail but the batch itself.
        try:
            return super().execute_dummy_batch(*args, **kwargs)  # type: ignore[misc]
        except AFDFFNUnavailableError as exc:
            logger.warning("AFD Attention dummy batch skipped: %s", exc)
            return None

    # --- RPC used by the engine's health check (afd_runtime.ffn_loss) --------------------
    def afd_attention_health(self) -> str | None:
        """``None`` while this rank's FFN role is reachable, else why not."""
        link = self._afd_link
        return None if link is None else link.health()

    def shutdown(self) -> None:
        link, self._afd_link = self._afd_link, None
        if link is not None:
            link.close()
        super().shutdown()  # type: ignore[misc]


class AFDFFNWorkerMixin:
    """FFN role: no KV cache, no scheduler-driven steps, a connector-driven service loop."""

    vllm_config: Any
    model_runner: Any
    _afd_service: FFNService | None = None
    _afd_config: AFDConfig | None = None

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return {}

    def determine_available_memory(self) -> int:
        return 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        cfg = require_afd_config(self.vllm_config, AFDRole.FFN)
        rank = role_rank(self.vllm_config, cfg)
        # The service thread's connector waits end at once on SIGTERM/SIGINT (see
        # afd_runtime.signals); a load failure is published to the Attention role.
        cancel_startup_on_signals()
        try:
            self._afd_load_ffn(cfg, rank, *args, **kwargs)
        except Exception as err:
            publish_load_failure(cfg, rank, err)
            raise

    def _afd_load_ffn(self, cfg: AFDConfig, rank: int, *args: Any, **kwargs: Any) -> None:
        adopt_multiprocess_values()  # this engine core's afd_* values reach /metrics
        metrics = RoleMetrics(AFDRole.FFN.value, rank)
        metrics.phase("load")
        # The config before the model build: vLLM's attention layers rewrite parts of the config
        # they read (DeepSeek's yarn rope_type becomes 'deepseek_yarn'), which the FFN role
        # never builds; the weight files after the load (a hub checkpoint is downloaded by it).
        config = config_identity(self.vllm_config.model_config.hf_config)
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        raise_if_injected("ffn_load", f"AFD FFN rank {rank} model load")
        model = self.model_runner.get_model()
        metrics.phase("loaded")
        report_param_bytes(metrics, model)
        if not isinstance(model, AFDFFNModel):
            raise AFDModelError(
                "model",
                type(model).__qualname__,
                "an AFD FFN model (AFDFFNModel)",
                detail="the FFN role loaded it; is the afd-models plugin installed?",
            )
        device = _worker_device(self)
        sched = getattr(self.vllm_config, "scheduler_config", None)
        per_rank = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)
        compute = select_ffn_compute(
            cfg,
            model,
            self._afd_step_context,
            # One call computes a (layer, stage) over every Attention peer's step rows (a TP
            # worker sends its ceil(1/T) slice of its rank's tokens).
            max_tokens=rows_per_tp_rank(per_rank, cfg.attention_tp_size)
            * AFDTopology.from_config(cfg).num_attention_peers,
            ffn_rank=rank,
            device=device,
        )
        layers = tuple(model.afd_moe_layer_indices)
        draft = tuple(getattr(model, "afd_draft_layer_indices", ()))
        spec = model.afd_payload_spec
        agreement = None
        if isinstance(compute, QuantizedFFNCompute):
            compute.report()
            agreement = compute.role_agreement()
        identity = model_identity(self.vllm_config, config)
        self._afd_config = cfg
        self._afd_service = FFNService(
            cfg,
            rank,
            layers,
            compute,
            lambda: build_connector(
                cfg,
                rank,
                spec,
                layers,
                device,
                role_agreement=agreement,
                model_identity=identity,
                draft_layers=draft,
            ),
            draft_layer_indices=draft,
        )
        held = getattr(model, "afd_local_experts", None)
        if held is not None:
            self._afd_service.metrics.experts_held(len(held))
            logger.info(
                "AFD FFN rank %d holds %d routed experts %s (num_ffn_ranks=%d, expert_replicas=%d)",
                rank,
                len(held),
                list(held),
                cfg.num_ffn_ranks,
                cfg.expert_replicas,
            )

    def _afd_step_context(self, num_tokens: int) -> AbstractContextManager[object]:
        return _vllm_forward_context(self.vllm_config, num_tokens)

    def compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        self.afd_ffn_start()
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        # No KV cache on the FFN role: nothing to allocate. The engine's block count is left
        # alone: with the in-process executor the engine core shares this config object.
        return None

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        raise AFDStateError(FFN_EXECUTE_ERROR)

    def execute_dummy_batch(self) -> None:
        raise AFDStateError(FFN_EXECUTE_ERROR)

    # --- RPCs used by the patched engine loop -------------------------------------------------
    def afd_ffn_start(self) -> None:
        """Start the service (idempotent)."""
        if self._afd_service is None:
            raise AFDStateError("AFD FFN service not built: load_model() has not run")
        self._afd_service.start()

    def afd_ffn_wait(self, timeout_s: float) -> bool:
        """Block this worker's main thread up to ``timeout_s`` on the service.

        Returns True while the service runs; raises its error once it failed. The main thread
        sleeps here instead of spinning in vLLM's RPC reader beside the service thread."""
        service = self._afd_service
        if service is None:
            raise AFDStateError("AFD FFN service not built: load_model() has not run")
        service.wait(timeout_s)
        service.raise_if_failed()
        return True

    def afd_ffn_stop(self) -> None:
        """Stop the service (idempotent)."""
        if self._afd_service is not None:
            self._afd_service.stop()

    def shutdown(self) -> None:
        self.afd_ffn_stop()
        super().shutdown()  # type: ignore[misc]


@contextmanager
def _vllm_forward_context(vllm_config: Any, num_tokens: int) -> Iterator[None]:
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with (
        set_current_vllm_config(vllm_config),
        set_forward_context(None, vllm_config, num_tokens=num_tokens),
    ):
        yield
