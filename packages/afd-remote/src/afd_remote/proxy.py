"""The Attention-side remote FFN call: a parameter-free module standing in for an FFN/MoE layer.

:class:`RemoteFFNProxy` takes the connector from the AFD forward metadata
(:func:`afd_core.forward_context.get_afd_forward_metadata`), never from its constructor, so one
model instance works with any connector and never imports a connector class.

Call order (pinned by the tests): ``connector.send_dispatch`` -> :func:`afd_core.forward_context.
dbo_yield` -> ``connector.recv_combine``, written once, in :meth:`RemoteFFNProxy.complete`. The
yield lets the step's other stage (or vLLM's other DBO micro-batch) compute while this one's FFN
round trip is in flight. :meth:`RemoteFFNProxy.dispatch` and :meth:`RemoteFFNProxy.receive` split
the call so a pipeline can run another stage's attention in between (they do not yield; the
caller owns the schedule).

Invariants:

* the stage is :func:`afd_core.forward_context.current_stage_idx` at dispatch time; the transfer
  carries it (and the connector) to the receive, whatever the context is by then;
* every row-aligned payload tensor has as many rows as ``hidden_states`` and every payload field
  is one the connector carries, checked before anything is sent;
* with routed TP padding, each rank sends only its slice and :meth:`receive` returns the full
  parent batch (all-gathered and trimmed), so the result always has ``hidden_states``' rows;
* every announced stage appears on the wire at every layer: when a step of a multi-stage
  forward runs as one stage (the metadata's ``num_tokens`` is zero for the other stages), the
  dispatch of that stage also sends a zero-token transfer for each empty stage, right after its
  own, and :meth:`receive` completes them after its own (peers served together with a split
  step expect every (layer, stage)).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from afd_core.connector import AFDConnectorBase, AFDTransferHandle
from afd_core.errors import AFDContextError, AFDPayloadError
from afd_core.forward_context import (
    AFDForwardMetadata,
    current_stage_idx,
    dbo_yield,
    get_afd_forward_metadata,
)
from afd_core.metadata import AFDPayload, AFDTransferMetadata

from afd_remote.errors import AFDRemoteError
from afd_remote.expert_dispatch import ExpertDispatchPlan, combine_expert_outputs
from afd_remote.payload import check_fields, check_rows, localise
from afd_remote.routed_padding import RoutedDispatchLayout, RoutedTPPadding


@dataclass(frozen=True, eq=False)
class RemoteFFNTransfer:
    """One in-flight remote FFN call, returned by :meth:`RemoteFFNProxy.dispatch`.

    Receive it exactly once with :meth:`RemoteFFNProxy.receive` (the connector's handle enforces
    this). ``layout`` and ``tp_padding`` are the routed TP layout and padding used at dispatch
    (both None without TP padding); ``parent_tokens`` is the row count the receive returns.
    """

    connector: AFDConnectorBase
    handle: AFDTransferHandle
    metadata: AFDTransferMetadata
    parent_tokens: int
    layout: RoutedDispatchLayout | None = None
    tp_padding: RoutedTPPadding | None = None
    plan: ExpertDispatchPlan | None = None
    #: Zero-token transfers of the step's empty stages, completed after this one.
    companions: tuple[AFDTransferHandle, ...] = ()

    @property
    def layer_idx(self) -> int:
        """The layer index sent with the transfer."""
        return self.metadata.layer_idx

    @property
    def stage_idx(self) -> int:
        """The stage (micro-batch) the transfer belongs to."""
        return self.metadata.stage_idx


class RemoteFFNProxy(torch.nn.Module):
    """Parameter-free stand-in for a layer whose FFN runs on the FFN role.

    Args:
        layer_idx: the layer index sent in every transfer's metadata (the index the FFN side
            iterates for this layer).
        tp_padding: routed TP padding for plain TP (each rank sends its slice of the replicated
            tokens); None sends every token this rank holds.
    """

    def __init__(self, layer_idx: int, *, tp_padding: RoutedTPPadding | None = None) -> None:
        super().__init__()
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise AFDRemoteError("layer_idx", layer_idx, "an int >= 0")
        if tp_padding is not None and not isinstance(tp_padding, RoutedTPPadding):
            raise AFDRemoteError(
                "tp_padding", type(tp_padding).__name__, "None or a RoutedTPPadding"
            )
        self.layer_idx = layer_idx
        self.tp_padding = tp_padding

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, tp_padding={self.tp_padding is not None}"

    # -- public API ------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Send ``hidden_states``, yield to the other stage, return the FFN output."""
        return self.complete(self.dispatch(hidden_states))

    def complete(self, transfer: RemoteFFNTransfer) -> torch.Tensor:
        """Yield to the step's other stage while ``transfer`` is in flight
        (:func:`afd_core.forward_context.dbo_yield`, a no-op with one stage), then receive it.
        If the yield raises (the other stage failed), the transfer is dropped unreceived."""
        dbo_yield()
        return self.receive(transfer)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        *,
        router_logits: torch.Tensor | None = None,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> RemoteFFNTransfer:
        """Send one payload for the current stage and return its transfer (no yield, no wait).

        The given fields must be exactly the connector's ``supported_payload_fields``.

        Raises:
            AFDContextError: no AFD forward metadata is installed.
            UnsupportedPayloadFieldError: a given field the connector cannot carry.
            AFDPayloadError: a field the connector needs is missing, or a row count differs from
                ``hidden_states``.
        """
        connector, stage_idx = self._context()
        fields = {
            "hidden_states": hidden_states,
            "router_logits": router_logits,
            "topk_ids": topk_ids,
            "topk_weights": topk_weights,
            "input_ids": input_ids,
        }
        tensors = {k: v for k, v in fields.items() if v is not None}
        check_rows(tensors)
        check_fields(connector, set(tensors))
        layout = self._plan(hidden_states)
        local = {k: localise(v, layout, k) for k, v in tensors.items()}
        return self._send(connector, stage_idx, local, hidden_states.shape[0], layout)

    def receive(self, transfer: RemoteFFNTransfer) -> torch.Tensor:
        """Wait for ``transfer``'s FFN output and return it in the parent token layout.

        Raises:
            AFDPayloadError: the connector returned a row count other than the dispatched one
                (before the TP all-gather).
        """
        if not isinstance(transfer, RemoteFFNTransfer):
            raise AFDRemoteError("transfer", type(transfer).__name__, "a RemoteFFNTransfer")
        connector = transfer.connector
        parts = connector.recv_combine(transfer.handle)
        for handle in transfer.companions:
            connector.recv_combine(handle)
        if transfer.plan is not None:
            output = combine_expert_outputs(parts, transfer.plan)
        else:
            output = parts[0]
            expected = transfer.metadata.num_tokens[0]
            if output.dim() == 0 or output.shape[0] != expected:
                raise AFDPayloadError(
                    "ffn_output",
                    tuple(output.shape),
                    f"{expected} rows (the rows dispatched for layer {transfer.layer_idx} "
                    f"stage {transfer.stage_idx})",
                )
        if transfer.layout is None or transfer.tp_padding is None:
            return output
        return transfer.tp_padding.restore(output, transfer.layout)

    # -- helpers for subclasses ------------------------------------------------------------

    def _context(self) -> tuple[AFDConnectorBase, int]:
        """The connector and current stage from the AFD forward metadata."""
        meta, stage_idx = self._metadata()
        return meta.connector, stage_idx

    def _metadata(self) -> tuple[AFDForwardMetadata, int]:
        try:
            meta = get_afd_forward_metadata()
            stage_idx = current_stage_idx()
        except AFDContextError as err:
            raise AFDContextError(
                f"{type(self).__name__}(layer_idx={self.layer_idx}) requires AFD forward "
                f"metadata: {err}"
            ) from err
        return meta, stage_idx

    def _empty_stages(self, stage_idx: int) -> tuple[int, ...]:
        """The stages this dispatch also carries as zero-token transfers (see the module
        invariants): none unless the forward announced several stages, this one with tokens and
        the others without."""
        meta = get_afd_forward_metadata()
        counts = meta.num_tokens
        if meta.num_stages == 1 or counts is None or not counts[stage_idx]:
            return ()
        return tuple(s for s in range(meta.num_stages) if s != stage_idx and not counts[s])

    def _send_empty(
        self, connector: AFDConnectorBase, stage_idx: int, like: AFDPayload, width: int
    ) -> tuple[AFDTransferHandle, ...]:
        """Send the zero-token transfers of :meth:`_empty_stages` (to each of the ``width`` FFN
        ranks, with ``like``'s fields); their handles."""
        stages = self._empty_stages(stage_idx)
        if not stages:
            return ()
        empty = AFDPayload(**{k: v[:0] for k, v in like.tensors().items()})
        handles = []
        for stage in stages:
            metadata = AFDTransferMetadata(
                layer_idx=self.layer_idx, stage_idx=stage, num_tokens=(0,) * width
            )
            handles.append(connector.send_dispatch([empty] * width, metadata))
        return tuple(handles)

    def _plan(self, hidden_states: torch.Tensor) -> RoutedDispatchLayout | None:
        if self.tp_padding is None:
            return None
        if hidden_states.dim() == 0:
            raise AFDPayloadError("hidden_states", (), "a [tokens, hidden] tensor")
        return self.tp_padding.plan(int(hidden_states.shape[0]))

    def _send(
        self,
        connector: AFDConnectorBase,
        stage_idx: int,
        local: Mapping[str, torch.Tensor],
        parent_tokens: int,
        layout: RoutedDispatchLayout | None,
    ) -> RemoteFFNTransfer:
        """Send already-localised tensors; returns the transfer."""
        hidden = local["hidden_states"]
        metadata = AFDTransferMetadata(
            layer_idx=self.layer_idx, stage_idx=stage_idx, num_tokens=(int(hidden.shape[0]),)
        )
        payload = AFDPayload(
            hidden_states=hidden,
            router_logits=local.get("router_logits"),
            topk_ids=local.get("topk_ids"),
            topk_weights=local.get("topk_weights"),
            input_ids=local.get("input_ids"),
        )
        handle = connector.send_dispatch([payload], metadata)
        return RemoteFFNTransfer(
            connector=connector,
            handle=handle,
            metadata=metadata,
            parent_tokens=parent_tokens,
            layout=layout,
            tp_padding=self.tp_padding if layout is not None else None,
            companions=self._send_empty(connector, stage_idx, payload, 1),
        )
