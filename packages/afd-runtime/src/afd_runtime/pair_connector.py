"""``PairAttentionConnector``: the Attention side of this runtime's transport as an afd-core connector.

The AFD attention worker installs it in the AFD forward metadata
(:func:`afd_core.forward_context.set_afd_forward_metadata`) around every forward, so model-side
code (afd-remote's ``AFDAttentionFusedMoE`` / ``RemoteFFNProxy``) sends and receives through the
generic :class:`afd_core.connector.AFDConnectorBase` API without knowing this transport.

Invariants:
* payloads are validated against the connector's :class:`afd_core.metadata.AFDPayloadSpec`
  before anything is sent (exact fields, shapes, dtypes);
* one transfer per layer is in flight at a time (the FFN serves layers in order), each handle is
  received exactly once;
* FFN-side methods raise :class:`afd_core.errors.AFDConnectorError` (the FFN role runs
  :class:`afd_runtime.ffn_service.FFNService` instead).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from afd_core.connector import AFDConnectorBase, AFDTransferHandle
from afd_core.errors import AFDConnectorError
from afd_core.metadata import AFDPayload, AFDPayloadSpec, AFDTransferMetadata

from afd_runtime.attention_client import AttentionClient


class PairAttentionConnector(AFDConnectorBase):
    """Attention-side afd-core connector over an :class:`AttentionClient`."""

    name = "afd-runtime-pair"
    has_control_plane = False

    def __init__(
        self, client: AttentionClient, *, payload_spec: AFDPayloadSpec, num_layers: int
    ) -> None:
        super().__init__(
            client.config,
            client.topology,
            client.attention_rank,
            payload_spec=payload_spec,
            num_layers=num_layers,
        )
        self.client = client

    def init(self) -> None:
        self.client.connect()

    def close(self) -> None:
        self.client.close()

    @property
    def is_initialized(self) -> bool:
        return self.client.connected

    def send_attn_output(
        self, payload: AFDPayload, metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        n = metadata.num_tokens[0]
        self.payload_spec.validate_payload(payload, n, payload.hidden_states.device.type)
        self.client.send_layer(metadata.layer_idx, payload.hidden_states, payload.router_logits)
        return AFDTransferHandle(metadata, None, id(self))

    def recv_ffn_output(
        self, handle: AFDTransferHandle, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if handle.connector_id != id(self):
            raise AFDConnectorError("AFD transfer handle belongs to another connector")
        handle.consume()
        n = handle.metadata.num_tokens[0]
        result = self.client.recv_layer(
            handle.metadata.layer_idx, n, self.payload_spec.hidden_size, self.payload_spec.dtype
        )
        if out is not None:
            out.copy_(result)
            return out
        return result

    def recv_attn_output(self, metadata: AFDTransferMetadata) -> list[AFDPayload]:
        raise AFDConnectorError("PairAttentionConnector is Attention-side only")

    def send_ffn_output(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        raise AFDConnectorError("PairAttentionConnector is Attention-side only")
