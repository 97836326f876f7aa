"""AFD connectors: the contract, the registry and one subpackage per transport.

* :mod:`afd_core.connector.base`: the contract (:class:`AFDConnectorBase`, handles, group info);
* :mod:`afd_core.connector.session_base`: :class:`AFDSessionConnector`, a connector whose
  lifecycle is the shared session (:mod:`afd_core.session`); a transport adds byte movement only;
* :mod:`afd_core.connector.factory`: the registry (``"p2p"``, ``"inprocess"``, entry points);
* :mod:`afd_core.connector.p2p`: the torch.distributed transport;
* :mod:`afd_core.connector.inprocess`: both roles in one process (threads and queues), for tests
  of the layers above a connector.
"""

from afd_core.connector.base import AFDConnectorBase, AFDGroupInfo, AFDTransferHandle
from afd_core.connector.factory import (
    CONNECTOR_ENTRY_POINT_GROUP,
    available_connectors,
    check_connector_config,
    create_connector,
    get_connector_class,
    register_connector,
    unregister_connector,
)
from afd_core.connector.session_base import AFDSessionConnector

__all__ = [
    "CONNECTOR_ENTRY_POINT_GROUP",
    "AFDConnectorBase",
    "AFDGroupInfo",
    "AFDSessionConnector",
    "AFDTransferHandle",
    "available_connectors",
    "check_connector_config",
    "create_connector",
    "get_connector_class",
    "register_connector",
    "unregister_connector",
]
