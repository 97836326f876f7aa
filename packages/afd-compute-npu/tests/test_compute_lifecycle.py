"""Construction, binding, workspace ownership and input rejection of Layered and Mega."""

from typing import Any

import afd_compute_npu.layered as layered_module
import pytest
import torch
from afd_compute_npu import (
    ComputeConfig,
    ComputeConfigError,
    ComputeInputError,
    LayeredCompute,
    MegaCommParams,
    MegaCompute,
    MegaNotBoundError,
    ReferenceBackend,
)
from afd_weights import QuantizedExpertWeights, QuantScheme, export_quantized_expert_weights

E, H, INTER, K, MAX_T = 4, 32, 16, 2, 8


def weights(scheme: QuantScheme = QuantScheme.W8A8, clamp: float = 0.0) -> QuantizedExpertWeights:
    g = torch.Generator().manual_seed(1)
    src = {
        i: (torch.randn(E, 2 * INTER, H, generator=g), torch.randn(E, H, INTER, generator=g))
        for i in (0, 6)
    }
    return export_quantized_expert_weights(src, scheme=scheme, swiglu_limit=clamp)


def cfg(**kw: Any) -> ComputeConfig:
    args: dict[str, Any] = {"max_tokens": MAX_T, "top_k": K}
    args.update(kw)
    return ComputeConfig(**args)


def inputs(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
    ids = (torch.arange(t * K).reshape(t, K) % E).to(torch.int32)
    w = torch.full((t, K), 0.5, dtype=torch.bfloat16)
    return x, ids, w


PARAMS = MegaCommParams(group_name="g0", world_size=1, rank=0, peer_ranks=())


def test_mega_refuses_to_run_unbound_before_any_side_effect() -> None:
    mega = MegaCompute(weights(), cfg(), ReferenceBackend())
    assert not mega.is_bound
    x, ids, w = inputs(3)
    with pytest.raises(MegaNotBoundError, match="bind"):
        mega(0, x, ids, w)
    with pytest.raises(MegaNotBoundError):
        _ = mega.graph_signature
    assert not bool(mega.workspace.out.any())
    mega.bind(PARAMS)
    assert mega.is_bound and mega.comm is PARAMS
    assert mega(0, x, ids, w).shape == (3, H)


def test_bind_accepts_only_comm_params_and_only_once() -> None:
    class FakeConnector:
        group_name = "g0"

    mega = MegaCompute(weights(), cfg(), ReferenceBackend())
    with pytest.raises(ComputeConfigError) as info:
        mega.bind(FakeConnector())  # type: ignore[arg-type]
    assert info.value.field == "params" and info.value.value == "FakeConnector"
    mega.bind(PARAMS)
    with pytest.raises(ComputeConfigError) as info:
        mega.bind(MegaCommParams(group_name="g1", world_size=2, rank=1, peer_ranks=(0,)))
    assert info.value.field == "params"
    assert mega.comm is PARAMS


def test_mega_neither_builds_layered_nor_keeps_a_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object, **__: object) -> None:
        raise AssertionError("Mega must not construct Layered")

    monkeypatch.setattr(layered_module.LayeredCompute, "__init__", boom)
    mega = MegaCompute(weights(), cfg(), ReferenceBackend())
    mega.bind(PARAMS)
    allowed = (QuantizedExpertWeights, ComputeConfig, ReferenceBackend, MegaCommParams, dict)
    for name, value in vars(mega).items():
        assert isinstance(value, allowed) or name == "workspace", name
    assert not any("connector" in name.lower() for name in vars(mega))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"group_name": ""}, "group_name"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"peer_ranks": [1]}, "peer_ranks"),
        ({"peer_ranks": (0,)}, "peer_ranks"),
        ({"peer_ranks": (1, 1)}, "peer_ranks"),
        ({"peer_ranks": (5,)}, "peer_ranks"),
        ({"comm_args": "ctx"}, "comm_args"),
    ],
)
def test_comm_params_validation(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"group_name": "g", "world_size": 2, "rank": 0, "peer_ranks": (1,)}
    args.update(kwargs)
    with pytest.raises(ComputeConfigError) as info:
        MegaCommParams(**args)
    assert info.value.field == field


@pytest.mark.parametrize("kind", [LayeredCompute, MegaCompute])
def test_workspace_is_allocated_once_and_reused(kind: type) -> None:
    comp = kind(weights(QuantScheme.W4A8_PER_CHANNEL), cfg(), ReferenceBackend())
    if isinstance(comp, MegaCompute):
        comp.bind(PARAMS)
    ptrs = {n: t.data_ptr() for n, t in comp.workspace.buffers().items()}
    outs = []
    for t in (MAX_T, 1, 5, 0, MAX_T):
        x, ids, w = inputs(t)
        out = comp(6, x, ids, w)
        assert out.shape == (t, H)
        if t:
            assert out.data_ptr() == comp.workspace.out.data_ptr()
        outs.append(out.clone())
    assert {n: t.data_ptr() for n, t in comp.workspace.buffers().items()} == ptrs
    assert torch.equal(outs[0], outs[-1])


def test_only_layered_w8a8_owns_a_zero_bias() -> None:
    w8 = weights(QuantScheme.W8A8)
    layered = LayeredCompute(w8, cfg(), ReferenceBackend())
    assert layered.workspace.zero_bias is not None
    assert layered.workspace.zero_bias.shape == (E, H)
    assert layered.workspace.zero_bias.dtype == torch.int32
    assert MegaCompute(w8, cfg(), ReferenceBackend()).workspace.zero_bias is None
    w4 = weights(QuantScheme.W4A8_PER_CHANNEL)
    assert LayeredCompute(w4, cfg(), ReferenceBackend()).workspace.zero_bias is None


def test_graph_signatures() -> None:
    w = weights()
    a = LayeredCompute(w, cfg(), ReferenceBackend()).graph_signature
    b = LayeredCompute(w, cfg(), ReferenceBackend()).graph_signature
    assert a == b and a.digest() == b.digest()
    assert a != LayeredCompute(w, cfg(max_tokens=16), ReferenceBackend()).graph_signature
    mega = MegaCompute(w, cfg(), ReferenceBackend())
    mega.bind(PARAMS)
    other = MegaCompute(w, cfg(), ReferenceBackend())
    other.bind(MegaCommParams(group_name="g9", world_size=2, rank=0, peer_ranks=(1,)))
    assert mega.graph_signature != other.graph_signature
    assert mega.graph_signature.weights == a.weights


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"dtype": torch.int8}, "dtype"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
        ({"check_values": 1}, "check_values"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ComputeConfigError) as info:
        cfg(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize("kind", [LayeredCompute, MegaCompute])
@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: (weights(), cfg(top_k=E + 1)), "top_k"),
        (lambda: (weights(clamp=10.0), cfg()), "swiglu_limit"),
        (lambda: (weights(), cfg(routed_scaling_factor=2.0)), "routed_scaling_factor"),
        (lambda: ("weights", cfg()), "weights"),
        (lambda: (weights(), {"max_tokens": 4}), "config"),
    ],
)
def test_construction_errors(kind: type, build: Any, field: str) -> None:
    w, c = build()
    with pytest.raises(ComputeConfigError) as info:
        kind(w, c, ReferenceBackend())
    assert info.value.field == field
    with pytest.raises(ComputeConfigError) as info:
        kind(weights(), cfg(), "reference")
    assert info.value.field == "backend"


def _bad_inputs() -> list[tuple[str, dict[str, Any], str]]:
    x, ids, w = inputs(3)
    return [
        ("unknown layer", {"layer_id": 3}, "layer_id"),
        ("bool layer", {"layer_id": True}, "layer_id"),
        ("not a tensor", {"hidden_states": [[0.0] * H]}, "hidden_states"),
        ("1-D", {"hidden_states": x[0]}, "hidden_states.shape"),
        ("hidden size", {"hidden_states": x[:, :-1]}, "hidden_states.shape"),
        (
            "too many tokens",
            {"hidden_states": torch.zeros(MAX_T + 1, H, dtype=torch.bfloat16)},
            "hidden_states.shape[0]",
        ),
        ("dtype", {"hidden_states": x.float()}, "hidden_states.dtype"),
        ("ids shape", {"topk_ids": ids[:, :1]}, "topk_ids.shape"),
        ("ids rows", {"topk_ids": ids[:2]}, "topk_ids.shape"),
        ("ids dtype", {"topk_ids": ids.float()}, "topk_ids.dtype"),
        ("ids range", {"topk_ids": ids + E}, "topk_ids"),
        ("negative ids", {"topk_ids": ids - E}, "topk_ids"),
        ("weights shape", {"topk_weights": w.T}, "topk_weights.shape"),
        ("weights dtype", {"topk_weights": w.to(torch.int32)}, "topk_weights.dtype"),
        ("weights nan", {"topk_weights": torch.full_like(w, float("nan"))}, "topk_weights"),
        ("weights missing", {"topk_weights": None}, "topk_weights"),
        ("device", {"topk_ids": ids.to("meta")}, "topk_ids.device"),
    ]


@pytest.mark.parametrize("kind", [LayeredCompute, MegaCompute])
@pytest.mark.parametrize(("case", "override", "field"), _bad_inputs())
def test_bad_inputs_rejected_before_any_write(
    kind: type, case: str, override: dict[str, Any], field: str
) -> None:
    comp = kind(weights(), cfg(), ReferenceBackend())
    if isinstance(comp, MegaCompute):
        comp.bind(PARAMS)
    x, ids, w = inputs(3)
    args: dict[str, Any] = {"layer_id": 0, "hidden_states": x, "topk_ids": ids, "topk_weights": w}
    args.update(override)
    with pytest.raises(ComputeInputError) as info:
        comp(**args)
    assert info.value.field == field, case
    assert not bool(comp.workspace.out.any())


def test_value_checks_can_be_turned_off_for_capture() -> None:
    comp = LayeredCompute(weights(), cfg(check_values=False), ReferenceBackend())
    x, ids, w = inputs(2)
    w = torch.full_like(w, float("nan"))
    assert comp(0, x, ids, w).shape == (2, H)  # NaN weights are not inspected


def test_errors_share_the_afd_core_base() -> None:
    from afd_core.errors import AFDError

    mega = MegaCompute(weights(), cfg(), ReferenceBackend())
    x, ids, w = inputs(1)
    with pytest.raises(AFDError):
        mega(0, x, ids, w)
    with pytest.raises(AFDError):
        cfg(max_tokens=0)
