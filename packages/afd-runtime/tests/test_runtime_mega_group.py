"""Mega over two FFN ranks (``expert_dispatch='ffn'``) through the FFN service, on afd-core's
in-process connector: the Attention rank sends every token once, to its home FFN rank; the FFN
ranks' Megas dispatch and combine among themselves over the connector's group of the FFN ranks
(the reference backend's exchange, gloo between the threads), and the home rank replies with each
token's whole output, equal to one Mega holding every expert."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from afd_core.config import AFDConfig
from afd_core.connector import AFDGroupInfo, create_connector
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_runtime.comm_binding import AFDCommBindError
from afd_runtime.ffn_service import FFNService
from afd_runtime.quantized import QuantizedFFNCompute
from afd_weights import QuantScheme, export_quantized_expert_weights

E, H, INTER, K = 4, 16, 8, 2
LAYERS = (1, 3)
STEPS = (5, 2)
SPEC = AFDPayloadSpec(hidden_size=H, dtype=torch.float32, top_k=K)
_ports = itertools.count(7900)  # in-process worlds are named by host:port; nothing listens


def _sources() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return {
        layer: (
            torch.randn(E, 2 * INTER, H, generator=g) * 0.3,
            torch.randn(E, H, INTER, generator=g),
        )
        for layer in LAYERS
    }


def _float_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: Any, ids: Any) -> Any:
    """fp32 ``sum_k w_k * (silu(x W1^T) * (x W3^T)) W2^T`` over local ids (afd-models' float
    reference)."""
    out = torch.zeros(x.shape[0], H)
    for k in range(ids.shape[1]):
        for e in torch.unique(ids[:, k]).tolist():
            rows = ids[:, k] == e
            h = x[rows].float() @ w13[e].T
            act = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
            out[rows] += w[rows, k : k + 1].float() * (act @ w2[e].T)
    return out


def _model(experts: tuple[int, ...]) -> Any:
    """An FFN model holding ``experts`` (quantized W8A8), as afd-models' FFN role loads them,
    keeping layer 1's float experts (``AFD_REPORT_QUANT_ERROR``)."""
    src = {i: (a[list(experts)], b[list(experts)]) for i, (a, b) in _sources().items()}
    weights = export_quantized_expert_weights(src, scheme=QuantScheme.W8A8)
    kept = src[1]

    class Model:
        afd_moe_layer_indices = LAYERS
        afd_payload_spec = SPEC
        afd_quantized_weights = weights
        afd_compute_top_k = K
        afd_local_experts = experts

        def afd_ffn_forward(self, *args: Any) -> torch.Tensor:
            raise AssertionError("the quantized compute never calls the float path")

        def afd_route(self, layer: int, hidden: torch.Tensor, logits: Any, topk: Any) -> Any:
            assert topk is not None
            return topk[0].float(), topk[1].to(torch.int32)  # one rank: global == local

        def afd_reference_output(self, layer: int, hidden: Any, w: Any, ids: Any) -> Any:
            return _float_moe(hidden, *kept, w, ids) if layer == 1 else None

    return Model()


def _inputs(n: int, step: int, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + layer)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(torch.int32)
    weights = torch.softmax(torch.randn(n, K, generator=g), -1)
    return torch.randn(n, H, generator=g), weights, ids


class _OneRank:
    """What an FFN connector of one FFN rank exposes to a bind (world 1: a local Mega)."""

    def ffn_group_info(self) -> AFDGroupInfo:
        return AFDGroupInfo(name="one/ffn", world_size=1, rank=0, peer_ranks=())

    def ffn_process_group(self) -> Any:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))


def _config(role: str, port: int, **kw: Any) -> AFDConfig:
    raw: dict[str, Any] = {
        "role": role,
        "connector": "inprocess",
        "port": port,
        "num_ffn_ranks": 2,
        "compute_gate_on_attention": True,
        "expert_dispatch": "ffn",
        "timeout_s": 30.0,
        "startup_timeout_s": 60.0,
    }
    if role == "ffn":
        raw.update(ffn_compute="mega", expert_quant="w8a8")
    return AFDConfig.from_mapping({**raw, **kw})


@pytest.mark.timeout(120)
def test_two_ffn_ranks_of_a_collective_mega_answer_as_one_mega_with_every_expert() -> None:
    port = next(_ports)
    computes = [
        QuantizedFFNCompute("mega", _model((0, 1)), max_tokens=16, ffn_rank=0),
        QuantizedFFNCompute("mega", _model((2, 3)), max_tokens=16, ffn_rank=1),
    ]
    services = []
    for r, compute in enumerate(computes):
        cfg = _config("ffn", port, ffn_rank=r)

        def factory(cfg: AFDConfig = cfg, r: int = r, c: Any = compute) -> Any:
            return create_connector(
                cfg, r, payload_spec=SPEC, num_layers=4, role_agreement=c.role_agreement()
            )

        services.append(FFNService(cfg, r, LAYERS, compute, factory))
    for svc in services:
        svc.start()
    attention = create_connector(_config("attention", port), 0, payload_spec=SPEC, num_layers=4)
    got: dict[tuple[int, int], torch.Tensor] = {}
    sent: list[tuple[int, ...]] = []
    try:
        attention.init()
        for step, n in enumerate(STEPS):
            attention.send_control(AFDControlMessage(((n,),)))
            for layer in LAYERS:
                hidden, weights, ids = _inputs(n, step, layer)
                home = attention.topology.home_ffn_rank(0)
                payloads = [
                    AFDPayload(hidden, topk_ids=ids, topk_weights=weights)
                    if f == home
                    else AFDPayload(hidden[:0], topk_ids=ids[:0], topk_weights=weights[:0])
                    for f in range(2)
                ]
                meta = AFDTransferMetadata(layer, 0, tuple(len(p.hidden_states) for p in payloads))
                sent.append(meta.num_tokens)
                parts = attention.recv_combine(attention.send_dispatch(payloads, meta))
                got[(step, layer)] = parts[home]
        attention.send_control(AFDControlMessage.shutdown_message())
    finally:
        attention.close()
        for svc in services:
            svc.stop()
    assert not any(svc.failed for svc in services), [svc._error for svc in services]
    assert all(c.collective and c.binds == 1 for c in computes)
    assert [c.bound_group_name for c in computes] == [computes[0].bound_group_name] * 2
    assert computes[0].bound_group_name.endswith("/g1/ffn")  # the FFN ranks' group's label
    assert sent == [(n, 0) for n in STEPS for _ in LAYERS]  # each token once, to FFN rank 0
    # FFN rank 1 computed no tokens of its own (its share went through the group).
    assert services[1].stats.compute_calls == 0 and services[1].stats.bytes == 0
    assert services[0].stats.compute_calls == len(STEPS) * len(LAYERS)
    # The accuracy measurement (layer 1) goes through the same exchange: against the whole fp32
    # output, W8A8's error; against rank 0's own experts' share alone it would be of order 1.
    calls, worst = computes[0]._errors[1]
    assert calls == len(STEPS) and 1e-5 < worst < 5e-2, worst
    assert 1 not in computes[1]._errors  # no rows of its own to measure
    assert computes[0].role_agreement()["quant_error_layers"] == [1]
    one = QuantizedFFNCompute("mega", _model(tuple(range(E))), max_tokens=16, ffn_rank=0)
    one.bind(_OneRank())  # type: ignore[arg-type]
    assert not one.collective
    for step, n in enumerate(STEPS):
        for layer in LAYERS:
            hidden, weights, ids = _inputs(n, step, layer)
            expected = one(layer, hidden, None, (weights, ids))
            # fp32: each rank's share is its slots' terms; their sum is one Mega's, bit for bit.
            assert torch.equal(got[(step, layer)], expected), (step, layer)


def test_a_collective_mega_needs_the_tokens_global_top_k() -> None:
    """Bound over two FFN ranks, Mega takes the top-k as routed on the Attention role: a call
    without it is refused naming ``topk`` before any collective starts."""
    from afd_core.errors import AFDPayloadError

    class TwoRanks(_OneRank):
        def ffn_group_info(self) -> AFDGroupInfo:
            return AFDGroupInfo(name="two/ffn", world_size=2, rank=0, peer_ranks=(1,))

    mega = QuantizedFFNCompute("mega", _model((0, 1)), max_tokens=8, ffn_rank=0)
    mega.bind(TwoRanks())  # type: ignore[arg-type]
    with pytest.raises(AFDPayloadError) as err:
        mega(1, torch.zeros(2, H), None)
    assert err.value.field == "topk"


def test_mega_over_several_ffn_ranks_needs_their_contiguous_expert_share() -> None:
    """Mega's fused dispatch sends expert ``e`` to FFN rank ``e // experts-per-rank``: a rank
    holding another share is refused at bind, naming ``num_ffn_ranks``."""

    class TwoRanks(_OneRank):
        def ffn_group_info(self) -> AFDGroupInfo:
            return AFDGroupInfo(name="two/ffn", world_size=2, rank=1, peer_ranks=(0,))

    wrong = QuantizedFFNCompute("mega", _model((0, 1)), max_tokens=8, ffn_rank=1)
    with pytest.raises(AFDCommBindError) as err:
        wrong.bind(TwoRanks())  # type: ignore[arg-type]
    assert (err.value.field, err.value.value) == ("num_ffn_ranks", 2)
    assert "FFN rank 1 holds 2 experts (0,)..(1,)" in str(err.value)
    assert wrong.binds == 0
    right = QuantizedFFNCompute("mega", _model((2, 3)), max_tokens=8, ffn_rank=1)
    right.bind(TwoRanks())  # type: ignore[arg-type]
    assert right.collective and right.binds == 1
