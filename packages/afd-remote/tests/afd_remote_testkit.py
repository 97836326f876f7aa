"""Test helpers for afd-remote (not a test module): a recording Attention-side connector.

``RecordingConnector`` subclasses afd-core's ``AFDConnectorBase``. ``send_dispatch`` checks
each payload against the connector's payload spec (as a real connector does), records the call
with clones of every payload tensor into a shared event log (one FFN rank: the payload's own
field names; several: ``name[f]``) and computes the "FFN" output of each payload with a row-wise
function; ``recv_combine`` consumes the handle, records the call and returns those outputs (one
per FFN rank). The FFN-side methods (``recv_dispatch``/``send_combine``) are not used on the
Attention side and raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import (
    AFDConnectorBase,
    AFDTransferHandle,
    register_connector,
    unregister_connector,
)
from afd_core.errors import AFDConnectorError
from afd_core.metadata import AFDPayload, AFDPayloadSpec, AFDTransferMetadata

CONNECTOR_NAME = "afd_remote_recording"


@dataclass
class Event:
    """One recorded call: ``kind`` is "send", "yield" or "recv"."""

    kind: str
    layer_idx: int | None = None
    stage_idx: int | None = None
    num_tokens: tuple[int, ...] | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def default_ffn(payload: AFDPayload, metadata: AFDTransferMetadata) -> torch.Tensor:
    """Row-wise and exact for small integers: ``h * 3 + 7 + layer``."""
    return payload.hidden_states * 3 + 7 + metadata.layer_idx


class RecordingConnector(AFDConnectorBase):
    name = CONNECTOR_NAME

    def __init__(
        self,
        payload_spec: AFDPayloadSpec,
        log: list[Event] | None = None,
        ffn: Callable[[AFDPayload, AFDTransferMetadata], torch.Tensor] = default_ffn,
        num_ffn_ranks: int = 1,
    ) -> None:
        super().__init__(_config(num_ffn_ranks), None, 0, payload_spec=payload_spec, num_layers=64)
        self.log: list[Event] = [] if log is None else log
        self.ffn = ffn
        self._initialized = True

    def init(self) -> None:
        self._initialized = True

    def close(self) -> None:
        self._initialized = False

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        if len(payloads) != len(metadata.num_tokens):
            raise AFDConnectorError(
                f"RecordingConnector: {len(payloads)} payloads for counts {metadata.num_tokens}"
            )
        for payload, count in zip(payloads, metadata.num_tokens, strict=True):
            self.payload_spec.validate_payload(payload, count, "cpu")
        if len(payloads) == 1:
            tensors = {k: v.clone() for k, v in payloads[0].tensors().items()}
        else:
            tensors = {
                f"{k}[{f}]": v.clone()
                for f, payload in enumerate(payloads)
                for k, v in payload.tensors().items()
            }
        self.log.append(
            Event("send", metadata.layer_idx, metadata.stage_idx, metadata.num_tokens, tensors)
        )
        return AFDTransferHandle(metadata, [self.ffn(p, metadata) for p in payloads], id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        handle.consume()
        meta = handle.metadata
        self.log.append(Event("recv", meta.layer_idx, meta.stage_idx, meta.num_tokens))
        result: list[torch.Tensor] = handle.state
        return result

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        raise AFDConnectorError("RecordingConnector is Attention-side only")

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        raise AFDConnectorError("RecordingConnector is Attention-side only")


def _config(num_ffn_ranks: int = 1) -> AFDConfig:
    """An Attention config naming this connector (``num_ffn_ranks`` > 1: expert parallel, the
    gate on Attention); the registration lasts only for validation, so the process-wide
    registry is left as it was."""
    register_connector(CONNECTOR_NAME, RecordingConnector, replace=True)
    try:
        return AFDConfig(
            role=AFDRole.ATTENTION,
            connector=CONNECTOR_NAME,
            num_ffn_ranks=num_ffn_ranks,
            compute_gate_on_attention=num_ffn_ranks > 1,
        )
    finally:
        unregister_connector(CONNECTOR_NAME)


def spec(
    hidden: int = 4,
    *,
    router_logits_width: int | None = None,
    top_k: int | None = None,
    input_ids: bool = False,
) -> AFDPayloadSpec:
    """A float32 payload spec with the requested optional fields."""
    return AFDPayloadSpec(
        hidden_size=hidden,
        dtype=torch.float32,
        router_logits_width=router_logits_width,
        router_logits_dtype=torch.float32 if router_logits_width else None,
        top_k=top_k,
        input_ids=input_ids,
    )
