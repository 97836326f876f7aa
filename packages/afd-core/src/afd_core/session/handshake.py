"""What every rank of a session publishes at ``init`` and how two ranks' publications are compared
(every transport: the session runs this handshake, see :mod:`afd_core.session`).

Every field must match on every rank of the world; the first difference raises
:class:`AFDHandshakeError` naming it (the protocol version first, then each config agreement
field, then the rest, the payload spec field by field, then the model identity), so a mismatch
fails on both sides. ``model_identity`` (what the served checkpoint is, e.g. its config and
weight files, see ``afd_runtime.identity``) is compared across every rank of both roles and named
down to the first differing leaf in sorted key order (``model_identity.config.hidden_act``,
``model_identity.weights['model.safetensors'].samples``); a key one side lacks reads as
``None``. ``role_agreement`` (e.g. the FFN ranks' quantization geometry) is compared only
between ranks of the same role (``role_agreement.<key>``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from afd_core.config import AFDConfig
from afd_core.errors import AFDHandshakeError
from afd_core.metadata import PAYLOAD_FIELDS, AFDPayloadSpec, dtype_name
from afd_core.topology import AFDTopology


def _handshake_fields(
    config: AFDConfig,
    topology: AFDTopology,
    payload_spec: AFDPayloadSpec,
    num_layers: int,
    device: torch.device,
    role_agreement: Mapping[str, Any] | None = None,
    model_identity: Mapping[str, Any] | None = None,
    *,
    protocol_version: int,
    num_draft_layers: int = 0,
) -> dict[str, Any]:
    """The handshake publication of a rank with this config, topology, spec and device
    (``model_identity`` already in its canonical JSON form, see ``AFDConnectorBase``;
    ``protocol_version``: the transport's wire protocol, compared first)."""
    return {
        "role": config.role.value,
        "role_agreement": dict(role_agreement or {}),
        "protocol_version": protocol_version,
        "config": config.agreement_fields(),
        "config_hash": config.agreement_hash(),
        "hidden_size": payload_spec.hidden_size,
        "dtype": dtype_name(payload_spec.dtype),
        "num_layers": num_layers,
        "num_draft_layers": num_draft_layers,
        "topology": [
            topology.num_attention_ranks,
            topology.num_ffn_ranks,
            topology.attention_tp_size,
        ],
        "ffn_members": list(topology.members),
        "payload_spec": payload_spec.to_wire(),
        "device_type": device.type,
        "model_identity": dict(model_identity or {}),
    }


MODEL_MISMATCH_HINT = (
    "the roles serve different models: start every role on the same checkpoint (config and "
    "weight files) with the same model overrides"
)

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _child_path(path: str, key: str) -> str:
    return f"{path}.{key}" if _PLAIN_KEY.fullmatch(key) else f"{path}[{key!r}]"


def _first_difference(path: str, mine: Any, theirs: Any) -> tuple[str, Any, Any] | None:
    """``(path, mine, theirs)`` of the first differing leaf (mappings are descended in sorted
    key order, a missing key reads as ``None``); ``None`` when equal."""
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        for key in sorted(set(mine) | set(theirs), key=str):
            found = _first_difference(_child_path(path, str(key)), mine.get(key), theirs.get(key))
            if found is not None:
                return found
        return None
    return None if mine == theirs else (path, mine, theirs)


def _compare_handshake(mine: Mapping[str, Any], theirs: Mapping[str, Any], peer: int) -> None:
    """Raise :class:`AFDHandshakeError` on the first field where world rank ``peer`` differs."""
    # Protocol version first: other fields may not be comparable across versions.
    if theirs.get("protocol_version") != mine["protocol_version"]:
        raise AFDHandshakeError(
            "protocol_version", mine["protocol_version"], theirs.get("protocol_version"), peer
        )
    their_config = theirs.get("config", {})
    for key, value in mine["config"].items():
        if their_config.get(key) != value:
            raise AFDHandshakeError(f"config.{key}", value, their_config.get(key), peer)
    for key in (
        "config_hash",
        "hidden_size",
        "dtype",
        "num_layers",
        "topology",
        "payload_spec",
        "device_type",
    ):
        if theirs.get(key) != mine[key]:
            if key == "payload_spec":
                mine_spec, their_spec = mine[key], theirs.get(key) or {}
                for name in PAYLOAD_FIELDS:
                    if mine_spec.get(name) != their_spec.get(name):
                        raise AFDHandshakeError(
                            f"payload_spec.{name}",
                            mine_spec.get(name),
                            their_spec.get(name),
                            peer,
                        )
            raise AFDHandshakeError(key, mine[key], theirs.get(key), peer)
    found = _first_difference(
        "model_identity", mine["model_identity"], theirs.get("model_identity") or {}
    )
    if found is not None:
        raise AFDHandshakeError(*found, peer, hint=MODEL_MISMATCH_HINT)
    if theirs.get("role") == mine["role"]:
        # Same role: their own agreement too (e.g. FFN ranks' quantization geometry).
        their_role = theirs.get("role_agreement") or {}
        for key in sorted(set(mine["role_agreement"]) | set(their_role)):
            if mine["role_agreement"].get(key) != their_role.get(key):
                raise AFDHandshakeError(
                    f"role_agreement.{key}",
                    mine["role_agreement"].get(key),
                    their_role.get(key),
                    peer,
                )
