"""The in-process connector (registered as ``"inprocess"``): see
:mod:`afd_core.connector.inprocess.connector`."""

from afd_core.connector.inprocess.connector import InProcessConnector, release_hubs

__all__ = ["InProcessConnector", "release_hubs"]
