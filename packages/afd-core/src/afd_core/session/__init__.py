"""The session layer every AFD transport shares (see :mod:`afd_core.session.session`).

* :mod:`~afd_core.session.access`: where a world listens and who may join (``AFD_SECRET``, the
  store's gate and tunnel);
* :mod:`~afd_core.session.startup`: :class:`StartupCoordinator` (ready flags, sticky failures,
  bounded waits), :func:`open_tcp_store`, startup cancellation;
* :mod:`~afd_core.session.rounds`: initialisation rounds and rank claims;
* :mod:`~afd_core.session.handshake`: what a rank publishes at ``init`` and the comparison;
* :mod:`~afd_core.session.liveness`: heartbeats, the watcher, goodbye;
* :mod:`~afd_core.session.session`: :class:`AFDSession`, one rank's initialisation on a store.
"""

from afd_core.session.session import AFDSession, publish_startup_failure
from afd_core.session.startup import (
    StartupCoordinator,
    StartupFailure,
    cancel_startup,
    open_tcp_store,
)

__all__ = [
    "AFDSession",
    "StartupCoordinator",
    "StartupFailure",
    "cancel_startup",
    "open_tcp_store",
    "publish_startup_failure",
]
