"""FFN compute selection: the seam where the FFN half of each MoE layer is computed.

The FFN service loop calls an :class:`FFNCompute` once per (step, MoE layer). The parity path,
:class:`NativeFusedMoECompute`, runs the model's own vLLM ``FusedMoE`` (MoERunner) inside a vLLM
forward context, exactly the op plain vLLM runs. afd-compute-npu's Layered / Mega compute plugs in
here as :class:`afd_runtime.quantized.QuantizedFFNCompute` (``ffn_compute: layered | mega`` on
the model's quantized experts).

The service loop enters :meth:`NativeFusedMoECompute.step` once per step (vLLM's forward context
costs tens of microseconds to build, more than a small batch's expert pass on a CPU), and every
layer's call of that step runs inside it.

Invariants:
* ``FFNCompute.__call__`` returns a tensor of the same shape and dtype as ``hidden_states`` and
  does not retain its inputs.
* Selection happens once at startup; a kind this runtime does not serve raises before the service
  starts, naming ``ffn_compute`` and the allowed values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Final, Protocol, runtime_checkable

import torch
from afd_core.config import AFDConfig
from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDConfigError, AFDModelError, AFDStateError
from afd_core.metadata import AFDPayloadSpec

#: ``AFDConfig.ffn_compute`` values this runtime serves.
FFN_COMPUTE_NAMES: Final[tuple[str, ...]] = ("native", "layered", "mega")


@runtime_checkable
class AFDFFNModel(Protocol):
    """What an FFN-role model adapter exposes to the runtime.

    ``afd_moe_layer_indices`` lists, in forward order, the decoder layers whose routed experts this
    FFN rank serves; ``afd_payload_spec`` is what the Attention role sends per layer (the same
    spec the Attention adapter builds: the connector handshake compares them);
    ``afd_ffn_forward`` computes the routed-expert output of one layer (applying the gate first
    when the gate lives on the FFN role). With expert parallelism (``num_ffn_ranks > 1``) it is
    given ``topk`` = the tokens' global ``(weights, ids)`` as routed on the Attention role and
    returns the sum over this rank's experts only. When the payload spec carries ``input_ids``
    (token-id routing, e.g. DeepSeek-V4's hash layers) it is also given ``input_ids=`` (the
    tokens' ids, row-aligned with ``hidden_states``); a model without such a spec is never
    given the keyword.
    """

    afd_moe_layer_indices: tuple[int, ...]
    afd_payload_spec: AFDPayloadSpec

    def afd_ffn_forward(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...


class FFNCompute(Protocol):
    """Computes the FFN half of one MoE layer for the tokens of every served Attention rank
    (``topk``: the global top-k ``(weights, ids)`` with expert parallelism, else ``None``).

    The service passes ``input_ids=`` (keyword) only when the payload carries token ids; a
    compute that cannot route by them raises naming ``input_ids``."""

    def __call__(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class SteppedFFNCompute(FFNCompute, Protocol):
    """An :class:`FFNCompute` with per-step state: the service loop runs every call of a step
    inside ``step(num_tokens)`` (``num_tokens``: the most tokens one call of the step gets)."""

    def step(self, num_tokens: int) -> AbstractContextManager[object]: ...


@runtime_checkable
class BindingFFNCompute(FFNCompute, Protocol):
    """An :class:`FFNCompute` that binds to the connector's communicator once per connection
    when ``needs_bind`` (afd-compute-npu's Mega): the service calls :meth:`bind` between the
    connector's ``open_groups()`` and ``confirm_ready()``. Once bound, ``collective`` says whether
    each call is a collective over the FFN ranks (Mega bound to several of them dispatches and
    combines among them itself): the service then calls it for every ``(layer, stage)``, with
    0 rows too, so every FFN rank joins each one."""

    @property
    def needs_bind(self) -> bool: ...

    @property
    def collective(self) -> bool: ...

    def bind(self, connector: AFDConnectorBase) -> None: ...


StepContext = Callable[[int], AbstractContextManager[object]]


class NativeFusedMoECompute:
    """The parity path: the adapter's vLLM ``FusedMoE`` under a vLLM forward context.

    ``step_context(num_tokens)`` must install whatever the op needs (vLLM's forward context).
    Inside :meth:`step` every call reuses the step's context; a call outside one enters its own.
    """

    name: Final[str] = "native"

    def __init__(self, model: AFDFFNModel, step_context: StepContext) -> None:
        self._model = model
        self._step_context = step_context
        self._in_step = False

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Run the calls of one step inside one inference-mode block and forward context."""
        if self._in_step:
            raise AFDStateError("NativeFusedMoECompute.step() is not reentrant")
        with torch.inference_mode(), self._step_context(num_tokens):
            self._in_step = True
            try:
                yield
            finally:
                self._in_step = False

    def __call__(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scope = nullcontext() if self._in_step else self.step(hidden_states.shape[0])
        with scope:
            if input_ids is not None:
                out = self._model.afd_ffn_forward(  # type: ignore[call-arg]
                    layer_idx, hidden_states, router_logits, topk, input_ids=input_ids
                )
            elif topk is None:
                out = self._model.afd_ffn_forward(layer_idx, hidden_states, router_logits)
            else:
                out = self._model.afd_ffn_forward(layer_idx, hidden_states, router_logits, topk)
        if out.shape != hidden_states.shape or out.dtype != hidden_states.dtype:
            raise AFDModelError(
                f"afd_ffn_forward({layer_idx}) output",
                f"shape={tuple(out.shape)} dtype={out.dtype}",
                f"shape={tuple(hidden_states.shape)} dtype={hidden_states.dtype} (the input's)",
            )
        return out


def ffn_compute_name(config: AFDConfig) -> str:
    """``config.ffn_compute`` when this runtime serves it, else :class:`AFDConfigError`."""
    name = config.ffn_compute
    if name not in FFN_COMPUTE_NAMES:
        raise AFDConfigError("ffn_compute", name, f"one of {list(FFN_COMPUTE_NAMES)}")
    return name


def select_ffn_compute(
    config: AFDConfig,
    model: AFDFFNModel,
    step_context: StepContext,
    *,
    max_tokens: int = 8192,
    ffn_rank: int = 0,
    device: torch.device | str = "cpu",
) -> FFNCompute:
    """Pick the FFN compute for ``config`` (validated before anything starts).

    ``native``: the model's vLLM FusedMoE (:class:`NativeFusedMoECompute`). ``layered`` /
    ``mega``: afd-compute-npu on the model's quantized experts
    (:class:`afd_runtime.quantized.QuantizedFFNCompute`; ``max_tokens`` sizes its workspace).
    """
    name = ffn_compute_name(config)
    if not isinstance(model, AFDFFNModel):
        raise AFDModelError(
            "model",
            type(model).__qualname__,
            "an AFDFFNModel (afd_moe_layer_indices, afd_ffn_forward)",
        )
    if name == "native":
        return NativeFusedMoECompute(model, step_context)
    from afd_runtime.quantized import AFDQuantizedFFNModel, QuantizedFFNCompute

    if not isinstance(model, AFDQuantizedFFNModel):
        raise AFDConfigError(
            "expert_quant",
            config.expert_quant,
            f"a model that quantized its experts at load: {type(model).__qualname__} has no "
            "afd_quantized_weights / afd_route (is expert_quant set on this FFN role?)",
        )
    return QuantizedFFNCompute(name, model, max_tokens=max_tokens, ffn_rank=ffn_rank, device=device)
