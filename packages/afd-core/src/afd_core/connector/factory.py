"""The connector registry: connector classes by name (built-ins, ``register_connector``, the
``afd.connectors`` entry-point group), :func:`create_connector`, and the connector part of config
validation (:func:`check_connector_config`, installed into :mod:`afd_core.config` on import, so the
config module imports no connector code).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

import torch

from afd_core import config as _config
from afd_core.config import AFDConfig
from afd_core.connector.base import AFDConnectorBase
from afd_core.errors import AFDConfigError, AFDRegistryError
from afd_core.metadata import AFDPayloadSpec
from afd_core.topology import AFDTopology

__all__ = [
    "CONNECTOR_ENTRY_POINT_GROUP",
    "available_connectors",
    "check_connector_config",
    "create_connector",
    "get_connector_class",
    "register_connector",
    "unregister_connector",
]

CONNECTOR_ENTRY_POINT_GROUP = "afd.connectors"

ConnectorClass = type[AFDConnectorBase]
_registry: dict[str, ConnectorClass | Callable[[], ConnectorClass]] = {}
_registry_lock = threading.Lock()
_entry_points_loaded = False


def _builtin(module: str, attr: str) -> Callable[[], ConnectorClass]:
    def load() -> ConnectorClass:
        cls = getattr(import_module(module), attr)
        return _check_class(f"{module}.{attr}", cls)

    return load


def _check_class(origin: str, cls: Any) -> ConnectorClass:
    if not (isinstance(cls, type) and issubclass(cls, AFDConnectorBase)):
        raise AFDRegistryError(f"{origin} is not an AFDConnectorBase subclass")
    return cls


def register_connector(
    name: str,
    cls: ConnectorClass | Callable[[], ConnectorClass],
    *,
    replace: bool = False,
) -> None:
    """Register ``cls`` (a connector class, or a zero-arg loader returning one) under ``name``.

    Raises:
        AFDRegistryError: empty name, not a connector class, or a duplicate without ``replace``.
    """
    if not isinstance(name, str) or not name.strip():
        raise AFDRegistryError(f"connector name must be a non-empty string, got {name!r}")
    if isinstance(cls, type):
        _check_class(name, cls)
    elif not callable(cls):
        raise AFDRegistryError(f"connector {name!r} must be a class or a loader, got {cls!r}")
    with _registry_lock:
        if name in _registry and not replace:
            raise AFDRegistryError(f"connector {name!r} is already registered")
        _registry[name] = cls


def unregister_connector(name: str) -> None:
    """Remove ``name`` from the registry (no-op when absent)."""
    with _registry_lock:
        _registry.pop(name, None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=CONNECTOR_ENTRY_POINT_GROUP):
        with _registry_lock:
            if ep.name in _registry:
                continue

            def load(ep: Any = ep) -> ConnectorClass:
                return _check_class(f"entry point {ep.name}={ep.value}", ep.load())

            _registry[ep.name] = load


def available_connectors() -> tuple[str, ...]:
    """Registered names (built-ins and entry points), sorted."""
    _load_entry_points()
    with _registry_lock:
        return tuple(sorted(_registry))


def get_connector_class(name: str) -> ConnectorClass:
    """The connector class registered as ``name`` (resolving lazy loaders).

    Raises:
        AFDRegistryError: unknown name, or the registration does not resolve to a connector class.
    """
    _load_entry_points()
    with _registry_lock:
        entry = _registry.get(name)
    if entry is None:
        raise AFDRegistryError(f"unknown AFD connector {name!r}; registered: {sorted(_registry)}")
    if isinstance(entry, type):
        return entry
    cls = _check_class(name, entry())
    with _registry_lock:
        _registry[name] = cls
    return cls


def create_connector(
    config: AFDConfig,
    role_rank: int,
    *,
    payload_spec: AFDPayloadSpec,
    num_layers: int,
    device: torch.device | str | None = None,
    topology: AFDTopology | None = None,
    role_agreement: Mapping[str, Any] | None = None,
    model_identity: Mapping[str, Any] | None = None,
    num_draft_layers: int = 0,
) -> AFDConnectorBase:
    """Construct (not initialise) the connector ``config.connector`` for ``role_rank``
    (``role_agreement``, ``model_identity`` and ``num_draft_layers``: see
    :class:`AFDConnectorBase`)."""
    cls = get_connector_class(config.connector)
    kwargs: dict[str, Any] = {}
    if num_draft_layers:
        kwargs["num_draft_layers"] = num_draft_layers
    if role_agreement is not None:
        kwargs["role_agreement"] = role_agreement
    if model_identity is not None:
        kwargs["model_identity"] = model_identity
    return cls(
        config,
        topology,
        role_rank,
        payload_spec=payload_spec,
        num_layers=num_layers,
        device=device,
        **kwargs,
    )


register_connector("p2p", _builtin("afd_core.connector.p2p", "P2PConnector"))
register_connector("inprocess", _builtin("afd_core.connector.inprocess", "InProcessConnector"))


def check_connector_config(name: str, extra: Mapping[str, Any]) -> Mapping[str, Any]:
    """The connector part of :class:`~afd_core.config.AFDConfig` validation: ``name`` is a
    registered connector and accepts ``extra``; returns the normalised extra config.

    Raises:
        AFDConfigError: naming ``connector`` or ``connector_extra_config.<key>``.
    """
    try:
        connector_cls = get_connector_class(name)
    except AFDRegistryError:
        raise AFDConfigError(
            "connector",
            name,
            f"a registered connector name, one of {list(available_connectors())}",
        ) from None
    return connector_cls.validate_extra_config(extra)


_config.set_connector_check(check_connector_config)
