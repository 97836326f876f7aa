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
* :class:`InProcessConnector` runs the FFN-role model in-process behind the Attention role's
  ``afd::remote_ffn*`` ops (payload fields checked against the spec, ``input_ids`` included);
  :class:`InProcessExpertParallelConnector` runs several expert-parallel FFN ranks' models.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from afd_core.config import AFDConfig
from afd_core.connector import AFDConnectorBase, AFDTransferHandle
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


class InProcessConnector(AFDConnectorBase):
    """An afd-core connector that runs the FFN-role model in-process (no transport)."""

    name = "test-in-process"

    def __init__(self, attn_model: Any, ffn_cfg: Any, ffn_model: Any) -> None:
        afd = AFDConfig.from_mapping({"role": "attention", "port": 1})
        super().__init__(afd, payload_spec=attn_model.afd_payload_spec, num_layers=64)
        self.ffn_cfg = ffn_cfg
        self.ffn_model = ffn_model
        self.layers: list[int] = []
        self.input_ids: list[torch.Tensor] = []

    def init(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def is_initialized(self) -> bool:
        return True

    def send_dispatch(self, payloads: Any, metadata: Any) -> AFDTransferHandle:
        for payload, n in zip(payloads, metadata.num_tokens, strict=True):
            self.payload_spec.validate_payload(payload, n, "cpu")
            if payload.input_ids is not None:
                self.input_ids.append(payload.input_ids.clone())
        self.layers.append(metadata.layer_idx)
        return AFDTransferHandle(metadata, list(payloads), id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        from afd_runtime.compute import NativeFusedMoECompute
        from afd_runtime.workers.base import _vllm_forward_context

        handle.consume()
        compute = NativeFusedMoECompute(
            self.ffn_model, lambda n: _vllm_forward_context(self.ffn_cfg, n)
        )
        outs = []
        for payload in handle.state:
            kw = {} if payload.input_ids is None else {"input_ids": payload.input_ids}
            outs.append(
                compute(
                    handle.metadata.layer_idx, payload.hidden_states, payload.router_logits, **kw
                )
            )
        return outs

    def recv_dispatch(self, layer_idx: int, stage_idx: int) -> tuple[Any, list[Any]]:
        raise NotImplementedError

    def send_combine(self, outputs: Any, metadata: Any) -> None:
        raise NotImplementedError


class InProcessExpertParallelConnector(AFDConnectorBase):
    """Expert-parallel afd-core connector running every FFN rank's model in-process on the
    payload dispatched to it (hidden states and the global top-k); ``counts`` records each
    dispatch's per-rank token counts."""

    name = "test-in-process-ep"

    def __init__(self, attn_cfg: Any, attn_model: Any, ranks: list[tuple[Any, Any]]) -> None:
        from afd_models.models._common import afd_config_of

        spec = attn_model.afd_payload_spec
        super().__init__(afd_config_of(attn_cfg), payload_spec=spec, num_layers=8)
        self.ranks = ranks
        self.counts: list[tuple[int, ...]] = []

    def init(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def is_initialized(self) -> bool:
        return True

    def send_dispatch(self, payloads: Any, metadata: Any) -> AFDTransferHandle:
        self.counts.append(tuple(metadata.num_tokens))
        return AFDTransferHandle(metadata, list(payloads), id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        from afd_runtime.workers.base import _vllm_forward_context

        handle.consume()
        layer, outs = handle.metadata.layer_idx, []
        for (cfg, model), p in zip(self.ranks, handle.state, strict=True):
            if p.hidden_states.shape[0] == 0:
                outs.append(p.hidden_states)
                continue
            topk = (p.topk_weights, p.topk_ids)
            with _vllm_forward_context(cfg, p.hidden_states.shape[0]):
                outs.append(model.afd_ffn_forward(layer, p.hidden_states, None, topk))
        return outs

    def recv_dispatch(self, layer_idx: int, stage_idx: int) -> tuple[Any, list[Any]]:
        raise NotImplementedError

    def send_combine(self, outputs: Any, metadata: Any) -> None:
        raise NotImplementedError
