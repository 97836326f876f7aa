"""Two-stage overlap on the Attention role (``AFDConfig.num_stages == 2``).

Per real step (vLLM's ``execute_model``), the Attention runner splits the batch into two stages
at a request boundary, balanced by tokens (:func:`afd_core.stage_plan.plan_stages`; a step with one
request, or one vLLM must not split, runs one stage). vLLM's own micro-batching machinery builds
each stage's attention metadata: the runner is told to micro-batch the step
(:func:`install_stage_split`) at that request boundary, so ``ForwardContext.ubatch_slices`` and
per-stage ``attn_metadata`` / ``slot_mapping`` lists reach the model's forward. The step hook
(:func:`afd_runtime.workers.base.install_step_hook`) then runs :func:`run_stages`: one vLLM
forward context per stage, the stages run by afd-core's ping-pong
(:func:`afd_runtime.overlap.run_overlapped`), the outputs concatenated in stage order.

Which steps split follows vLLM's own dual-batch-overlap rules:

* the step's tokens must reach vLLM's DBO threshold (``--dbo-decode-token-threshold``, default
  32, for a step of decodes only; ``--dbo-prefill-token-threshold``, default 512, otherwise):
  below it a second stage costs more (a second pass of every layer's kernel launches and two
  thread switches per layer) than the round trips it can hide (measured: ``afd bench``'s stage
  rows in afd-models' README);
* a step vLLM does not let micro-batch (``allow_microbatching`` false) or runs as a full CUDA
  graph stays whole (the graph was captured for the whole batch);
* a request that reads KV it did not write in an earlier step (``query_len > 1`` with computed
  tokens: a prefix-cache hit, a chunked-prefill continuation or a speculative step) keeps the
  step whole, so no reader can run before the writer of the blocks it reads (vLLM vetoes such
  splits for the same reason).

Patches (instance-level on the Attention runner, plus the runner module's
``maybe_create_ubatch_slices``, which delegates unchanged unless an AFD split is pending on the
calling thread): idempotent, vLLM 0.32.x only (the runtime refuses others before any patch).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from afd_core.connector import AFDConnectorBase
from afd_core.forward_context import AFD_FORWARD_CONTEXT_KEY, AFDForwardMetadata
from afd_core.stage_plan import plan_stages

from afd_runtime.faults import delay_injector
from afd_runtime.overlap import run_overlapped

_MARK = "_afd_stage_split"
_DELAY = delay_injector("attention-stages")  # tests only (AFD_INJECT_DELAY_MS)
_pending = threading.local()  # .real_step (bool), .split (token split point or None)


def split_point(
    query_lens: Sequence[int],
    computed: Sequence[int],
    num_stages: int,
    decode_threshold: int = 0,
    prefill_threshold: int = 0,
) -> int | None:
    """The token index where this step's second stage starts, or None to keep it whole.

    ``query_lens`` / ``computed``: each scheduled request's new and already computed tokens, in
    batch order. ``decode_threshold`` / ``prefill_threshold``: the fewest tokens a step of
    decodes only / any other step needs to split (vLLM's DBO thresholds). Whole when
    :func:`afd_core.stage_plan.plan_stages` says so, below the threshold, or when a request reads KV
    it did not write in an earlier step (see the module docstring)."""
    if num_stages < 2:
        return None
    q = [int(n) for n in query_lens]
    c = [int(n) for n in computed]
    threshold = decode_threshold if all(n == 1 for n in q) else prefill_threshold
    if sum(q) < threshold or any(n > 1 and done > 0 for n, done in zip(q, c, strict=True)):
        return None
    plan = plan_stages(q, num_stages)
    if plan is None:
        return None
    return sum(q[: plan[0]])


def install_stage_split(runner: Any, num_stages: int) -> None:
    """Make ``runner`` (a vLLM GPU/CPU model runner) micro-batch its real steps into
    ``num_stages`` stages at :func:`split_point` (idempotent; nothing for one stage)."""
    if num_stages < 2 or getattr(runner, _MARK, False):
        return
    import vllm.v1.worker.gpu_model_runner as gmr

    _patch_slice_builder(gmr)
    execute = runner.execute_model
    determine = runner._determine_batch_execution_and_padding
    pc = runner.vllm_config.parallel_config
    thresholds = (int(pc.dbo_decode_token_threshold), int(pc.dbo_prefill_token_threshold))

    @functools.wraps(execute)
    def execute_model(*args: Any, **kwargs: Any) -> Any:
        _pending.real_step = True
        try:
            return execute(*args, **kwargs)
        finally:
            _pending.real_step = False
            _pending.split = None

    @functools.wraps(determine)
    def determine_batch(*args: Any, **kwargs: Any) -> Any:
        result = determine(*args, **kwargs)
        _pending.split = None
        if not getattr(_pending, "real_step", False) or "num_reqs" not in kwargs:
            return result
        mode = getattr(result[0], "name", str(result[0]))
        if not kwargs.get("allow_microbatching", True) or mode not in ("NONE", "PIECEWISE"):
            # vLLM vetoed micro-batching this step, or it replays a full CUDA graph captured for
            # the whole batch: keep it whole.
            return result
        num_reqs = int(kwargs["num_reqs"])
        query_lens = kwargs["num_scheduled_tokens_np"][:num_reqs]
        computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
        point = split_point(query_lens, computed, num_stages, *thresholds)
        if point is None:
            return result
        _pending.split = point
        mode, descriptor, _should, across_dp, stats = result
        return mode, descriptor, True, across_dp, stats

    init_builders = runner.initialize_metadata_builders

    @functools.wraps(init_builders)
    def initialize_metadata_builders(kv_cache_config: Any, kernel_block_sizes: list[int]) -> None:
        # One attention-metadata builder per stage, as vLLM builds for its own micro-batches
        # (a builder may keep persistent buffers: one stage's metadata must not overwrite the
        # other's).
        init_builders(kv_cache_config, kernel_block_sizes)
        for gid in range(len(kv_cache_config.kv_cache_groups)):
            for group in runner.attn_groups[gid]:
                group.create_metadata_builders(
                    runner.vllm_config,
                    runner.device,
                    kernel_block_sizes[gid] if gid < len(kernel_block_sizes) else None,
                    num_metadata_builders=num_stages,
                )
        runner.calculate_reorder_batch_threshold()

    runner.execute_model = execute_model
    runner._determine_batch_execution_and_padding = determine_batch
    runner.initialize_metadata_builders = initialize_metadata_builders
    setattr(runner, _MARK, True)


def _patch_slice_builder(module: Any) -> None:
    original = module.maybe_create_ubatch_slices
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def maybe_create_ubatch_slices(should_ubatch: bool, *args: Any, **kwargs: Any) -> Any:
        point = getattr(_pending, "split", None)
        if not should_ubatch or point is None:
            return original(should_ubatch, *args, **kwargs)
        _pending.split = None
        scheduled, padded, reqs_padded = args[:3]
        return original(True, scheduled, padded, reqs_padded, 2, split_point=point)

    setattr(maybe_create_ubatch_slices, _MARK, True)
    module.maybe_create_ubatch_slices = maybe_create_ubatch_slices


def staged_forward_context() -> Any | None:
    """The active vLLM forward context when the runner split this step, else None."""
    import vllm.forward_context as fc

    if not fc.is_forward_context_available():
        return None
    ctx = fc.get_forward_context()
    slices = getattr(ctx, "ubatch_slices", None)
    if not slices or len(slices) < 2 or not isinstance(ctx.attn_metadata, list):
        return None
    return ctx


def stage_token_counts(ctx: Any) -> tuple[int, ...]:
    """Tokens per stage of a split step's forward context."""
    return tuple(int(s.num_tokens) for s in ctx.ubatch_slices)


def run_stages(
    inner: Callable[..., Any],
    parent: Any,
    connector: AFDConnectorBase,
    kwargs: dict[str, Any],
    timeout_s: float,
    vllm_config: Any,
) -> Any:
    """Run ``inner`` (the model's forward) once per stage of the split step ``parent`` (its
    vLLM forward context), overlapped, and concatenate the outputs in stage order.

    ``kwargs``: the forward's keyword arguments (``input_ids``, ``positions``,
    ``inputs_embeds``, ``intermediate_tensors``, ...); token-aligned ones are sliced per stage."""
    import vllm.forward_context as fc

    slices = parent.ubatch_slices
    counts = stage_token_counts(parent)
    contexts = []
    for idx, ub in enumerate(slices):
        meta = AFDForwardMetadata(
            connector=connector, stage_idx=idx, num_stages=len(slices), num_tokens=counts
        )
        slot_mapping = parent.slot_mapping[idx] if isinstance(parent.slot_mapping, list) else None
        contexts.append(
            fc.create_forward_context(
                parent.attn_metadata[idx],
                vllm_config,
                dp_metadata=_stage_dp_metadata(vllm_config, parent, counts[idx]),
                slot_mapping=slot_mapping,
                additional_kwargs={**parent.additional_kwargs, AFD_FORWARD_CONTEXT_KEY: meta},
                skip_compiled=parent.skip_compiled,
                is_padding=(
                    parent.is_padding[ub.token_slice] if parent.is_padding is not None else None
                ),
            )
        )

    delay = _DELAY

    def resume(idx: int) -> None:
        fc._forward_context = contexts[idx]
        if delay is not None:
            delay()

    def stage(idx: int) -> Callable[[], Any]:
        token_slice = slices[idx].token_slice

        def run() -> Any:
            with torch.inference_mode():
                return inner(**_slice_inputs(kwargs, token_slice))

        return run

    saved = fc._forward_context
    try:
        outputs = run_overlapped(
            [stage(i) for i in range(len(slices))], timeout_s=timeout_s, on_resume=resume
        )
    finally:
        fc._forward_context = saved
    if isinstance(outputs[0], tuple):
        return tuple(torch.cat(parts, dim=0) for parts in zip(*outputs, strict=True))
    return torch.cat(outputs, dim=0)


def _slice_inputs(kwargs: dict[str, Any], token_slice: slice) -> dict[str, Any]:
    out = dict(kwargs)
    for name in ("input_ids", "inputs_embeds"):
        if out.get(name) is not None:
            out[name] = out[name][token_slice]
    positions = out.get("positions")
    if positions is not None:
        out["positions"] = (
            positions[:, token_slice] if positions.ndim == 2 else positions[token_slice]
        )
    if out.get("intermediate_tensors") is not None:
        out["intermediate_tensors"] = out["intermediate_tensors"][token_slice]
    return out


def _stage_dp_metadata(vllm_config: Any, parent: Any, num_tokens: int) -> Any:
    """A stage's DP metadata (vLLM's micro-batch wrapper's rule: every DP rank counted with
    this stage's tokens); None without data parallelism."""
    if parent.dp_metadata is None:
        return None
    from vllm.forward_context import DPMetadata

    pc = vllm_config.parallel_config
    across = torch.tensor([num_tokens] * pc.data_parallel_size, device="cpu", dtype=torch.int32)
    return DPMetadata.make(pc, num_tokens, across)
