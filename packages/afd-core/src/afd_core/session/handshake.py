"""What every rank of a session publishes at ``init`` and how two ranks' publications are compared
(every transport: the session runs this handshake, see :mod:`afd_core.session`).

Every field must match on every rank of the world; the first difference raises
:class:`AFDHandshakeError` naming it (the protocol version first, then each config agreement
field, then the rest, the payload spec field by field, then the model identity), so a mismatch
fails on both sides. ``ffn_members`` (the FFN slots of this round, which decide the FFN ranks'
world ranks) is compared too: two ranks that read different rounds' members would route to the
wrong slots. ``model_identity`` (what the served checkpoint is, e.g. its config and
weight files, see ``afd_runtime.identity``) is compared across every rank of both roles and named
down to the first differing leaf in sorted key order (``model_identity.config.hidden_act``,
``model_identity.weights['model.safetensors'].samples``); a key one side lacks reads as
``None``. Layers: the target model's (``num_layers - num_draft_layers``) match everywhere; the
draft (speculative) layers match within a role, and across roles an Attention rank that drafts
needs FFN ranks serving the same draft layers (:func:`_compare_layers`). ``role_agreement``
(e.g. the FFN ranks' quantization geometry) is compared only between ranks of the same role
(``role_agreement.<key>``).
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


DRAFT_LAYERS_HINT = (
    "the Attention role decodes speculatively through draft (MTP) layers that the FFN role does "
    "not serve: the checkpoint declares them (num_nextn_predict_layers) but ships no weights for "
    "them, so the FFN role serves without them; start the Attention role without "
    "--speculative-config, or serve a checkpoint that holds the MTP layers' weights"
)


def _compare_layers(mine: Mapping[str, Any], theirs: Mapping[str, Any], peer: int) -> None:
    """The target model's layers must be the same on every rank; the draft (speculative) layers
    the same within a role, and an Attention rank may send only draft layers the FFN ranks
    serve (an FFN serves a checkpoint's draft layers whether or not the Attention role drafts;
    an Attention role without a drafter declares none)."""
    my_draft, their_draft = mine["num_draft_layers"], theirs.get("num_draft_layers", 0)
    my_target = mine["num_layers"] - my_draft
    their_target = (theirs.get("num_layers") or 0) - their_draft
    if my_target != their_target:
        raise AFDHandshakeError("num_layers", my_target, their_target, peer)
    if my_draft == their_draft:
        return
    across_roles = mine["role"] != theirs.get("role")
    attention, ffn = (
        (my_draft, their_draft) if mine["role"] == "attention" else (their_draft, my_draft)
    )
    if across_roles and attention == 0:
        return  # the Attention role does not draft: the FFN's draft layers go unused
    hint = DRAFT_LAYERS_HINT if across_roles and ffn < attention else None
    raise AFDHandshakeError("num_draft_layers", my_draft, their_draft, peer, hint=hint)


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
    _compare_layers(mine, theirs, peer)
    for key in (
        "config_hash",
        "hidden_size",
        "dtype",
        "topology",
        "ffn_members",
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
