"""Serving obtains its connector from afd-core's registry by ``AFDConfig.connector``.

A connector registered under a test name is selected by both roles' code paths: the Attention
worker's step hook announces every forward through it and installs it for the model's MoE layers;
the FFN service receives, batches and replies through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest
import torch
from afd_core.config import AFDConfig
from afd_core.connector import (
    AFDConnectorBase,
    AFDTransferHandle,
    register_connector,
    unregister_connector,
)
from afd_core.forward_context import get_afd_forward_metadata
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_runtime.attention_link import AttentionLink, say_goodbye
from afd_runtime.ffn_service import FFNService
from afd_runtime.workers.base import build_connector, install_step_hook

NAME = "test-recording"
HIDDEN = 4
SPEC = AFDPayloadSpec(hidden_size=HIDDEN, dtype=torch.float32)


class RecordingConnector(AFDConnectorBase):
    """In-process connector: records every call; the FFN side replays a scripted step list."""

    name = NAME
    has_control_plane = True
    built: ClassVar[list[RecordingConnector]] = []
    script: ClassVar[list[AFDControlMessage]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[Any, ...]] = []
        self.ready = False
        self.released = threading.Event()
        self._control: AFDControlMessage | None = None  # the last one received (FFN side)
        RecordingConnector.built.append(self)

    def init(self) -> None:
        if len(RecordingConnector.built) > 1:  # a second deployment never comes
            self.released.wait(30)
        self.ready = True

    def close(self) -> None:
        self.calls.append(("close",))
        self.ready = False

    def abort(self, op: str, reason: str) -> None:
        self.calls.append(("abort", op, reason))
        self.close()

    @property
    def is_initialized(self) -> bool:
        return self.ready

    def send_control(self, message: AFDControlMessage) -> None:
        self.calls.append(("send_control", message))

    def recv_control(self, timeout_s: float | None = None) -> AFDControlMessage:
        self._control = RecordingConnector.script.pop(0)
        return self._control

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        self.calls.append(("send_dispatch", metadata))
        return AFDTransferHandle(metadata, [p.hidden_states * 2 for p in payloads], id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        handle.consume()
        return list(handle.state)

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        # The counts of the step's control message, as a real connector's headers carry them.
        assert self._control is not None
        metadata = self._control.transfer_metadata(layer_idx, stage_idx)
        self.calls.append(("recv_dispatch", metadata))
        return metadata, [
            AFDPayload(torch.full((n, HIDDEN), 10.0 * peer + metadata.layer_idx))
            for peer, n in enumerate(metadata.num_tokens)
        ]

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        self.calls.append(("send_combine", metadata, outputs))


@pytest.fixture
def recording() -> Iterator[type[RecordingConnector]]:
    register_connector(NAME, RecordingConnector)
    RecordingConnector.built = []
    try:
        yield RecordingConnector
    finally:
        unregister_connector(NAME)


def test_attention_forward_announces_and_installs_the_selected_connector(
    recording: type[RecordingConnector],
) -> None:
    cfg = AFDConfig.from_mapping({"role": "attention", "connector": NAME})
    connector = build_connector(cfg, 0, SPEC, (1, 3), "cpu")
    assert type(connector) is recording and connector.num_layers == 4
    connector.init()

    class Model(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            meta = get_afd_forward_metadata()
            assert meta.connector is connector and meta.num_tokens == (input_ids.shape[0],)
            h = torch.ones(input_ids.shape[0], HIDDEN)
            md = AFDTransferMetadata(1, 0, (input_ids.shape[0],))
            return meta.connector.recv_combine(meta.connector.send_dispatch([AFDPayload(h)], md))[0]

    model = Model()
    link = AttentionLink(connector)
    install_step_hook(model, link)
    install_step_hook(model, link)  # idempotent: one announcement per forward
    out = model(torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert torch.equal(out, torch.full((3, HIDDEN), 2.0))
    assert [c[0] for c in connector.calls] == ["send_control", "send_dispatch"]
    assert connector.calls[0][1] == AFDControlMessage(((3,),))
    say_goodbye(connector)
    assert connector.calls[-2:] == [
        ("send_control", AFDControlMessage.shutdown_message()),
        ("close",),
    ]


def test_ffn_service_batches_its_peers_through_the_selected_connector(
    recording: type[RecordingConnector],
) -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn", "connector": NAME, "num_attention_ranks": 2})
    recording.script = [
        AFDControlMessage(((2, 3),)),
        AFDControlMessage(((0, 0),)),  # both peers empty: nothing to compute
        AFDControlMessage(((1, 0),)),
        AFDControlMessage.shutdown_message(),
    ]
    computed: list[tuple[int, torch.Tensor]] = []

    def compute(layer: int, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        computed.append((layer, hidden.clone()))
        return hidden + 1

    before = _ffn_samples()
    svc = FFNService(cfg, 0, (1, 3), compute, lambda: build_connector(cfg, 0, SPEC, (1, 3), "cpu"))
    svc.start()
    try:
        deadline = threading.Event()
        for _ in range(300):
            if len(recording.built) == 2:
                break
            deadline.wait(0.01)
        assert len(recording.built) == 2, "the service did not wait for a next deployment"
    finally:
        svc.stop()
        recording.built[-1].released.set()
    first = recording.built[0]
    assert first.calls[-1] == ("close",)
    # One compute per (step, layer) over both peers, rows concatenated in peer order.
    assert [(layer, tuple(h.shape)) for layer, h in computed] == [
        (1, (5, HIDDEN)),
        (3, (5, HIDDEN)),
        (1, (1, HIDDEN)),
        (3, (1, HIDDEN)),
    ]
    assert torch.equal(computed[0][1][:2], torch.full((2, HIDDEN), 1.0))
    assert torch.equal(computed[0][1][2:], torch.full((3, HIDDEN), 11.0))
    sent = [c for c in first.calls if c[0] == "send_combine"]
    assert [c[1].num_tokens for c in sent] == [(2, 3), (2, 3), (0, 0), (0, 0), (1, 0), (1, 0)]
    assert torch.equal(sent[0][2], computed[0][1] + 1)
    # A step with no tokens computes nothing and replies with one empty part per peer.
    assert [tuple(t.shape) for t in sent[2][2]] == [(0, HIDDEN), (0, HIDDEN)]
    assert (svc.stats.steps, svc.stats.compute_calls, svc.stats.tokens) == (3, 4, 12)
    # The same counts on the role's metrics: one call per layer and step with tokens.
    assert _ffn_samples() == {
        "steps": before["steps"] + 3,
        "tokens": before["tokens"] + 12,
        "layer 1": before["layer 1"] + 2,
        "layer 3": before["layer 3"] + 2,
    }
    assert not svc.failed


def _ffn_samples() -> dict[str, float]:
    """FFN rank 0's afd_* counters in this process (shared by every test: compare deltas)."""
    from prometheus_client import REGISTRY

    labels = {"role": "ffn", "rank": "0"}

    def get(name: str, **extra: str) -> float:
        return REGISTRY.get_sample_value(name, {**labels, **extra}) or 0.0

    return {
        "steps": get("afd_steps_total"),
        "tokens": get("afd_ffn_tokens_per_call_sum"),
        "layer 1": get("afd_ffn_compute_calls_total", layer="1"),
        "layer 3": get("afd_ffn_compute_calls_total", layer="3"),
    }


def test_two_stage_deployment_announces_an_unsplit_step_with_an_empty_second_stage(
    recording: type[RecordingConnector],
) -> None:
    cfg = AFDConfig.from_mapping({"role": "attention", "connector": NAME, "num_stages": 2})
    connector = build_connector(cfg, 0, SPEC, (1,), "cpu")
    connector.init()
    seen = []

    class Model(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
            meta = get_afd_forward_metadata()
            seen.append((meta.stage_idx, meta.num_stages, meta.num_tokens))
            return input_ids

    model = Model()
    install_step_hook(model, AttentionLink(connector), cfg.num_stages, cfg.timeout_s)
    model(torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert connector.calls == [("send_control", AFDControlMessage(((3,), (0,))))]
    assert seen == [(0, 2, (3, 0))]


def test_ffn_service_serves_every_stage_of_every_layer_in_order(
    recording: type[RecordingConnector],
) -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn", "connector": NAME, "num_stages": 2})
    recording.script = [
        AFDControlMessage(((2,), (3,))),
        AFDControlMessage(((4,), (0,))),
        AFDControlMessage.shutdown_message(),
    ]
    computed: list[tuple[int, int]] = []

    def compute(layer: int, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        computed.append((layer, hidden.shape[0]))
        return hidden + 1

    svc = FFNService(cfg, 0, (1, 3), compute, lambda: build_connector(cfg, 0, SPEC, (1, 3), "cpu"))
    svc.start()
    try:
        for _ in range(300):
            if len(recording.built) == 2:
                break
            threading.Event().wait(0.01)
    finally:
        svc.stop()
        recording.built[-1].released.set()
    received = [
        (c[1].layer_idx, c[1].stage_idx, c[1].num_tokens)
        for c in recording.built[0].calls
        if c[0] == "recv_dispatch"
    ]
    assert received == [
        (1, 0, (2,)),
        (1, 1, (3,)),
        (3, 0, (2,)),
        (3, 1, (3,)),
        (1, 0, (4,)),
        (1, 1, (0,)),
        (3, 0, (4,)),
        (3, 1, (0,)),
    ]
    # An empty stage computes nothing.
    assert computed == [(1, 2), (1, 3), (3, 2), (3, 3), (1, 4), (3, 4)]
    assert not svc.failed


def test_ffn_service_refuses_a_step_with_another_stage_count(
    recording: type[RecordingConnector],
) -> None:
    from afd_core.errors import AFDProtocolError
    from afd_runtime.ffn_service import FFNServiceError

    cfg = AFDConfig.from_mapping({"role": "ffn", "connector": NAME, "num_stages": 2})
    recording.script = [AFDControlMessage(((5,),))]
    svc = FFNService(
        cfg, 0, (1,), lambda _layer, h, _g: h, lambda: build_connector(cfg, 0, SPEC, (1,), "cpu")
    )
    svc.start()
    assert svc.wait(10)
    with pytest.raises(FFNServiceError) as info:
        svc.raise_if_failed()
    cause = info.value.__cause__
    assert isinstance(cause, AFDProtocolError)
    assert "announced 1 stage(s)" in str(cause) and "num_stages=2" in str(cause)
    conn = recording.built[0]
    assert not [c for c in conn.calls if c[0] == "recv_dispatch"]
    # The Attention ranks are told why (their waits fail at once instead of timing out).
    assert ("abort", "recv_control", str(cause)) in conn.calls
