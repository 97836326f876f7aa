"""Connector base class and registry (including the entry-point group)."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import afd_core.config
import afd_core.connector.factory as connector_mod
import pytest
import torch
from afd_core.config import AFDConfig, AFDConfigError, AFDRole
from afd_core.connector import (
    CONNECTOR_ENTRY_POINT_GROUP,
    AFDConnectorBase,
    AFDTransferHandle,
    available_connectors,
    create_connector,
    get_connector_class,
    register_connector,
    unregister_connector,
)
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDConnectorError, AFDRegistryError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.topology import AFDTopology


class LoopbackConnector(AFDConnectorBase):
    """Single-process stand-in: the 'FFN' doubles hidden states (for contract tests only)."""

    name = "loopback-test"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._up = False

    def init(self) -> None:
        self._up = True

    def close(self) -> None:
        self._up = False

    @property
    def is_initialized(self) -> bool:
        return self._up

    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        return AFDTransferHandle(metadata, [p.hidden_states * 2 for p in payloads], id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        handle.consume()
        result: list[torch.Tensor] = handle.state
        return result

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        return AFDTransferMetadata(layer_idx, stage_idx, (0,)), []

    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        return None


SPEC = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=2)


@pytest.fixture
def loopback() -> Iterator[None]:
    register_connector("loopback-test", LoopbackConnector)
    yield
    unregister_connector("loopback-test")


def test_builtin_p2p_registered() -> None:
    assert "p2p" in available_connectors()
    assert get_connector_class("p2p") is P2PConnector
    assert P2PConnector.has_control_plane


def test_unknown_connector() -> None:
    with pytest.raises(AFDRegistryError, match="nope"):
        get_connector_class("nope")
    with pytest.raises(AFDConfigError) as info:  # the factory's check, installed in the config
        AFDConfig(role=AFDRole.FFN, connector="nope")
    assert info.value.field == "connector" and "'inprocess', 'p2p'" in str(info.value)


def test_config_imports_no_connector_code() -> None:
    """No import cycle config <-> connector: the config module imports nothing of
    ``afd_core.connector`` (the factory installs its check instead)."""
    tree = ast.parse(Path(afd_core.config.__file__).read_text(encoding="utf-8"))
    imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported and not [m for m in imported if m.startswith("afd_core.connector")]
    assert afd_core.config._CONNECTOR_CHECK is connector_mod.check_connector_config


def test_register_and_create(loopback: None) -> None:
    cfg = AFDConfig(role=AFDRole.ATTENTION, connector="loopback-test", num_attention_ranks=2)
    conn = create_connector(cfg, 1, payload_spec=SPEC, num_layers=3)
    assert isinstance(conn, LoopbackConnector)
    assert conn.world_rank == 1 and conn.role is AFDRole.ATTENTION
    assert conn.supported_payload_fields == frozenset({"hidden_states", "topk_ids", "topk_weights"})
    assert conn.device == torch.device("cpu")
    with conn:
        assert conn.is_initialized
        h = conn.send_dispatch([AFDPayload(torch.ones(2, 4))], AFDTransferMetadata(0, 0, (2,)))
        assert torch.equal(conn.recv_combine(h)[0], torch.full((2, 4), 2.0))
        with pytest.raises(AFDConnectorError, match="already received"):
            conn.recv_combine(h)
        assert h.consumed
    assert not conn.is_initialized
    # No control plane by default: a clear error, not a silent no-op.
    with pytest.raises(AFDConnectorError, match="no control plane"):
        conn.send_control(AFDControlMessage(((1,),)))
    with pytest.raises(AFDConnectorError, match="no control plane"):
        conn.recv_control()
    # The default extra-config validator accepts only {}.
    with pytest.raises(AFDConfigError) as info:
        AFDConfig(role=AFDRole.FFN, connector="loopback-test", connector_extra_config={"x": 1})
    assert info.value.field == "connector_extra_config.x"


def test_duplicate_and_invalid_registration(loopback: None) -> None:
    with pytest.raises(AFDRegistryError, match="already registered"):
        register_connector("loopback-test", LoopbackConnector)
    register_connector("loopback-test", LoopbackConnector, replace=True)
    with pytest.raises(AFDRegistryError):
        register_connector("bad", int)  # type: ignore[arg-type]
    with pytest.raises(AFDRegistryError):
        register_connector("", LoopbackConnector)
    with pytest.raises(AFDRegistryError):
        register_connector("bad", 42)  # type: ignore[arg-type]
    register_connector("lazy-bad", lambda: int)  # type: ignore[arg-type, return-value]
    try:
        with pytest.raises(AFDRegistryError, match="not an AFDConnectorBase"):
            get_connector_class("lazy-bad")
    finally:
        unregister_connector("lazy-bad")


def test_entry_point_group(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def fake_entry_points(group: str) -> list[Any]:
        seen.append(group)
        return [SimpleNamespace(name="ep-loopback", value="x:Y", load=lambda: LoopbackConnector)]

    monkeypatch.setattr(connector_mod, "entry_points", fake_entry_points)
    monkeypatch.setattr(connector_mod, "_entry_points_loaded", False)
    try:
        assert "ep-loopback" in available_connectors()
        assert get_connector_class("ep-loopback") is LoopbackConnector
        assert seen == [CONNECTOR_ENTRY_POINT_GROUP]
    finally:
        unregister_connector("ep-loopback")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role_rank": 2}, "role_rank"),
        ({"role_rank": -1}, "role_rank"),
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": True}, "num_layers"),
        ({"payload_spec": {"hidden_size": 4}}, "payload_spec"),
        ({"topology": AFDTopology(3, 1)}, "topology"),
        ({"device": "tpu-ish"}, "device"),
        ({"config": {"role": "ffn"}}, "config"),
    ],
)
def test_base_constructor_validation(loopback: None, kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {
        "config": AFDConfig(role=AFDRole.ATTENTION, num_attention_ranks=2, connector="p2p"),
        "topology": None,
        "role_rank": 0,
        "payload_spec": SPEC,
        "num_layers": 2,
    }
    args.update(kwargs)
    with pytest.raises(AFDConfigError) as info:
        LoopbackConnector(
            args.pop("config"),
            args.pop("topology"),
            args.pop("role_rank"),
            **args,
        )
    assert info.value.field == field


def test_split_ffn_outputs_splits_by_peer_and_names_a_bad_reply() -> None:
    from afd_core.connector.base import split_ffn_outputs
    from afd_core.errors import AFDPayloadError
    from afd_core.metadata import AFDTransferMetadata

    meta = AFDTransferMetadata(0, 0, (2, 0, 3))
    out = torch.arange(20.0).reshape(5, 4)
    parts = split_ffn_outputs(out, meta, 4, 3)
    assert [tuple(p.shape) for p in parts] == [(2, 4), (0, 4), (3, 4)]
    assert torch.equal(torch.cat(list(parts)), out)
    with pytest.raises(AFDPayloadError, match=r"shape \(5, 4\) \(all peers\)"):
        split_ffn_outputs(torch.zeros(4, 4), meta, 4, 3)
    with pytest.raises(AFDPayloadError, match="3 tensors"):
        split_ffn_outputs([torch.zeros(2, 4)], meta, 4, 3)


def test_transfer_counts_rule_exact_with_one_ffn_rank_at_most_with_several() -> None:
    from afd_core.connector.base import check_transfer_counts
    from afd_core.errors import AFDPayloadError

    check_transfer_counts((5,), (5,), one_ffn_rank=True)
    check_transfer_counts((0, 5, 3), (5, 5, 5), one_ffn_rank=False)
    for counts in ((4,), (6,)):  # one FFN rank gets every token: fewer is wrong too
        with pytest.raises(AFDPayloadError) as err:
            check_transfer_counts(counts, (5,), one_ffn_rank=True)
        assert err.value.field == "num_tokens" and err.value.value == counts
        assert "(5,) as announced" in str(err.value)
    with pytest.raises(AFDPayloadError) as err:
        check_transfer_counts((2, 6), (5, 5), one_ffn_rank=False)
    assert err.value.field == "num_tokens" and "at most (5, 5) rows" in str(err.value)
