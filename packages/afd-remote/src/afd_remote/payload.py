"""Payload checks shared by the proxies: row alignment, connector fields, TP localisation.

All checks run before anything is sent and raise afd-core's :class:`AFDPayloadError` (or
:class:`UnsupportedPayloadFieldError`) naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDPayloadError
from afd_core.metadata import PAYLOAD_FIELDS

from afd_remote.errors import UnsupportedPayloadFieldError
from afd_remote.routed_padding import RoutedDispatchLayout, slice_for_dispatch


def check_rows(tensors: Mapping[str, torch.Tensor]) -> None:
    """Every entry is a tensor with a token dim of ``tensors["hidden_states"]``' row count."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise AFDPayloadError(name, type(tensor).__name__, "a torch.Tensor")
        if tensor.dim() == 0:
            raise AFDPayloadError(name, (), "a tensor with a token (first) dimension")
    rows = tensors["hidden_states"].shape[0]
    for name, tensor in tensors.items():
        if tensor.shape[0] != rows:
            raise AFDPayloadError(
                name, tuple(tensor.shape), f"{rows} rows (as many as hidden_states)"
            )


def check_fields(connector: AFDConnectorBase, names: frozenset[str] | set[str]) -> None:
    """``names`` are exactly the payload fields ``connector`` carries."""
    supported = connector.supported_payload_fields
    for name in PAYLOAD_FIELDS:
        if name in names and name not in supported:
            raise UnsupportedPayloadFieldError(name, type(connector).__name__, supported)
    for name in PAYLOAD_FIELDS:
        if name in supported and name not in names:
            raise AFDPayloadError(
                name,
                None,
                f"a tensor: connector {type(connector).__name__} carries {sorted(supported)}",
            )


def localise(tensor: torch.Tensor, layout: RoutedDispatchLayout | None, field: str) -> torch.Tensor:
    """This rank's rows of a parent payload tensor (the tensor itself without TP padding)."""
    return tensor if layout is None else slice_for_dispatch(tensor, layout, field=field)
