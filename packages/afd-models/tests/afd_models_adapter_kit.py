"""Helpers for the adapter tests of models without a tiny demo checkpoint (not a test module).

* :func:`import_qwen3_5` imports vLLM's ``qwen3_5`` module without the vision stack's torchvision.
  vLLM 0.32's ``qwen3_5`` imports ``qwen3_vl``, which imports ``smart_resize`` from transformers'
  ``qwen2_vl.image_processing_qwen2_vl``, a module that imports torchvision at its top. PyPI's
  torchvision does not work beside the CPU torch of these environments (and must never be
  installed in them), so, only when that exact import fails, a stub of that one transformers
  module (``smart_resize`` and the image processor taken from transformers' PIL variant of the
  same module) is put in ``sys.modules`` for the duration of the import and removed after it.
  The text model never calls either. Guarded: vLLM 0.32.x only; a different failure re-raises.
* :func:`write_checkpoint` writes a config and random safetensors weights (checkpoint names).
* :class:`ServedFFN` serves FFN-role models with afd-runtime's ``FFNService`` on threads, reached
  by the Attention role's ``afd::remote_ffn*`` ops through afd-core's in-process connector (one
  or several expert-parallel FFN ranks).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from afd_core.config import AFDConfig
from afd_core.metadata import AFDControlMessage
from afd_core.testing import free_port

_VISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def import_qwen3_5() -> types.ModuleType:
    """vLLM's ``qwen3_5`` module (see the module docstring for the torchvision stub)."""
    import vllm

    if not vllm.__version__.startswith("0.32."):
        raise RuntimeError(
            f"the qwen3_5 import stub is written for vLLM 0.32.x, not {vllm.__version__}"
        )
    name = "vllm.model_executor.models.qwen3_5"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != "torchvision" or _VISION_MODULE in sys.modules:
            raise
    pil = importlib.import_module(_PIL_MODULE)
    stub = types.ModuleType(_VISION_MODULE)
    stub.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
    stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    sys.modules[_VISION_MODULE] = stub
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules[_VISION_MODULE]


def init_vllm_distributed(cfg: Any) -> None:
    """One-rank vLLM model-parallel groups over gloo (once per process)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)


def write_checkpoint(path: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """``config.json`` + ``model.safetensors`` in ``path`` (created)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def engine_config(path: Path, afd: dict[str, Any] | None, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(path),
        enforce_eager=True,
        skip_tokenizer_init=True,
        dtype="float32",
        additional_config={} if afd is None else {"afd": afd},
        **kw,
    ).create_engine_config()


def load(path: Path, afd: dict[str, Any] | None, **kw: Any) -> tuple[Any, Any]:
    """``(vllm_config, model)`` loaded through vLLM's own loader from ``path``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    cfg = engine_config(path, afd, **kw)
    with set_current_vllm_config(cfg):
        return cfg, get_model(vllm_config=cfg)


#: vLLM's forward context and current config are process globals: with both roles (and several
#: FFN ranks) as threads of one process, one FFN compute runs at a time, each in its own context.
_COMPUTE_LOCK = threading.Lock()


class _OneAtATime:
    """An FFN rank's compute (the one the FFN worker selects) called one call at a time in this
    process, each call in its own vLLM forward context (no per-step scope: a step scope would
    hold the process-global context while the Attention thread runs); records each call."""

    def __init__(self, compute: Any) -> None:
        self._compute = compute
        self.calls: list[tuple[int, int]] = []  # (layer, rows)
        self.input_ids: list[torch.Tensor] = []

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kw: Any,
    ) -> torch.Tensor:
        with _COMPUTE_LOCK:
            self.calls.append((layer, int(hidden.shape[0])))
            if kw.get("input_ids") is not None:
                self.input_ids.append(kw["input_ids"].clone())
            out: torch.Tensor = self._compute(layer, hidden, logits, topk, **kw)
            return out


class ServedFFN:
    """FFN-role model(s) served by afd-runtime's :class:`~afd_runtime.ffn_service.FFNService`
    (one service thread per FFN rank, its compute the worker's ``select_ffn_compute``), reached
    from the test's Attention-role model through afd-core's in-process connector: the real
    handshake (both roles' payload specs and AFD settings must agree), control message,
    dispatch, combine and goodbye. Each step serves ``layers`` in order.

    ``ranks``: ``(vllm_config, ffn_model)`` per FFN rank, loaded with an FFN-role AFD config.
    ``with ffn.step(n) as connector`` announces one step of ``n`` tokens; the block runs the
    Attention side (``AFDForwardMetadata(connector=connector, ...)``); on leaving it, every FFN
    rank has finished the step (a service failure is raised). Leaving the ``with`` says goodbye
    and stops the services (none may have failed).
    """

    def __init__(
        self, attn_spec: Any, ranks: list[tuple[Any, Any]], layers: tuple[int, ...]
    ) -> None:
        from afd_core.connector import create_connector
        from afd_models.models._common import afd_config_of
        from afd_runtime.compute import select_ffn_compute
        from afd_runtime.ffn_service import FFNService
        from afd_runtime.workers.base import _vllm_forward_context

        port = free_port()  # names this in-process world; nothing listens there
        local = {"connector": "inprocess", "port": port, "timeout_s": 60.0}
        local["startup_timeout_s"] = 60.0
        num_layers = max(max(m.afd_moe_layer_indices) for _, m in ranks) + 1
        self.computes: list[_OneAtATime] = []
        self.services: list[Any] = []
        first: AFDConfig | None = None
        for f, (cfg, model) in enumerate(ranks):
            afd = afd_config_of(cfg)
            assert afd is not None and afd.ffn_rank == f, afd
            afd = AFDConfig.from_mapping({**afd.to_mapping(), **local})
            first = first or afd
            compute = _OneAtATime(
                select_ffn_compute(
                    afd, model, lambda n, c=cfg: _vllm_forward_context(c, n), ffn_rank=f
                )
            )

            def factory(
                afd: AFDConfig = afd, f: int = f, spec: Any = model.afd_payload_spec
            ) -> Any:
                return create_connector(afd, f, payload_spec=spec, num_layers=num_layers)

            self.computes.append(compute)
            self.services.append(FFNService(afd, f, layers, compute, factory))
        assert first is not None
        attention = {**first.to_mapping(), "role": "attention", "ffn_rank": 0}
        self.connector = create_connector(
            AFDConfig.from_mapping(attention), 0, payload_spec=attn_spec, num_layers=num_layers
        )

    def __enter__(self) -> ServedFFN:
        for svc in self.services:
            svc.start()
        try:
            self.connector.init()  # pairs with every service's connector
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.connector.is_initialized:
            self.connector.send_control(AFDControlMessage.shutdown_message())
        self.connector.close()
        self._stop()
        for svc in self.services:
            svc.raise_if_failed()

    def _stop(self) -> None:
        for svc in self.services:
            svc.stop()

    @contextlib.contextmanager
    def step(self, num_tokens: int, bound_s: float = 120.0) -> Iterator[Any]:
        before = [svc.stats.steps for svc in self.services]
        self.connector.send_control(AFDControlMessage(((num_tokens,),)))
        yield self.connector
        deadline = time.monotonic() + bound_s
        while any(s.stats.steps == b for s, b in zip(self.services, before, strict=True)):
            for svc in self.services:
                svc.raise_if_failed()
            assert time.monotonic() < deadline, (
                f"the FFN ranks did not finish the step in {bound_s}s"
            )
            time.sleep(0.005)
