"""The FFN role's quantized expert compute: afd-compute-npu's Layered or Mega on the model's
:class:`~afd_weights.QuantizedExpertWeights` (``ffn_compute: layered | mega``).

The adapter's FFN model quantized its experts at load (no float copy stays resident) and routes
(:class:`AFDQuantizedFFNModel`); this module only runs the compute:

* **Layered** is built once; every call runs ``layered(layer, hidden, local_ids, weights)``.
* **Mega** is bound to the communicator behind the connector's group of the FFN ranks (the
  rows Mega's fused kernel dispatches and combines move among the FFN ranks, never to the
  Attention ranks): :meth:`QuantizedFFNCompute.bind` runs between the connector's
  ``open_groups()`` and ``confirm_ready()`` (the FFN service calls it), with the communicator's
  name (:func:`afd_runtime.comm_binding.communicator_name`: HCCL's through torch-npu, else the
  torch.distributed group's) and the group's size, rank and peers (``ffn_group_info()``). Bound
  to ``F > 1`` FFN ranks (``expert_dispatch='ffn'``: each Attention rank sends all of its tokens
  to one FFN rank) it is *collective*: it takes the tokens' global top-k as received, and the
  FFN service calls it for every ``(layer, stage)``, with 0 rows too. Each
  connection (a new Attention deployment) gets a new bound Mega (a Mega binds exactly once). A
  bind failure fails this rank's start with :class:`~afd_runtime.comm_binding.AFDCommBindError`
  and, published in stage ``bind``, every Attention rank's start with this rank's message; no
  step runs unbound (Mega itself raises ``MegaNotBoundError`` before any side effect).
* Backend: :class:`~afd_compute_npu.AscendBackend` on an NPU device, else the reference torch
  backend (CPU and CUDA).
* :meth:`QuantizedFFNCompute.role_agreement` is what every FFN rank must share (scheme, group
  size, hidden and intermediate sizes, clamp, dtype): the connector's handshake refuses FFN ranks
  whose quantization geometry differs.

Fault injection for tests: ``AFD_INJECT_FAULT=mega_bind`` in the FFN process makes every Mega bind
fail (a real bind failure on CPU has no other trigger; see :mod:`afd_runtime.faults`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch
from afd_compute_npu import (
    AscendBackend,
    ComputeBackend,
    ComputeConfig,
    ComputeGraphSignature,
    LayeredCompute,
    MegaCommParams,
    MegaCompute,
    ReferenceBackend,
    combine_over_group,
)
from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDConfigError, AFDPayloadError
from afd_core.metadata import AFDPayloadSpec
from afd_weights import QuantizedExpertWeights

from afd_runtime.comm_binding import AFDCommBindError, communicator_name
from afd_runtime.faults import FAULT_ENV, raise_if_injected  # noqa: F401  (FAULT_ENV: re-exported)
from afd_runtime.metrics import RoleMetrics

logger = logging.getLogger(__name__)


@runtime_checkable
class AFDQuantizedFFNModel(Protocol):
    """What an FFN-role model with quantized experts exposes (afd-models' ``AFDFFNCausalLM``).

    ``afd_route(layer, hidden, router_logits, topk)`` returns the rank-local top-k ``(weights,
    ids)`` of the tokens: from the Attention role's global top-k (expert parallel), else from the
    given router logits or the layer's own gate, with the model's router;
    ``afd_compute_top_k`` is their width.
    """

    afd_moe_layer_indices: tuple[int, ...]
    afd_payload_spec: AFDPayloadSpec
    afd_quantized_weights: QuantizedExpertWeights
    afd_compute_top_k: int

    def afd_route(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def compute_backend(device: torch.device | str) -> Any:
    """The backend for ``device``: Ascend's native ops on an NPU, the torch reference elsewhere."""
    return AscendBackend() if torch.device(device).type == "npu" else ReferenceBackend()


class QuantizedFFNCompute:
    """Layered or Mega compute of one FFN rank (see the module docstring)."""

    def __init__(
        self,
        kind: str,
        model: AFDQuantizedFFNModel,
        *,
        max_tokens: int,
        ffn_rank: int,
        device: torch.device | str = "cpu",
        backend: ComputeBackend | None = None,
    ) -> None:
        """``backend``: the compute backend (default: by ``device``, see :func:`compute_backend`;
        contract tests pass an Ascend backend over recorded native ops)."""
        if kind not in ("layered", "mega"):
            raise AFDConfigError("ffn_compute", kind, "'layered', 'mega'")
        self.name = kind
        self._model = model
        self.weights = model.afd_quantized_weights
        self.ffn_rank = ffn_rank
        self.config = ComputeConfig(
            max_tokens=max_tokens,
            top_k=model.afd_compute_top_k,
            dtype=model.afd_payload_spec.dtype,
            swiglu_limit=self.weights.swiglu_limit,
            routed_scaling_factor=self.weights.routed_scaling_factor,
        )
        self.backend = backend if backend is not None else compute_backend(device)
        self._compute: LayeredCompute | MegaCompute | None = (
            LayeredCompute(self.weights, self.config, self.backend) if kind == "layered" else None
        )
        self.binds = 0
        self.bound_group_name: str | None = None  # the communicator the current Mega is bound to
        self.metrics = RoleMetrics("ffn", ffn_rank)
        self._errors: dict[int, tuple[int, float]] = {}  # layer -> (calls, max relative error)
        self._measured = self._measured_layers()

    @property
    def needs_bind(self) -> bool:
        """True for Mega (bound per connection through :meth:`bind`)."""
        return self.name == "mega"

    @property
    def collective(self) -> bool:
        """True while bound to a group of several FFN ranks (every call joins their dispatch
        and combine)."""
        return isinstance(self._compute, MegaCompute) and self._compute.comm.world_size > 1

    def role_agreement(self) -> dict[str, Any]:
        """The compute and quantization geometry every FFN rank of a deployment must share."""
        g = self.weights.geometry
        return {
            "ffn_compute": self.name,
            # A collective Mega measures its error through the group: every rank or none.
            "quant_error_layers": list(self._measured),
            "expert_quant": self.weights.scheme.value,
            "group_size": self.weights.group_size,
            "hidden_size": g.hidden_size,
            "intermediate_size": g.intermediate_size,
            "swiglu_limit": self.weights.swiglu_limit,
            "dtype": str(self.config.dtype),
        }

    def bind(self, connector: AFDConnectorBase) -> None:
        """Bind a new Mega to the communicator behind ``connector``'s group of the FFN ranks
        (after ``open_groups()``, before ``confirm_ready()``); nothing for Layered.

        Raises:
            AFDCommBindError: the group gives no communicator name, this rank's experts are not
                the contiguous share Mega's dispatch places on it, or Mega refused the bind.
        """
        if not self.needs_bind:
            return
        info = connector.ffn_group_info()
        group = connector.ffn_process_group()
        name = communicator_name(group, info.rank, info.name)
        self._check_placement(info.world_size, info.rank)
        try:
            raise_if_injected("mega_bind", f"Mega bind to communicator {name!r}")
            mega = MegaCompute(self.weights, self.config, self.backend)
            mega.bind(
                MegaCommParams(
                    group_name=name,
                    world_size=info.world_size,
                    rank=info.rank,
                    peer_ranks=info.peer_ranks,
                    group=group,
                )
            )
        except Exception as err:
            raise AFDCommBindError(
                "ffn_compute",
                self.name,
                f"a Mega bound to the communicator {name!r} of {info.name}",
                detail=f"{type(err).__name__}: {err}",
            ) from err
        self._compute = mega
        self.binds += 1
        self.bound_group_name = name
        logger.info("AFD FFN rank %d: Mega bound to %s (group %s)", self.ffn_rank, name, info.name)

    def _check_placement(self, world_size: int, rank: int) -> None:
        """Mega's fused dispatch sends expert ``e`` to group rank ``e // E_local``: over several
        ranks this rank must hold exactly the experts ``[rank * E_local, (rank + 1) * E_local)``
        (the routed experts split evenly; afd-core's contiguous placement)."""
        if world_size == 1:
            return
        n = self.weights.geometry.num_experts
        held = tuple(getattr(self._model, "afd_local_experts", None) or ())
        if held != tuple(range(rank * n, (rank + 1) * n)):
            raise AFDCommBindError(
                "num_ffn_ranks",
                world_size,
                "a divisor of the routed experts (Mega's fused dispatch places expert e on FFN "
                f"rank e // experts-per-rank; FFN rank {rank} holds {len(held)} experts "
                f"{held[:1]}..{held[-1:]}, {n} quantized)",
            )

    def report(self) -> dict[int, str]:
        """Publish what an FFN rank reports once (the quantized expert bytes, the same experts'
        bf16 bytes, each layer's compute signature: ``afd_ffn_quantized_*`` and
        ``afd_ffn_compute_signature_info``); returns ``layer -> signature digest``."""
        g = self.weights.geometry
        self.metrics.quantized(
            self.name,
            self.weights.scheme.value,
            self.weights.group_size,
            self.weights.nbytes(),
            g.bf16_bytes_per_layer() * g.num_layers,
        )
        signatures = {}
        for layer in self.weights.layer_ids:
            digest = signatures[layer] = self.layer_signature(layer)
            self.metrics.signature(layer, self.name, digest)
        logger.info(
            "AFD FFN rank %d: quantized compute %s, scheme %s, group size %d, %d expert bytes",
            self.ffn_rank,
            self.name,
            self.weights.scheme.value,
            self.weights.group_size,
            self.weights.nbytes(),
        )
        return signatures

    def layer_signature(self, layer_id: int) -> str:
        """The compute graph signature digest of one layer: kind, backend, that layer's tensor
        layouts, max tokens, top-k and dtype (Mega adds its group once bound)."""
        w = self.weights
        one = QuantizedExpertWeights(
            scheme=w.scheme,
            layers=(w.layer(layer_id),),
            swiglu_limit=w.swiglu_limit,
            routed_scaling_factor=w.routed_scaling_factor,
            group_size=w.group_size,
        )
        return ComputeGraphSignature(
            kind=self.name,
            backend=self.backend.name,
            weights=one.signature,
            max_tokens=self.config.max_tokens,
            top_k=self.config.top_k,
            dtype=str(self.config.dtype),
        ).digest()

    def __call__(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids is not None:
            # Adapters refuse this at construction; this guards any other model.
            raise AFDPayloadError(
                "input_ids",
                f"given to ffn_compute={self.name!r} (layer {layer_idx})",
                "no input_ids; token-id routed models (DeepSeek-V4 hash layers) need "
                "ffn_compute='native'",
            )
        collective = self.collective
        if collective:
            # Mega dispatches among the FFN ranks itself: the tokens' global top-k as routed on
            # the Attention role (the gate runs there with several FFN ranks).
            if topk is None:
                raise AFDPayloadError(
                    "topk", None, "the tokens' global top-k (weights, ids) for a collective Mega"
                )
            weights, ids = topk[0].float(), topk[1].to(torch.int32)
        else:
            weights, ids = self._model.afd_route(layer_idx, hidden_states, router_logits, topk)
        compute = self._compute
        if compute is None:  # Mega before any bind: the compute's own error, before any write
            compute = MegaCompute(self.weights, self.config, self.backend)
        with torch.inference_mode():
            out = compute(layer_idx, hidden_states, ids, weights)
            ref = self._reference(layer_idx, hidden_states, weights, ids, collective)
        if ref is not None and out.numel():
            self._track_error(layer_idx, out, ref)
        # The workspace view is overwritten by the next call: the reply must own its rows.
        return out.clone()

    def _measured_layers(self) -> tuple[int, ...]:
        """The layers the model keeps a float reference of (``afd_reference_output`` answers)."""
        reference = getattr(self._model, "afd_reference_output", None)
        if reference is None:
            return ()
        k = self.config.top_k
        x = torch.empty(0, self.weights.geometry.hidden_size)
        w, i = torch.empty(0, k), torch.empty(0, k, dtype=torch.int32)
        return tuple(lid for lid in self.weights.layer_ids if reference(lid, x, w, i) is not None)

    def _reference(
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        collective: bool,
    ) -> torch.Tensor | None:
        """The fp32 output of a measured layer with the float experts. A collective Mega's
        float reference goes through the same exchange (the kept float layer holds this rank's
        experts: each rank computes their share, the group sums them)."""
        if layer_idx not in self._measured:
            return None
        reference = self._model.afd_reference_output  # type: ignore[attr-defined]
        if not collective:
            return reference(layer_idx, hidden_states, weights, ids)
        assert isinstance(self._compute, MegaCompute)
        comm = self._compute.comm
        return combine_over_group(
            comm.group,
            comm.world_size,
            comm.rank,
            self.weights.geometry.num_experts,
            hidden_states,
            ids,
            weights,
            lambda x, local_ids, p: reference(layer_idx, x, p, local_ids),
        )

    def _track_error(self, layer_idx: int, out: torch.Tensor, ref: torch.Tensor) -> None:
        scale = float(ref.abs().max())
        if scale == 0.0:
            return
        err = float((out.float() - ref).abs().max()) / scale
        calls, worst = self._errors.get(layer_idx, (0, 0.0))
        self._errors[layer_idx] = (calls + 1, max(worst, err))
        self.metrics.quant_error(layer_idx, max(worst, err))
