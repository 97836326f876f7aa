"""AFD config, connector contract and registry, the session layer every transport shares,
topology, transfer/control metadata, forward-context access and the stage hook point, the stage
plan, and two transports (the torch.distributed P2P connector, the in-process connector).

The names below are re-exported for convenience; each lives in one small module
(``afd_core.config``, ``.topology``, ``.expert_map``, ``.metadata``, ``.connector`` (``base``,
``session_base``, ``factory``, ``p2p``, ``inprocess``), ``.session``, ``.forward_context``,
``.stage_plan``, ``.errors``). This package knows nothing of vLLM: no import, no lookup of its
modules; the runtime plugs in through :class:`~afd_core.forward_context.StageHooks`.
"""

from importlib.metadata import version as _version

from afd_core.config import AFDConfig, AFDRole, parse_afd_config
from afd_core.connector import (
    AFDConnectorBase,
    AFDGroupInfo,
    AFDTransferHandle,
    available_connectors,
    create_connector,
    get_connector_class,
    register_connector,
)
from afd_core.errors import (
    AFDAccessError,
    AFDCancelledError,
    AFDConfigError,
    AFDConnectorError,
    AFDContextError,
    AFDError,
    AFDFieldError,
    AFDHandshakeError,
    AFDModelError,
    AFDNotInitializedError,
    AFDOverlapError,
    AFDPayloadError,
    AFDPeerError,
    AFDProtocolError,
    AFDRegistryError,
    AFDStartupError,
    AFDStateError,
    AFDTimeoutError,
)
from afd_core.expert_map import ExpertMap
from afd_core.forward_context import (
    AFDForwardMetadata,
    StageHooks,
    dbo_yield,
    get_afd_forward_metadata,
    install_stage_hooks,
    set_afd_forward_metadata,
)
from afd_core.metadata import (
    PAYLOAD_FIELDS,
    AFDControlMessage,
    AFDPayload,
    AFDPayloadSpec,
    AFDTransferMetadata,
)
from afd_core.session.startup import StartupCoordinator, cancel_startup
from afd_core.stage_plan import plan_stages
from afd_core.topology import AFDTopology

__version__ = _version("afd-core")

__all__ = [
    "PAYLOAD_FIELDS",
    "AFDAccessError",
    "AFDCancelledError",
    "AFDConfig",
    "AFDConfigError",
    "AFDConnectorBase",
    "AFDConnectorError",
    "AFDContextError",
    "AFDControlMessage",
    "AFDError",
    "AFDFieldError",
    "AFDForwardMetadata",
    "AFDGroupInfo",
    "AFDHandshakeError",
    "AFDModelError",
    "AFDNotInitializedError",
    "AFDOverlapError",
    "AFDPayload",
    "AFDPayloadError",
    "AFDPayloadSpec",
    "AFDPeerError",
    "AFDProtocolError",
    "AFDRegistryError",
    "AFDRole",
    "AFDStartupError",
    "AFDStateError",
    "AFDTimeoutError",
    "AFDTopology",
    "AFDTransferHandle",
    "AFDTransferMetadata",
    "ExpertMap",
    "StageHooks",
    "StartupCoordinator",
    "__version__",
    "available_connectors",
    "cancel_startup",
    "create_connector",
    "dbo_yield",
    "get_afd_forward_metadata",
    "get_connector_class",
    "install_stage_hooks",
    "parse_afd_config",
    "plan_stages",
    "register_connector",
    "set_afd_forward_metadata",
]
