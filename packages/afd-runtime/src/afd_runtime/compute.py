"""FFN compute selection: the seam where the FFN half of each MoE layer is computed.

The FFN service loop calls an :class:`FFNCompute` once per (step, MoE layer). The parity path,
:class:`NativeFusedMoECompute`, runs the model's own vLLM ``FusedMoE`` (MoERunner) inside a vLLM
forward context, exactly the op plain vLLM runs. afd-compute-npu's Layered / Mega compute plugs in
here next: implement :class:`FFNCompute` and add a name to :data:`FFN_COMPUTE_NAMES`.

Invariants:
* ``FFNCompute.__call__`` returns a tensor of the same shape and dtype as ``hidden_states`` and
  does not retain its inputs.
* Selection happens once at startup; an unknown or not-yet-wired name raises before the service
  starts, naming ``connector_extra_config.ffn_compute`` and the allowed values.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Final, Protocol, runtime_checkable

import torch
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError

#: Accepted values of ``connector_extra_config["ffn_compute"]``.
FFN_COMPUTE_NAMES: Final[tuple[str, ...]] = ("native",)
#: Names reserved for afd-compute-npu's compute, not wired to the vLLM runtime yet.
RESERVED_FFN_COMPUTE_NAMES: Final[tuple[str, ...]] = ("layered", "mega")


@runtime_checkable
class AFDFFNModel(Protocol):
    """What an FFN-role model adapter exposes to the runtime.

    ``afd_moe_layer_indices`` lists, in forward order, the decoder layers whose routed experts this
    FFN rank serves; ``afd_ffn_forward`` computes the routed-expert output of one layer (applying
    the gate first when the gate lives on the FFN role).
    """

    afd_moe_layer_indices: tuple[int, ...]

    def afd_ffn_forward(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor: ...


class FFNCompute(Protocol):
    """Computes the FFN half of one MoE layer for one attention rank's tokens."""

    def __call__(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor: ...


StepContext = Callable[[int], AbstractContextManager[object]]


class NativeFusedMoECompute:
    """The parity path: the adapter's vLLM ``FusedMoE`` under a vLLM forward context.

    ``step_context(num_tokens)`` must install whatever the op needs (vLLM's forward context).
    """

    name: Final[str] = "native"

    def __init__(self, model: AFDFFNModel, step_context: StepContext) -> None:
        self._model = model
        self._step_context = step_context

    def __call__(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        with torch.inference_mode(), self._step_context(hidden_states.shape[0]):
            out = self._model.afd_ffn_forward(layer_idx, hidden_states, router_logits)
        if out.shape != hidden_states.shape or out.dtype != hidden_states.dtype:
            raise RuntimeError(
                f"FFN layer {layer_idx} returned shape={tuple(out.shape)} dtype={out.dtype}; "
                f"expected shape={tuple(hidden_states.shape)} dtype={hidden_states.dtype}"
            )
        return out


def ffn_compute_name(config: AFDConfig) -> str:
    """The requested compute name (``connector_extra_config.ffn_compute``, default ``native``)."""
    name = config.connector_extra_config.get("ffn_compute", "native")
    if name in FFN_COMPUTE_NAMES:
        return str(name)
    if name in RESERVED_FFN_COMPUTE_NAMES:
        raise AFDConfigError(
            "connector_extra_config.ffn_compute",
            name,
            f"one of {FFN_COMPUTE_NAMES} (afd-compute-npu's {name!r} compute is not wired to the "
            "vLLM runtime yet)",
        )
    raise AFDConfigError("connector_extra_config.ffn_compute", name, f"one of {FFN_COMPUTE_NAMES}")


def select_ffn_compute(
    config: AFDConfig, model: AFDFFNModel, step_context: StepContext
) -> FFNCompute:
    """Pick the FFN compute for ``config`` (validated before anything starts)."""
    name = ffn_compute_name(config)
    if not isinstance(model, AFDFFNModel):
        raise TypeError(
            f"FFN model {type(model).__qualname__} does not implement AFDFFNModel "
            "(afd_moe_layer_indices, afd_ffn_forward)"
        )
    assert name == "native"
    return NativeFusedMoECompute(model, step_context)
