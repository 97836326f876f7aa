"""AFDAttentionFusedMoE: the Attention-side stand-in for a MoE layer's experts.

What is sent depends on where the gate runs and on what the connector carries (its
``supported_payload_fields``, which is exactly its payload spec):

=================  ===============================  ==========================================
gate placement     connector carries                payload
=================  ===============================  ==========================================
FFN                ``hidden_states``                hidden states only
Attention          ``router_logits``                hidden states + router logits
Attention          ``topk_ids`` + ``topk_weights``  hidden states + top-k ids (int32) and
                                                    weights (float32), computed here from the
                                                    router logits with ``routing_fn``
any                ``input_ids``                    + the given ``input_ids`` (token-aligned)
Attention, F > 1   ``topk_ids`` + ``topk_weights``  per FFN rank: the tokens routed to its
                                                    experts with their global top-k ids and
                                                    weights from the model's router
                                                    (:meth:`AFDAttentionFusedMoE.dispatch_routed`);
                                                    with ``expert_dispatch='ffn'`` every token
                                                    to one FFN rank (Mega dispatches them)
=================  ===============================  ==========================================

Anything the layer is given but the connector cannot carry (router logits with nowhere to go,
input ids on a connector without them) and anything the connector needs but the layer cannot
provide (routing payload with the gate on FFN, missing input ids) is an error naming the field,
raised before anything is sent. Nothing is dropped silently.
"""

from __future__ import annotations

import torch
from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDPayloadError
from afd_core.expert_map import ExpertMap
from afd_core.metadata import AFDPayload, AFDTransferMetadata

from afd_remote.errors import AFDRemoteError, UnsupportedPayloadFieldError
from afd_remote.expert_dispatch import (
    plan_expert_dispatch,
    plan_home_dispatch,
    split_for_dispatch,
)
from afd_remote.payload import check_fields, check_rows, localise
from afd_remote.proxy import RemoteFFNProxy, RemoteFFNTransfer
from afd_remote.routed_padding import RoutedTPPadding
from afd_remote.routing import RoutingFunction, softmax_topk

_TOPK_FIELDS = frozenset({"topk_ids", "topk_weights"})


class AFDAttentionFusedMoE(RemoteFFNProxy):
    """Parameter-free MoE experts whose work runs on the FFN role.

    Args:
        layer_idx: the layer index sent with every transfer.
        gate_on_attention: True when the model's gate runs on Attention (router logits are then
            required in :meth:`forward`); False when the FFN runs the gate (hidden states only).
        top_k: experts per token; required when the connector carries top-k ids/weights.
        renormalize: passed to ``routing_fn`` (renormalise the kept weights).
        routing_fn: ``(router_logits, top_k, renormalize) -> (weights, ids)``; defaults to
            :func:`afd_remote.routing.softmax_topk`. Adapters pass their model's router.
        tp_padding: routed TP padding (see :class:`RemoteFFNProxy`).
    """

    def __init__(
        self,
        layer_idx: int,
        *,
        gate_on_attention: bool,
        top_k: int | None = None,
        renormalize: bool = True,
        routing_fn: RoutingFunction = softmax_topk,
        tp_padding: RoutedTPPadding | None = None,
    ) -> None:
        super().__init__(layer_idx, tp_padding=tp_padding)
        if not isinstance(gate_on_attention, bool):
            raise AFDRemoteError("gate_on_attention", gate_on_attention, "a bool")
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise AFDRemoteError("top_k", top_k, "None or an int >= 1")
        if not isinstance(renormalize, bool):
            raise AFDRemoteError("renormalize", renormalize, "a bool")
        if not callable(routing_fn):
            raise AFDRemoteError("routing_fn", routing_fn, "a callable (logits, top_k, renorm)")
        self.gate_on_attention = gate_on_attention
        self._maps: dict[int, tuple[object, ExpertMap]] = {}
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing_fn = routing_fn

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, gate_on_attention={self.gate_on_attention}, "
            f"top_k={self.top_k}, renormalize={self.renormalize}"
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Send this layer's expert payload, yield to the other DBO micro-batch, return the output.

        Returns ``[tokens, hidden]`` with ``hidden_states``' rows (the routed experts' output, plus
        shared experts when the FFN runs them).
        """
        return self.complete(self.dispatch_experts(hidden_states, router_logits, input_ids))

    def dispatch_experts(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> RemoteFFNTransfer:
        """The send half of :meth:`forward`; pair it with :meth:`receive`.

        Raises:
            AFDContextError: no AFD forward metadata is installed.
            UnsupportedPayloadFieldError: the connector cannot carry a field the layer must send.
            AFDPayloadError: the connector needs a field the layer cannot provide, or a row
                count differs from ``hidden_states``.
            AFDRemoteError: ``top_k`` is missing (or too large) for a top-k connector.
        """
        connector, stage_idx = self._context()
        given = {"hidden_states": hidden_states}
        if router_logits is not None:
            given["router_logits"] = router_logits
        if input_ids is not None:
            given["input_ids"] = input_ids
        check_rows(given)
        send_logits, send_topk = self._routing_plan(connector, router_logits, input_ids)

        layout = self._plan(hidden_states)
        local = {"hidden_states": localise(hidden_states, layout, "hidden_states")}
        if input_ids is not None:
            local["input_ids"] = localise(input_ids, layout, "input_ids")
        if router_logits is not None:
            logits = localise(router_logits, layout, "router_logits")
            if send_logits:
                local["router_logits"] = logits
            if send_topk:
                local["topk_weights"], local["topk_ids"] = self._route(connector, logits)
        check_fields(connector, set(local))
        return self._send(connector, stage_idx, local, hidden_states.shape[0], layout)

    def dispatch_routed(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
    ) -> RemoteFFNTransfer:
        """Expert parallel (``num_ffn_ranks > 1``): send each FFN rank the tokens routed to its
        experts, with their global top-k ids and weights (computed by the model's router here);
        pair it with :meth:`receive`, which combines the partial outputs in FFN-rank order
        (:func:`afd_remote.expert_dispatch.combine_expert_outputs`).

        The placement is ``connector.topology.expert_map(num_experts)``, the one the FFN ranks
        load their experts by, routed over the round's FFN ranks; with replicated experts
        (``expert_replicas > 1``) each rank's top-k ids mark the slots routed elsewhere ``-1``.
        With ``expert_dispatch='ffn'`` (the FFN compute dispatches among the FFN ranks itself:
        Mega) every token goes to this peer's home FFN rank
        (:meth:`~afd_core.topology.AFDTopology.home_ffn_rank`) and the others get an empty
        transfer. With routed TP padding this TP rank dispatches only its slice of
        the replicated tokens; :meth:`receive` combines the slice's partial outputs, then
        all-gathers the slices in TP rank order.

        Raises:
            AFDContextError: no AFD forward metadata is installed.
            AFDRemoteError: the connector has one FFN rank.
            AFDPayloadError / UnsupportedPayloadFieldError: shapes or fields do not fit the
                connector's spec (hidden states + top-k ids and weights).
        """
        connector, stage_idx = self._context()
        if not connector.topology.expert_parallel:
            raise AFDRemoteError(
                "num_ffn_ranks", 1, "> 1 for dispatch_routed (one FFN rank: dispatch_experts)"
            )
        tensors = {
            "hidden_states": hidden_states,
            "topk_weights": topk_weights,
            "topk_ids": topk_ids,
        }
        check_rows(tensors)
        check_fields(connector, set(tensors))
        spec = connector.payload_spec
        layout = self._plan(hidden_states)
        hidden = localise(hidden_states, layout, "hidden_states")
        weights = localise(topk_weights.to(spec.topk_weights_dtype), layout, "topk_weights")
        ids = localise(topk_ids.to(spec.topk_ids_dtype), layout, "topk_ids")
        emap = self._expert_map(connector, num_experts)
        if connector.config.expert_dispatch == "ffn":
            # The FFN compute dispatches among the FFN ranks itself (Mega): one FFN rank gets
            # every row, with its global top-k, and replies with each row's whole output.
            home = connector.topology.home_ffn_rank(connector.role_rank)
            plan = plan_home_dispatch(int(ids.shape[0]), home, emap.num_ffn_ranks)
        else:
            plan = plan_expert_dispatch(ids, emap)
        parts = {
            "hidden_states": split_for_dispatch(hidden, plan),
            "topk_weights": split_for_dispatch(weights, plan, field="topk_weights"),
            "topk_ids": split_for_dispatch(ids, plan, field="topk_ids"),
        }
        if emap.replicated_routing:
            # A rank holding replicas computes only the slots routed to it (the others: -1).
            table = emap.owner_table(ids.device)
            parts["topk_ids"] = [
                emap.routed_ids(f, part, table) for f, part in enumerate(parts["topk_ids"])
            ]
        payloads = [
            AFDPayload(
                hidden_states=parts["hidden_states"][f],
                topk_ids=parts["topk_ids"][f],
                topk_weights=parts["topk_weights"][f],
            )
            for f in range(plan.num_ffn_ranks)
        ]
        metadata = AFDTransferMetadata(
            layer_idx=self.layer_idx, stage_idx=stage_idx, num_tokens=plan.counts
        )
        handle = connector.send_dispatch(payloads, metadata)
        return RemoteFFNTransfer(
            connector=connector,
            handle=handle,
            metadata=metadata,
            parent_tokens=int(hidden_states.shape[0]),
            layout=layout,
            tp_padding=self.tp_padding if layout is not None else None,
            plan=plan,
            companions=self._send_empty(connector, stage_idx, payloads[0], plan.num_ffn_ranks),
        )

    # -- internals -------------------------------------------------------------------------

    def _expert_map(self, connector: AFDConnectorBase, num_experts: int) -> ExpertMap:
        cached = self._maps.get(num_experts)
        if cached is None or cached[0] is not connector.topology:
            cached = (connector.topology, connector.topology.expert_map(num_experts))
            self._maps[num_experts] = cached
        return cached[1]

    def _routing_plan(
        self,
        connector: AFDConnectorBase,
        router_logits: torch.Tensor | None,
        input_ids: torch.Tensor | None,
    ) -> tuple[bool, bool]:
        """Decide (send router logits, send top-k); raise on anything that cannot travel."""
        supported = connector.supported_payload_fields
        name = type(connector).__name__
        if input_ids is not None and "input_ids" not in supported:
            raise UnsupportedPayloadFieldError("input_ids", name, supported)
        if input_ids is None and "input_ids" in supported:
            raise AFDPayloadError(
                "input_ids", None, f"token-aligned input ids: connector {name} carries them"
            )
        wants_logits = "router_logits" in supported
        wants_topk = bool(_TOPK_FIELDS & supported)
        if not self.gate_on_attention:
            if router_logits is not None:
                raise AFDRemoteError(
                    "router_logits",
                    tuple(router_logits.shape),
                    "None when gate_on_attention=False (the FFN runs the gate)",
                )
            for field in ("router_logits", "topk_ids", "topk_weights"):
                if field in supported:
                    raise AFDPayloadError(
                        field,
                        None,
                        f"nothing: connector {name} carries {field!r} but "
                        "gate_on_attention=False (the FFN runs the gate)",
                    )
            return False, False
        if router_logits is None:
            raise AFDPayloadError(
                "router_logits", None, "a [tokens, experts] tensor when gate_on_attention=True"
            )
        if not (wants_logits or wants_topk):
            raise UnsupportedPayloadFieldError("router_logits", name, supported)
        if wants_topk:
            if not supported >= _TOPK_FIELDS:
                missing = sorted(_TOPK_FIELDS - supported)[0]
                raise UnsupportedPayloadFieldError(missing, name, supported)
            if self.top_k is None:
                raise AFDRemoteError(
                    "top_k", None, f"an int >= 1: connector {name} carries top-k ids/weights"
                )
            spec_top_k = connector.payload_spec.top_k
            if self.top_k != spec_top_k:
                raise AFDRemoteError(
                    "top_k", self.top_k, f"{spec_top_k} (the top_k of connector {name}'s spec)"
                )
        return wants_logits, wants_topk

    def _route(
        self, connector: AFDConnectorBase, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.top_k is not None
        weights, ids = self.routing_fn(logits, self.top_k, self.renormalize)
        expected = (logits.shape[0], self.top_k)
        for field, tensor in (("topk_weights", weights), ("topk_ids", ids)):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != expected:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor
                raise AFDRemoteError(f"routing_fn.{field}", shape, f"a tensor of shape {expected}")
        spec = connector.payload_spec
        return weights.to(spec.topk_weights_dtype), ids.to(spec.topk_ids_dtype)
