"""Role resolution, parameter accounting and FFN compute selection."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError, AFDModelError, AFDPayloadError, AFDStateError
from afd_core.metadata import AFDPayloadSpec
from afd_runtime.compute import (
    NativeFusedMoECompute,
    SteppedFFNCompute,
    ffn_compute_name,
    select_ffn_compute,
)
from afd_runtime.roles import model_param_bytes, require_afd_config, role_rank


def _vllm_config(
    afd: dict[str, Any] | None, dp_rank: int = 0, tp: int = 1, pp: int = 1
) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config={} if afd is None else {"afd": afd},
        parallel_config=SimpleNamespace(
            data_parallel_index=dp_rank, tensor_parallel_size=tp, pipeline_parallel_size=pp
        ),
    )


def test_require_afd_config() -> None:
    cfg = require_afd_config(_vllm_config({"role": "ffn", "port": 9}), AFDRole.FFN)
    assert cfg.role is AFDRole.FFN and cfg.port == 9
    with pytest.raises(AFDConfigError, match=r"additional_config\['afd'\] is missing") as err:
        require_afd_config(_vllm_config(None), AFDRole.FFN)
    assert err.value.field == "additional_config['afd']" and "role='ffn'" in err.value.allowed
    with pytest.raises(AFDConfigError, match=r"'afd.role': got 'attention'; allowed: 'ffn'"):
        require_afd_config(_vllm_config({"role": "attention", "port": 9}), AFDRole.FFN)


def test_role_rank_is_the_data_parallel_rank() -> None:
    afd = {"role": "attention", "port": 9, "num_attention_ranks": 2}
    cfg = AFDConfig.from_mapping(afd)
    assert role_rank(_vllm_config(afd, dp_rank=1), cfg) == 1
    with pytest.raises(AFDConfigError, match="num_attention_ranks=2") as err:
        role_rank(_vllm_config(afd, dp_rank=2), cfg)
    assert (err.value.field, err.value.value) == ("parallel_config.data_parallel_rank", 2)
    assert err.value.allowed.startswith("ranks 0..1")
    # A TP size the config does not describe: refused, naming the AFD field and vLLM's value.
    with pytest.raises(AFDConfigError, match="--tensor-parallel-size 1") as err:
        role_rank(_vllm_config(afd, tp=2), cfg)
    assert (err.value.field, err.value.value) == ("attention_tp_size", 1)
    assert "--tensor-parallel-size (2)" in err.value.allowed
    with pytest.raises(AFDConfigError) as err:
        role_rank(_vllm_config(afd, pp=2), cfg)
    assert (err.value.field, err.value.value) == ("--pipeline-parallel-size", 2)


def test_role_rank_of_a_tensor_parallel_attention_worker_is_its_peer_index() -> None:
    afd = {"role": "attention", "port": 9, "num_attention_ranks": 2, "attention_tp_size": 2}
    cfg = AFDConfig.from_mapping(afd)
    peers = [
        role_rank(_vllm_config(afd, dp_rank=dp, tp=2), cfg, tp_rank=tp)
        for dp in range(2)
        for tp in range(2)
    ]
    assert peers == [0, 1, 2, 3]
    with pytest.raises(AFDConfigError) as err:
        role_rank(_vllm_config(afd, dp_rank=0, tp=2), cfg, tp_rank=2)
    assert (err.value.field, err.value.value) == ("tp_rank", 2)
    # The FFN role runs one worker per FFN rank: TP there is refused whatever the config says.
    ffn = {"role": "ffn", "port": 9, "attention_tp_size": 2}
    with pytest.raises(AFDConfigError, match="num_ffn_ranks") as err:
        role_rank(_vllm_config(ffn, tp=2), AFDConfig.from_mapping(ffn))
    assert (err.value.field, err.value.value, err.value.allowed) == (
        "--tensor-parallel-size",
        2,
        "1 on the FFN role",
    )


def test_model_param_bytes_prefers_the_adapters_measurement() -> None:
    m = torch.nn.Module()
    m.a = torch.nn.Linear(4, 3, bias=False)
    m.register_buffer("buf", torch.zeros(5, dtype=torch.int64))
    # Without the adapter's number: afd_weights.param_bytes (parameters only).
    assert model_param_bytes(m) == 4 * 3 * 4
    # With it (measured before vLLM's post-load repacking): that number, as is.
    m.afd_param_bytes = 7
    assert model_param_bytes(m) == 7


class _Model:
    afd_moe_layer_indices = (0,)
    afd_payload_spec = AFDPayloadSpec(hidden_size=2, dtype=torch.float32)

    def afd_ffn_forward(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        return hidden_states * 2 if layer_idx == 0 else hidden_states[:1]


class _Ctx:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> Any:
        self.calls.append(n)
        return torch.no_grad()


def test_native_compute_runs_in_the_step_context() -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn", "port": 9})
    ctx = _Ctx()
    compute = select_ffn_compute(cfg, _Model(), ctx)
    assert isinstance(compute, NativeFusedMoECompute)
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(compute(0, x, None), x * 2)
    assert ctx.calls == [3]
    with pytest.raises(AFDModelError, match=r"'afd_ffn_forward\(1\) output': got 'shape=\(1, 2\)"):
        compute(1, x, None)


def test_native_compute_step_enters_the_context_once() -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn", "port": 9})
    ctx = _Ctx()
    compute = select_ffn_compute(cfg, _Model(), ctx)
    assert isinstance(compute, SteppedFFNCompute)
    x = torch.arange(6.0).reshape(3, 2)
    with compute.step(5):
        assert torch.is_inference_mode_enabled()
        assert torch.equal(compute(0, x, None), x * 2)
        assert torch.equal(compute(0, x[:2], None), x[:2] * 2)
        with pytest.raises(AFDStateError, match="not reentrant"), compute.step(1):
            pass
    assert ctx.calls == [5]  # one context for the step's two calls, sized by the step
    assert torch.equal(compute(0, x, None), x * 2)  # outside a step: a context of its own
    assert ctx.calls == [5, 3]
    with pytest.raises(AFDModelError, match=r"got 'shape=\(1, 2\)"), compute.step(3):
        compute(1, x, None)
    assert ctx.calls == [5, 3, 3]
    with compute.step(2):  # the failed step closed its scope
        compute(0, x, None)
    assert ctx.calls == [5, 3, 3, 2]


def test_compute_selection_errors() -> None:
    def cfg(**kw: Any) -> AFDConfig:
        return AFDConfig.from_mapping({"role": "ffn", "port": 9, **kw})

    assert ffn_compute_name(cfg()) == "native"
    assert ffn_compute_name(cfg(ffn_compute="Native")) == "native"
    for name in ("layered", "mega"):  # a model without quantized experts: refused at selection
        config = cfg(ffn_compute=name, expert_quant="w8a8")
        assert ffn_compute_name(config) == name
        with pytest.raises(AFDConfigError) as err:
            select_ffn_compute(config, _Model(), _Ctx())
        assert (err.value.field, err.value.value) == ("expert_quant", "w8a8")
    with pytest.raises(AFDConfigError) as err:  # unknown kinds: refused when parsing
        cfg(ffn_compute="bogus")
    assert (err.value.field, err.value.value) == ("ffn_compute", "bogus")
    assert "['native', 'layered', 'mega']" in err.value.allowed
    with pytest.raises(AFDModelError, match="AFDFFNModel") as model_err:
        select_ffn_compute(cfg(), object(), _Ctx())  # type: ignore[arg-type]
    assert (model_err.value.field, model_err.value.value) == ("model", "object")


# -- quantized computes ------------------------------------------------------------------------


def _quantized_model(scheme: Any, group_size: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """An AFDQuantizedFFNModel over random experts (E=4, H=64, I=32, two layers), routing by a
    fixed top-2 of the token index."""
    from afd_weights import export_quantized_expert_weights

    gen = torch.Generator().manual_seed(0)
    e, h, i = 4, 64, 32
    sources = {
        layer: (torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen))
        for layer in (1, 3)
    }
    weights = export_quantized_expert_weights(sources, scheme=scheme, group_size=group_size)

    class Model:
        afd_moe_layer_indices = (1, 3)
        afd_payload_spec = AFDPayloadSpec(hidden_size=h, dtype=dtype)
        afd_quantized_weights = weights
        afd_compute_top_k = 2

        def __init__(self) -> None:
            self.routes: list[int] = []

        def afd_ffn_forward(self, *args: Any) -> torch.Tensor:
            raise AssertionError("the quantized compute never calls the float path")

        def afd_route(
            self, layer_idx: int, hidden: torch.Tensor, logits: Any, topk: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            self.routes.append(layer_idx)
            n = hidden.shape[0]
            ids = torch.stack([torch.arange(n) % e, (torch.arange(n) + 1) % e], 1)
            return torch.full((n, 2), 0.5), ids.to(torch.int32)

    return Model()


def _float64_quantized_moe(
    weights: Any, layer: int, x: torch.Tensor, ids: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """The quantized experts written plainly in float64, independent of afd-compute-npu's
    steps: per token, ``sum_k p_k * W2_e(q(SiLU(g) * u))`` with ``[g | u] = q(x) W13_e`` over the
    dequantized weights, ``q`` the per-row int8 round trip (``round(a / s) * s``,
    ``s = max|a| / 127``) of both GEMM inputs (no clamp, routed scaling 1: the model's)."""
    from afd_weights import dequantize_layer

    def q(a: torch.Tensor) -> torch.Tensor:
        step = a.abs().amax(dim=-1, keepdim=True) / 127
        return torch.clamp(torch.round(a / step), -127, 127) * step

    w13, w2 = (t.double() for t in dequantize_layer(weights, layer))
    inter = w2.shape[1]
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            h = q(x[t : t + 1].double()) @ w13[int(ids[t, k])]
            g, u = h[:, :inter], h[:, inter:]
            out[t] += float(p[t, k]) * (q(g * torch.sigmoid(g) * u) @ w2[int(ids[t, k])])[0]
    return out


class _HCCLBackend:
    """torch-npu's ``ProcessGroupHCCL`` backend as a recording fake: what the P2P connector
    builds as its data group on an NPU device (``name()``, ``get_hccl_comm_name``)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def name(self) -> str:
        return "hccl"

    def get_hccl_comm_name(self, rank: int) -> str:
        self.asked.append(rank)
        return f"hccl_comm_{rank}"


class _HCCLGroup:
    """A registered HCCL process group (torch-npu: ``_get_backend(npu)`` gives the backend)."""

    def __init__(self) -> None:
        self.backend = _HCCLBackend()
        self.devices: list[str] = []

    def name(self) -> str:
        return "hccl"

    def _get_backend(self, device: Any) -> _HCCLBackend:
        self.devices.append(str(device))
        return self.backend


class _Conn:
    """What the FFN service hands a binding compute after ``open_groups()``: the group of the
    FFN ranks (one here, so the model's experts are all of them)."""

    def __init__(self, name: str = "afd-p2p/127.0.0.1:1/g1/ffn", group: Any = None) -> None:
        from afd_core.connector import AFDGroupInfo

        self.info = AFDGroupInfo(name=name, world_size=1, rank=0, peer_ranks=())
        self.group = group if group is not None else _HCCLBackend()

    def ffn_group_info(self) -> Any:
        return self.info

    def ffn_process_group(self) -> Any:
        return self.group


def test_layered_and_mega_compute_match_a_float64_reference_and_mega_binds_per_connection() -> None:
    from afd_compute_npu import FP32_TOLERANCE, MegaNotBoundError, fp32_dequantized_moe
    from afd_runtime.quantized import QuantizedFFNCompute
    from afd_weights import QuantScheme

    model = _quantized_model(QuantScheme.W4A8_PER_CHANNEL)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    layered = select_ffn_compute(
        AFDConfig.from_mapping({"role": "ffn", "ffn_compute": "layered", "expert_quant": "w4a8"}),
        model,
        _Ctx(),
        max_tokens=16,
    )
    mega = QuantizedFFNCompute("mega", model, max_tokens=16, ffn_rank=0)
    assert isinstance(layered, QuantizedFFNCompute) and not layered.needs_bind
    with pytest.raises(MegaNotBoundError):  # no step runs unbound
        mega(1, x, None)
    mega.bind(_Conn())
    mega.bind(_Conn("afd-p2p/127.0.0.1:1/g2/ffn"))  # a new connection: a new bound Mega
    assert mega.binds == 2 and mega.bound_group_name == "hccl_comm_0"
    assert not mega.collective  # one FFN rank: a local compute
    # The model's routing (a fixed top-2 of the token index, weight 0.5 each), written out here.
    ids = torch.stack([torch.arange(5) % 4, (torch.arange(5) + 1) % 4], 1).to(torch.int32)
    p = torch.full((5, 2), 0.5)
    for layer in (1, 3):
        a, b = layered(layer, x, None), mega(layer, x, None)
        ref = _float64_quantized_moe(model.afd_quantized_weights, layer, x, ids, p)
        fp32 = fp32_dequantized_moe(model.afd_quantized_weights, layer, x, ids, p)
        for out in (a, b):
            assert out.shape == (5, 64) and out.dtype == torch.float32
            # fp32 output: only fp32 vs float64 arithmetic apart (measured 2.2e-7 of max|ref|)
            assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
            # the int8 activations move it measurably off the unquantized experts (measured
            # 1.3e-2 .. 1.5e-2), within the documented tolerance
            assert 1e-3 <= float((out - fp32).abs().max() / fp32.abs().max()) <= FP32_TOLERANCE
        assert torch.equal(a, b)  # in addition: one rank's Mega runs the Layered steps
        assert a.data_ptr() != layered(layer, x, None).data_ptr()  # the reply owns its rows
    # Published as metrics: the scheme and bytes, one signature per layer, distinct layers.
    from prometheus_client import REGISTRY

    signatures = layered.report()
    labels = {"role": "ffn", "rank": "0"}
    quant = {**labels, "compute": "layered", "scheme": "w4a8_per_channel", "group_size": "0"}
    assert REGISTRY.get_sample_value("afd_ffn_quantized_expert_bytes", quant) == (
        model.afd_quantized_weights.nbytes()
    )
    assert sorted(signatures) == [1, 3] and signatures[1] != signatures[3]
    for layer, digest in signatures.items():
        sig = {**labels, "layer": str(layer), "compute": "layered", "signature": digest}
        assert REGISTRY.get_sample_value("afd_ffn_compute_signature_info", sig) == 1
    assert layered.role_agreement() == {
        "ffn_compute": "layered",
        "quant_error_layers": [],  # this model keeps no float reference
        "expert_quant": "w4a8_per_channel",
        "group_size": 0,
        "hidden_size": 64,
        "intermediate_size": 32,
        "swiglu_limit": 0.0,
        "dtype": "torch.float32",
    }


def test_injected_mega_bind_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from afd_runtime.comm_binding import AFDCommBindError
    from afd_runtime.faults import InjectedFaultError
    from afd_runtime.quantized import FAULT_ENV, QuantizedFFNCompute
    from afd_weights import QuantScheme

    mega = QuantizedFFNCompute("mega", _quantized_model(QuantScheme.W8A8), max_tokens=8, ffn_rank=1)
    monkeypatch.setenv(FAULT_ENV, "mega_bind")
    with pytest.raises(AFDCommBindError) as err:
        mega.bind(_Conn())
    assert (err.value.field, err.value.value) == ("ffn_compute", "mega")
    assert "communicator 'hccl_comm_0'" in str(err.value)
    assert isinstance(err.value.__cause__, InjectedFaultError)
    assert "AFD_INJECT_FAULT=mega_bind" in str(err.value)
    assert mega.binds == 0


def test_mega_is_bound_to_the_hccl_communicator_name_that_reaches_dispatch_ffn_combine() -> None:
    """Contract (no NPU): the name torch-npu's HCCL backend gives for the connector's group of
    the FFN ranks and this rank's place in it is the ``group_name`` Ascend's fused kernel
    receives."""
    from afd_compute_npu import AscendBackend
    from afd_runtime.quantized import QuantizedFFNCompute
    from afd_weights import QuantScheme

    calls: list[tuple[Any, ...]] = []

    class RecordedNative:
        def dispatch_ffn_combine(self, *args: Any, **kwargs: Any) -> None:
            calls.append(args)
            args[11].fill_(1.0)

    model = _quantized_model(QuantScheme.W8A8, dtype=torch.bfloat16)
    mega = QuantizedFFNCompute(
        "mega",
        model,
        max_tokens=8,
        ffn_rank=0,
        backend=AscendBackend(RecordedNative()),  # type: ignore[arg-type]
    )
    conn = _Conn()
    mega.bind(conn)  # type: ignore[arg-type]
    assert conn.group.asked == [0]  # the FFN group's HCCL backend, for its rank 0
    mega(1, torch.ones(3, 64, dtype=torch.bfloat16), None)
    (args,) = calls
    assert args[9] == "hccl_comm_0"
    assert args[10] == 8 * 2 * 1  # max_output_size: max tokens x top-k x group size


def test_communicator_name_per_kind_of_group() -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from afd_runtime.comm_binding import AFDCommBindError, communicator_name

    registered = _HCCLGroup()  # through _get_backend(npu), as vllm-ascend asks
    assert communicator_name(registered, 3, "label") == "hccl_comm_3"
    assert registered.devices == ["npu"] and registered.backend.asked == [3]
    # The P2P connector's standalone gloo group (CPU) has no named communicator: its label.
    gloo = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))
    assert communicator_name(gloo, 0, "afd-p2p/h:1/g1/data") == "afd-p2p/h:1/g1/data"
    with pytest.raises(AFDCommBindError) as err:
        communicator_name(object(), 0, "label")
    assert (err.value.field, err.value.value) == ("ffn_process_group", "object")

    class _Nameless(_HCCLBackend):
        def get_hccl_comm_name(self, rank: int) -> str:
            return ""

    with pytest.raises(AFDCommBindError) as err:
        communicator_name(_Nameless(), 0, "label")
    assert err.value.field == "group_name"


class _IdsModel(_Model):
    def afd_ffn_forward(  # type: ignore[override]
        self,
        layer_idx: int,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor | None,
        topk: Any = None,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert input_ids is not None and topk is None
        return hidden_states + input_ids.unsqueeze(1).to(hidden_states.dtype)


def test_native_compute_hands_input_ids_to_the_model() -> None:
    cfg = AFDConfig.from_mapping({"role": "ffn", "port": 9})
    compute = select_ffn_compute(cfg, _IdsModel(), _Ctx())
    x = torch.zeros(3, 2)
    ids = torch.tensor([4, 0, 7])
    assert torch.equal(compute(0, x, None, input_ids=ids), ids.unsqueeze(1).expand(3, 2).float())


def test_quantized_compute_refuses_input_ids() -> None:
    from afd_runtime.quantized import QuantizedFFNCompute
    from afd_weights import QuantScheme

    model = _quantized_model(QuantScheme.W8A8)
    layered = QuantizedFFNCompute("layered", model, max_tokens=16, ffn_rank=0)
    with pytest.raises(AFDPayloadError, match=r"input_ids.*ffn_compute='native'"):
        layered(1, torch.zeros(2, 64), None, input_ids=torch.tensor([1, 2]))


def test_speculative_decoding_is_refused_where_afd_does_not_run_it() -> None:
    from afd_runtime.roles import check_speculative_decoding

    spec = SimpleNamespace(method="mtp")

    def vc(afd: dict[str, Any], speculative: Any = spec) -> SimpleNamespace:
        return SimpleNamespace(speculative_config=speculative, **vars(_vllm_config(afd)))

    attention = {"role": "attention", "port": 9}
    check_speculative_decoding(AFDConfig.from_mapping(attention), vc(attention))  # 1:1: runs
    check_speculative_decoding(AFDConfig.from_mapping(attention), vc(attention, None))
    cases = [
        ({"role": "ffn", "port": 9}, "--speculative-config", "mtp"),
        ({**attention, "num_attention_ranks": 2}, "num_attention_ranks", 2),
        ({**attention, "num_stages": 2}, "num_stages", 2),
    ]
    for afd, field, value in cases:
        with pytest.raises(AFDConfigError) as err:
            check_speculative_decoding(AFDConfig.from_mapping(afd), vc(afd))
        assert (err.value.field, err.value.value) == (field, value)


def test_build_connector_takes_the_draft_layers_as_the_last_indices() -> None:
    from afd_core.errors import AFDModelError
    from afd_runtime.workers.base import build_connector

    cfg = AFDConfig.from_mapping({"role": "ffn", "port": 9})
    spec = AFDPayloadSpec(hidden_size=2, dtype=torch.float32)
    conn = build_connector(cfg, 0, spec, (1, 2, 3, 4), "cpu", draft_layers=(4,))
    assert (conn.num_layers, conn.num_draft_layers) == (5, 1)
    with pytest.raises(AFDModelError) as err:
        build_connector(cfg, 0, spec, (1, 2, 3, 4), "cpu", draft_layers=(3,))
    assert err.value.field == "draft_layers"


def test_the_drafter_hooked_is_the_one_that_sends_the_draft_layers() -> None:
    from afd_core.errors import AFDModelError
    from afd_runtime.workers.base import _afd_drafter_model

    def runner(model: Any) -> SimpleNamespace:
        return SimpleNamespace(drafter=None if model is None else SimpleNamespace(model=model))

    assert _afd_drafter_model(SimpleNamespace(), (4,)) is None  # no speculative decoding
    assert _afd_drafter_model(runner(None), (4,)) is None  # n-gram: no draft model
    dense = torch.nn.Linear(2, 2)  # a dense draft model runs on the Attention role
    assert _afd_drafter_model(runner(dense), ()) is None
    mtp = torch.nn.Linear(2, 2)
    mtp.afd_draft_layer_indices = (4,)  # type: ignore[assignment]
    assert _afd_drafter_model(runner(mtp), (4,)) is mtp
    with pytest.raises(AFDModelError) as err:
        _afd_drafter_model(runner(mtp), (5,))
    assert (err.value.field, err.value.value) == ("speculative draft model", [4])
