"""RemoteFFNProxy and AFDAttentionFusedMoE against a recording connector.

Proves the call order (send -> DBO yield -> receive), the stage taken from the forward context,
each payload per gate placement, the dispatch/receive split with two stages interleaved, and that
every rejected input fails before anything is sent.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDConnectorError, AFDContextError, AFDPayloadError
from afd_core.forward_context import (
    AFDForwardMetadata,
    install_stage_hooks,
    set_afd_forward_metadata,
)
from afd_remote import (
    AFDAttentionFusedMoE,
    AFDRemoteError,
    RemoteFFNProxy,
    RemoteFFNTransfer,
    UnsupportedPayloadFieldError,
    softmax_topk,
)
from afd_remote_testkit import Event, RecordingConnector, spec


class RecordingStageHooks:
    """The runtime's stage hooks as a recording fake: a yield is logged; ``stage`` is the stage
    the runtime reports (``None``: no stage executor runs, the metadata's stage counts)."""

    def __init__(self, log: list[Event], stage: int | None = 0) -> None:
        self.log = log
        self.stage = stage

    def current_stage(self) -> int | None:
        return self.stage

    def yield_stage(self) -> None:
        self.log.append(Event("yield"))

    def lookup_metadata(self) -> AFDForwardMetadata | None:
        return None


@pytest.fixture
def log() -> list[Event]:
    return []


@pytest.fixture
def dbo(log: list[Event]) -> Iterator[RecordingStageHooks]:
    fake = RecordingStageHooks(log)
    previous = install_stage_hooks(fake)
    yield fake
    install_stage_hooks(previous)


def _hidden(rows: int, width: int = 4, offset: int = 0) -> torch.Tensor:
    return (torch.arange(rows * width, dtype=torch.float32).view(rows, width) + offset) % 97


def _logits(rows: int, experts: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 31 + experts)
    return torch.randn(rows, experts, generator=gen)


def _kinds(log: list[Event]) -> list[tuple[str, int | None, int | None]]:
    return [(e.kind, e.layer_idx, e.stage_idx) for e in log]


def _meta(conn: AFDConnectorBase, stage: int = 0, stages: int = 1) -> AFDForwardMetadata:
    return AFDForwardMetadata(connector=conn, stage_idx=stage, num_stages=stages)


# -- RemoteFFNProxy ---------------------------------------------------------------------------


def test_proxies_are_parameter_free() -> None:
    for module in (
        RemoteFFNProxy(0),
        AFDAttentionFusedMoE(0, gate_on_attention=True, top_k=2),
        AFDAttentionFusedMoE(1, gate_on_attention=False),
    ):
        assert list(module.parameters()) == []
        assert list(module.buffers()) == []
        assert isinstance(module, torch.nn.Module)


def test_forward_sends_yields_then_receives(log: list[Event], dbo: RecordingStageHooks) -> None:
    conn = RecordingConnector(spec(), log)
    proxy = RemoteFFNProxy(3)
    hidden = _hidden(5)
    with set_afd_forward_metadata(_meta(conn)):
        out = proxy(hidden)
    assert _kinds(log) == [("send", 3, 0), ("yield", None, None), ("recv", 3, 0)]
    assert log[0].num_tokens == (5,)
    assert list(log[0].tensors) == ["hidden_states"]
    assert torch.equal(log[0].tensors["hidden_states"], hidden)
    assert torch.equal(out, hidden * 3 + 7 + 3)


def test_stage_comes_from_the_runtime_hooks_when_a_stage_runs(
    log: list[Event], dbo: RecordingStageHooks
) -> None:
    conn = RecordingConnector(spec(), log)
    dbo.stage = 1
    with set_afd_forward_metadata(_meta(conn, stage=0, stages=2)):
        RemoteFFNProxy(2)(_hidden(2))
    assert _kinds(log) == [("send", 2, 1), ("yield", None, None), ("recv", 2, 1)]


def test_stage_comes_from_metadata_when_the_hooks_run_no_stage(
    log: list[Event], dbo: RecordingStageHooks
) -> None:
    conn = RecordingConnector(spec(), log)
    dbo.stage = None
    with set_afd_forward_metadata(_meta(conn, stage=1, stages=2)):
        RemoteFFNProxy(4)(_hidden(2))
    assert _kinds(log) == [("send", 4, 1), ("yield", None, None), ("recv", 4, 1)]


def test_without_runtime_hooks_nothing_yields_and_the_metadata_names_the_stage(
    log: list[Event],
) -> None:
    conn = RecordingConnector(spec(), log)
    previous = install_stage_hooks(None)
    try:
        with set_afd_forward_metadata(_meta(conn, stage=1, stages=2)):
            RemoteFFNProxy(4)(_hidden(2))
    finally:
        install_stage_hooks(previous)
    assert _kinds(log) == [("send", 4, 1), ("recv", 4, 1)]


def test_missing_context_is_a_clear_error(log: list[Event]) -> None:
    with pytest.raises(AFDContextError, match=r"RemoteFFNProxy\(layer_idx=3\) requires AFD"):
        RemoteFFNProxy(3)(_hidden(2))
    with pytest.raises(AFDContextError, match=r"AFDAttentionFusedMoE\(layer_idx=1\)"):
        AFDAttentionFusedMoE(1, gate_on_attention=False)(_hidden(2))
    assert log == []


def test_zero_tokens_round_trip(log: list[Event], dbo: RecordingStageHooks) -> None:
    conn = RecordingConnector(spec(), log)
    with set_afd_forward_metadata(_meta(conn)):
        out = RemoteFFNProxy(0)(_hidden(0))
    assert log[0].num_tokens == (0,)
    assert out.shape == (0, 4)


def test_dispatch_receive_split_two_stages_interleaved(log: list[Event]) -> None:
    """A(L,s) D(L,s) pipeline: each receive runs after the other stage's dispatch and returns its
    own stage's output, even when the context has moved on to the other stage."""
    conn = RecordingConnector(spec(), log)
    layers = [RemoteFFNProxy(0), RemoteFFNProxy(1)]
    x = {0: _hidden(3, offset=1), 1: _hidden(2, offset=50)}
    pending: dict[int, RemoteFFNTransfer] = {}
    for layer in layers:
        for stage in (0, 1):
            with set_afd_forward_metadata(_meta(conn, stage=stage, stages=2)):
                log.append(Event("attend", layer.layer_idx, stage))
                other = 1 - stage
                if other in pending:
                    transfer = pending.pop(other)
                    x[other] = layers[transfer.layer_idx].receive(transfer)
                pending[stage] = layer.dispatch(x[stage])
    assert list(pending) == [1]
    x[1] = layers[1].receive(pending.pop(1))
    assert _kinds(log) == [
        ("attend", 0, 0),
        ("send", 0, 0),
        ("attend", 0, 1),
        ("recv", 0, 0),
        ("send", 0, 1),
        ("attend", 1, 0),
        ("recv", 0, 1),
        ("send", 1, 0),
        ("attend", 1, 1),
        ("recv", 1, 0),
        ("send", 1, 1),
        ("recv", 1, 1),
    ]
    # Layer 1 received layer 0's output of the same stage; results are per stage.
    sends = [e for e in log if e.kind == "send"]
    h0, h1 = _hidden(3, offset=1), _hidden(2, offset=50)
    assert torch.equal(sends[2].tensors["hidden_states"], h0 * 3 + 7)
    assert torch.equal(sends[3].tensors["hidden_states"], h1 * 3 + 7)
    assert torch.equal(x[0], (h0 * 3 + 7) * 3 + 8)
    assert torch.equal(x[1], (h1 * 3 + 7) * 3 + 8)


def test_receive_outside_context_uses_the_transfer_connector(log: list[Event]) -> None:
    conn = RecordingConnector(spec(), log)
    proxy = RemoteFFNProxy(5)
    with set_afd_forward_metadata(_meta(conn, stage=1, stages=2)):
        transfer = proxy.dispatch(_hidden(2))
    assert (transfer.layer_idx, transfer.stage_idx, transfer.connector) == (5, 1, conn)
    out = proxy.receive(transfer)
    assert torch.equal(out, _hidden(2) * 3 + 12)
    with pytest.raises(AFDConnectorError, match="already received"):
        proxy.receive(transfer)


def test_receive_checks_the_row_count(log: list[Event]) -> None:
    conn = RecordingConnector(spec(), log, ffn=lambda p, m: p.hidden_states[:1])
    with set_afd_forward_metadata(_meta(conn)), pytest.raises(AFDPayloadError) as info:
        RemoteFFNProxy(0)(_hidden(3))
    assert info.value.field == "ffn_output"


def test_proxy_dispatch_rejects_fields_before_sending(log: list[Event]) -> None:
    conn = RecordingConnector(spec(), log)
    proxy = RemoteFFNProxy(0)
    with set_afd_forward_metadata(_meta(conn)):
        with pytest.raises(UnsupportedPayloadFieldError) as info:
            proxy.dispatch(_hidden(2), input_ids=torch.arange(2))
        assert info.value.field == "input_ids"
        assert info.value.supported == ("hidden_states",)
        with pytest.raises(AFDPayloadError) as err:
            proxy.dispatch(_hidden(2), router_logits=torch.zeros(3, 4))
        assert err.value.field == "router_logits"
    logits_conn = RecordingConnector(spec(router_logits_width=4), log)
    with set_afd_forward_metadata(_meta(logits_conn)), pytest.raises(AFDPayloadError) as err:
        proxy.dispatch(_hidden(2))
    assert err.value.field == "router_logits"
    assert log == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"layer_idx": -1}, "layer_idx"),
        ({"layer_idx": True}, "layer_idx"),
        ({"layer_idx": 0, "tp_padding": object()}, "tp_padding"),
    ],
)
def test_proxy_constructor_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(AFDRemoteError) as info:
        RemoteFFNProxy(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


# -- AFDAttentionFusedMoE ---------------------------------------------------------------------


def test_gate_on_ffn_sends_hidden_states_only(log: list[Event], dbo: RecordingStageHooks) -> None:
    conn = RecordingConnector(spec(), log)
    moe = AFDAttentionFusedMoE(7, gate_on_attention=False)
    hidden = _hidden(4)
    with set_afd_forward_metadata(_meta(conn)):
        out = moe(hidden)
    assert _kinds(log) == [("send", 7, 0), ("yield", None, None), ("recv", 7, 0)]
    assert list(log[0].tensors) == ["hidden_states"]
    assert torch.equal(log[0].tensors["hidden_states"], hidden)
    assert torch.equal(out, hidden * 3 + 14)


def test_gate_on_attention_sends_router_logits(log: list[Event], dbo: RecordingStageHooks) -> None:
    conn = RecordingConnector(spec(router_logits_width=6), log)
    moe = AFDAttentionFusedMoE(2, gate_on_attention=True, top_k=2)
    hidden, logits = _hidden(3), _logits(3, 6)
    with set_afd_forward_metadata(_meta(conn)):
        out = moe(hidden, logits)
    assert _kinds(log) == [("send", 2, 0), ("yield", None, None), ("recv", 2, 0)]
    assert list(log[0].tensors) == ["hidden_states", "router_logits"]
    assert torch.equal(log[0].tensors["router_logits"], logits)
    assert torch.equal(out, hidden * 3 + 9)


@pytest.mark.parametrize("renormalize", [True, False])
def test_gate_on_attention_sends_topk(
    log: list[Event], dbo: RecordingStageHooks, renormalize: bool
) -> None:
    conn = RecordingConnector(spec(top_k=2), log)
    moe = AFDAttentionFusedMoE(1, gate_on_attention=True, top_k=2, renormalize=renormalize)
    hidden, logits = _hidden(5), _logits(5, 8)
    with set_afd_forward_metadata(_meta(conn)):
        moe(hidden, logits)
    assert _kinds(log) == [("send", 1, 0), ("yield", None, None), ("recv", 1, 0)]
    sent = log[0].tensors
    assert list(sent) == ["hidden_states", "topk_ids", "topk_weights"]
    probs = torch.softmax(logits, dim=-1)
    order = probs.argsort(dim=-1, descending=True)[:, :2]
    assert torch.equal(sent["topk_ids"], order.to(torch.int32))
    kept = probs.gather(1, order)
    if renormalize:
        kept = kept / kept.sum(dim=-1, keepdim=True)
    assert sent["topk_weights"].dtype == torch.float32
    assert torch.allclose(sent["topk_weights"], kept, rtol=0, atol=1e-6)


def test_gate_on_attention_sends_logits_and_topk_when_both_carried(log: list[Event]) -> None:
    conn = RecordingConnector(spec(router_logits_width=4, top_k=1), log)
    calls: list[tuple[int, bool]] = []

    def router(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((k, renorm))
        ids = logits.argmin(dim=-1, keepdim=True)
        return torch.ones_like(ids, dtype=torch.float64), ids

    moe = AFDAttentionFusedMoE(
        0, gate_on_attention=True, top_k=1, renormalize=False, routing_fn=router
    )
    logits = _logits(3, 4)
    with set_afd_forward_metadata(_meta(conn)):
        moe(_hidden(3), logits)
    sent = log[0].tensors
    assert calls == [(1, False)]
    assert list(sent) == ["hidden_states", "router_logits", "topk_ids", "topk_weights"]
    assert torch.equal(sent["router_logits"], logits)
    # The router's ids/weights are sent, cast to the connector's wire dtypes.
    assert torch.equal(sent["topk_ids"], logits.argmin(dim=-1, keepdim=True).to(torch.int32))
    assert torch.equal(sent["topk_weights"], torch.ones(3, 1))


def test_input_ids_travel_when_the_connector_carries_them(log: list[Event]) -> None:
    conn = RecordingConnector(spec(input_ids=True), log)
    ids = torch.tensor([5, 9, 2])
    with set_afd_forward_metadata(_meta(conn)):
        AFDAttentionFusedMoE(0, gate_on_attention=False)(_hidden(3), input_ids=ids)
    assert list(log[0].tensors) == ["hidden_states", "input_ids"]
    assert torch.equal(log[0].tensors["input_ids"], ids)


_H = _hidden(3)


@pytest.mark.parametrize(
    ("connector_spec", "moe_kwargs", "call", "error", "field"),
    [
        # Input ids on a connector that cannot carry them.
        (
            spec(),
            {"gate_on_attention": False},
            {"input_ids": torch.arange(3)},
            UnsupportedPayloadFieldError,
            "input_ids",
        ),
        # A connector that needs input ids, none given.
        (spec(input_ids=True), {"gate_on_attention": False}, {}, AFDPayloadError, "input_ids"),
        # Gate on FFN but router logits given.
        (
            spec(),
            {"gate_on_attention": False},
            {"router_logits": torch.zeros(3, 4)},
            AFDRemoteError,
            "router_logits",
        ),
        # Gate on FFN but the connector expects routing data.
        (
            spec(router_logits_width=4),
            {"gate_on_attention": False},
            {},
            AFDPayloadError,
            "router_logits",
        ),
        (spec(top_k=2), {"gate_on_attention": False}, {}, AFDPayloadError, "topk_ids"),
        # Gate on Attention without router logits.
        (
            spec(router_logits_width=4),
            {"gate_on_attention": True},
            {},
            AFDPayloadError,
            "router_logits",
        ),
        # Gate on Attention, connector carries no routing field at all.
        (
            spec(),
            {"gate_on_attention": True, "top_k": 2},
            {"router_logits": torch.zeros(3, 4)},
            UnsupportedPayloadFieldError,
            "router_logits",
        ),
        # Top-k connector without top_k.
        (
            spec(top_k=2),
            {"gate_on_attention": True},
            {"router_logits": torch.zeros(3, 4)},
            AFDRemoteError,
            "top_k",
        ),
        # Row mismatches.
        (
            spec(router_logits_width=4),
            {"gate_on_attention": True},
            {"router_logits": torch.zeros(2, 4)},
            AFDPayloadError,
            "router_logits",
        ),
        (
            spec(input_ids=True),
            {"gate_on_attention": False},
            {"input_ids": torch.arange(4)},
            AFDPayloadError,
            "input_ids",
        ),
        # top_k different from the connector's spec.
        (
            spec(top_k=2),
            {"gate_on_attention": True, "top_k": 3},
            {"router_logits": torch.zeros(3, 4)},
            AFDRemoteError,
            "top_k",
        ),
        # top_k larger than the expert count.
        (
            spec(top_k=5),
            {"gate_on_attention": True, "top_k": 5},
            {"router_logits": torch.zeros(3, 4)},
            AFDRemoteError,
            "top_k",
        ),
        # A custom router returning the wrong shape.
        (
            spec(top_k=2),
            {
                "gate_on_attention": True,
                "top_k": 2,
                "routing_fn": lambda lg, k, r: (torch.ones(3, 1), torch.zeros(3, 2)),
            },
            {"router_logits": torch.zeros(3, 4)},
            AFDRemoteError,
            "routing_fn.topk_weights",
        ),
    ],
)
def test_fused_moe_rejects_before_sending(
    log: list[Event],
    connector_spec: object,
    moe_kwargs: dict[str, object],
    call: dict[str, torch.Tensor],
    error: type[Exception],
    field: str,
) -> None:
    conn = RecordingConnector(connector_spec, log)  # type: ignore[arg-type]
    moe = AFDAttentionFusedMoE(0, **moe_kwargs)  # type: ignore[arg-type]
    with set_afd_forward_metadata(_meta(conn)), pytest.raises(error) as info:
        moe(_H, **call)
    assert info.value.field == field  # type: ignore[attr-defined]
    assert log == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"gate_on_attention": "yes"}, "gate_on_attention"),
        ({"gate_on_attention": True, "top_k": 0}, "top_k"),
        ({"gate_on_attention": True, "top_k": True}, "top_k"),
        ({"gate_on_attention": True, "renormalize": 1}, "renormalize"),
        ({"gate_on_attention": True, "routing_fn": 3}, "routing_fn"),
    ],
)
def test_fused_moe_constructor_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(AFDRemoteError) as info:
        AFDAttentionFusedMoE(0, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_softmax_topk_rejects() -> None:
    with pytest.raises(AFDRemoteError) as info:
        softmax_topk(torch.zeros(4), 1, True)
    assert info.value.field == "router_logits"
    with pytest.raises(AFDRemoteError) as info:
        softmax_topk(torch.zeros(2, 3), 4, True)
    assert info.value.field == "top_k"


# -- two stages, one of them empty --------------------------------------------------------------


def test_a_lone_stage_also_carries_the_empty_stage_at_every_layer(
    log: list[Event], dbo: RecordingStageHooks
) -> None:
    """A step of a 2-stage deployment that runs as one stage (one request) announces 0 tokens
    for stage 1; each layer's dispatch then also sends stage 1's zero-token transfer right after
    its own, and the receive completes it after its own: every (layer, stage) is on the wire."""
    conn = RecordingConnector(spec(router_logits_width=4), log)
    proxy = AFDAttentionFusedMoE(2, gate_on_attention=True)
    hidden, logits = _hidden(3), _logits(3, 4)
    meta = AFDForwardMetadata(connector=conn, stage_idx=0, num_stages=2, num_tokens=(3, 0))
    with set_afd_forward_metadata(meta):
        out = proxy(hidden, logits)
    assert _kinds(log) == [
        ("send", 2, 0),
        ("send", 2, 1),
        ("yield", None, None),
        ("recv", 2, 0),
        ("recv", 2, 1),
    ]
    assert [e.num_tokens for e in log if e.kind == "send"] == [(3,), (0,)]
    empty = log[1].tensors
    assert set(empty) == {"hidden_states", "router_logits"}
    assert empty["hidden_states"].shape == (0, 4) and empty["router_logits"].shape == (0, 4)
    assert torch.equal(out, hidden * 3 + 9)


@pytest.mark.parametrize("counts", [(3, 2), None])
def test_split_or_unannounced_steps_send_no_empty_transfer(
    log: list[Event], counts: tuple[int, int] | None
) -> None:
    conn = RecordingConnector(spec(), log)
    meta = AFDForwardMetadata(connector=conn, stage_idx=0, num_stages=2, num_tokens=counts)
    with set_afd_forward_metadata(meta):
        RemoteFFNProxy(0)(_hidden(3))
    assert _kinds(log) == [("send", 0, 0), ("recv", 0, 0)]
