"""The Attention role's link to its FFN role: one connector, its failures and its reconnection.

An Attention rank outlives its FFN role. :class:`AttentionLink` owns the Attention rank's
connector after the first ``init`` and keeps these invariants:

* A step uses the connector only while the link is up (:meth:`AttentionLink.step`). While it is
  down a step fails at once with :class:`AFDFFNUnavailableError` naming the FFN rank and the
  cause: no step waits for an FFN that is gone.
* A failure takes the link down: an operation of a step failed (a peer lost or failed, a wait
  timed out), or the connector learnt between steps that a peer is gone (the P2P connector
  watches the FFN ranks' heartbeats, see :meth:`afd_core.connector.AFDConnectorBase.peer_failure`).
  The supervisor thread then closes the connector (never while a step uses it) and initialises it
  again, attempt after attempt (each bounded by ``startup_timeout_s``, :data:`RECONNECT_RETRY_S`
  between attempts), until the FFN role is back or the link closes. The first step after that
  runs on the new connection.
* Elastic FFN ranks (``expert_replicas > 1``): a loss re-forms the round with the live FFN
  slots that hold every expert (afd-core's :mod:`~afd_core.session.membership`); when an FFN
  slot asks to join (:meth:`~afd_core.connector.AFDConnectorBase.membership_pending`, seen by
  world rank 0), the supervisor takes the link down between two steps, says goodbye and
  initialises again with it. Steps meanwhile fail as for a loss (the requests are held).
* :meth:`AttentionLink.health` is ``None`` while up and the reason while down (the Attention
  server's ``/health`` answers 503 then, see :mod:`afd_runtime.ffn_loss`).
* :meth:`AttentionLink.close` says goodbye to a connected FFN role, ends a reconnection
  attempt in progress (its startup waits are cancelled, :func:`~afd_core.session.startup.
  startup_cancel_scope`) and then waits for the supervisor thread (at most :data:`CLOSE_JOIN_S`), so
  the process never exits with that thread inside a store call (a thread woken there while the
  interpreter finalizes aborts the process: exit code -6, "terminate called"). Idempotent.

An error raised inside a step without a connector failure (a bug, bad input) passes through
unchanged: only what the FFN role caused is turned into :class:`AFDFFNUnavailableError`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from afd_core.connector import AFDConnectorBase
from afd_core.errors import AFDCancelledError, AFDConnectorError, AFDPeerError
from afd_core.metadata import AFDControlMessage
from afd_core.session.startup import startup_cancel_scope

from afd_runtime.metrics import RoleMetrics

logger = logging.getLogger(__name__)

#: Pause between two reconnection attempts of a link that is down.
RECONNECT_RETRY_S = 1.0
#: How often the supervisor looks at the connector while the link is up.
SUPERVISE_POLL_S = 1.0
#: How long :meth:`AttentionLink.close` waits for the supervisor thread to end (one look at the
#: connector, or one poll of a cancelled reconnection's wait, takes far less).
CLOSE_JOIN_S = 5.0


class AFDFFNUnavailableError(AFDPeerError):
    """A step of the Attention role could not run because its FFN role is unavailable.

    ``rank`` is the FFN world rank when known, ``stage`` the operation that failed,
    ``failure`` the connector's error; the message says that the Attention role reconnects.
    """

    def __init__(self, failure: AFDConnectorError) -> None:
        self.failure = failure
        peer = failure.rank if isinstance(failure, AFDPeerError) else None
        stage = failure.stage if isinstance(failure, AFDPeerError) else "step"
        super().__init__(peer, stage, str(failure))
        who = f"FFN world rank {peer}" if peer is not None else "the FFN role"
        self.args = (
            f"AFD FFN role unavailable: {who} ({type(failure).__name__}: {failure}); the "
            "Attention role reconnects when the FFN role is back",
        )


def say_goodbye(connector: AFDConnectorBase) -> None:
    """Tell the FFN role this Attention rank leaves (best effort), then close the connector."""
    if connector.is_initialized and connector.has_control_plane:
        with contextlib.suppress(Exception):
            connector.send_control(AFDControlMessage.shutdown_message())
    connector.close()


class AttentionLink:
    """An initialised Attention-side connector kept up across FFN losses (module docstring)."""

    def __init__(
        self,
        connector: AFDConnectorBase,
        *,
        name: str = "",
        metrics: RoleMetrics | None = None,
    ) -> None:
        self.connector = connector
        #: ``afd_link_up``, ``afd_connections_total``, ``afd_reconnects_total`` of this rank.
        self.metrics = metrics or RoleMetrics("attention", int(getattr(connector, "role_rank", 0)))
        self.name = name or f"attention-{connector.role_rank}"
        self._lock = threading.Lock()  # held by a step while it uses the connector
        self._down: AFDConnectorError | None = None
        self._closing = threading.Event()
        self._reconnecting = threading.Event()  # set once the supervisor starts reconnecting
        self._thread: threading.Thread | None = None
        self.reconnects = 0  # successful re-initialisations after a loss

    # -- lifecycle -------------------------------------------------------------------------

    def connect(self, init: Callable[[], None] | None = None) -> None:
        """First ``init`` (blocking; its errors propagate: a startup failure stays fatal), then
        start the supervisor thread. ``init`` replaces ``connector.init`` for this first one
        (the worker's makes it end on SIGTERM)."""
        (init or self.connector.init)()
        self._connected()
        self._thread = threading.Thread(
            target=self._supervise, name=f"afd-link-{self.name}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop supervising; say goodbye if connected; close the connector; wait for the
        supervisor thread (idempotent).

        A reconnection attempt in progress ends within one poll of its startup wait (cancelled
        through :func:`~afd_core.session.startup.startup_cancel_scope`) and closes its
        connector."""
        if self._closing.is_set():
            return
        self._closing.set()
        self.metrics.link_up.set(0)
        # A step still running (it cannot be: vLLM stops stepping before it shuts workers
        # down) would own the connector: then leave it to the process exit.
        if not self._lock.acquire(timeout=SUPERVISE_POLL_S * 5):
            logger.warning("AFD Attention %s closed while a step ran: no goodbye", self.name)
            return
        try:
            if self._down is None:
                say_goodbye(self.connector)
        finally:
            self._lock.release()
        # A watching supervisor waits on an event (safe at exit, ends within SUPERVISE_POLL_S);
        # a reconnecting one may be inside a store call: wait for its cancelled attempt.
        # (_closing is set before this read; _reconnect sets its flag before reading _closing.)
        thread = self._thread
        if (
            thread is not None
            and self._reconnecting.is_set()
            and thread is not threading.current_thread()
        ):
            thread.join(CLOSE_JOIN_S)
            if thread.is_alive():
                logger.warning(
                    "AFD Attention %s: the link's supervisor did not end within %.0fs of close",
                    self.name,
                    CLOSE_JOIN_S,
                )

    # -- state -----------------------------------------------------------------------------

    @property
    def is_supervising(self) -> bool:
        """True while the supervisor thread runs (watching, or reconnecting)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def is_reconnecting(self) -> bool:
        """True while the supervisor initialises the connector again after a loss."""
        return self._reconnecting.is_set()

    @property
    def is_up(self) -> bool:
        return self._down is None and not self._closing.is_set()

    def health(self) -> str | None:
        """``None`` while the link is up; why it is down otherwise."""
        failure = self._down
        if failure is None:
            failure = self.connector.peer_failure()
        return None if failure is None else str(AFDFFNUnavailableError(failure))

    # -- steps -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[AFDConnectorBase]:
        """Use the connector for one step; fail at once while down (see the module docstring)."""
        down = self._down
        if down is not None:
            raise AFDFFNUnavailableError(down)
        with self._lock:
            down = self._down
            if down is not None:
                raise AFDFFNUnavailableError(down)
            try:
                yield self.connector
            except BaseException as err:
                failure = self.connector.peer_failure()
                if failure is None:
                    raise
                self._down = failure
                self.metrics.link_up.set(0)
                raise AFDFFNUnavailableError(failure) from err

    # -- supervisor ------------------------------------------------------------------------

    def _supervise(self) -> None:
        while not self._closing.is_set():
            failure = self.connector.wait_peer_failure(SUPERVISE_POLL_S)
            rejoin = False
            if failure is None:
                if not self.connector.membership_pending():
                    continue
                rejoin = True
                failure = AFDConnectorError(
                    "an FFN rank asked to join: the Attention role forms the FFN set again"
                )
            with self._lock:  # between steps
                if self._closing.is_set():
                    return
                if self._down is None:
                    self._down = failure
                if rejoin:
                    say_goodbye(self.connector)
                else:
                    self.connector.close()
                self.metrics.link_up.set(0)
            logger.warning(
                "AFD Attention %s %s (%s: %s); reconnecting",
                self.name,
                "re-forms its FFN set" if rejoin else "lost its FFN role",
                type(failure).__name__,
                failure,
            )
            if not self._reconnect():
                return

    def _reconnect(self) -> bool:
        """Initialise the connector again until it pairs (True) or the link closes (False)."""
        self._reconnecting.set()
        attempts = 0
        while not self._closing.is_set():
            attempts += 1
            try:
                with startup_cancel_scope(self._closing, "the Attention link closed"):
                    self.connector.init()
            except AFDCancelledError:
                self.connector.close()
                return False
            except AFDConnectorError as exc:
                self.connector.close()
                if attempts == 1 or attempts % 30 == 0:
                    logger.info(
                        "AFD Attention %s still waiting for its FFN role (attempt %d): %s",
                        self.name,
                        attempts,
                        exc,
                    )
                self._closing.wait(RECONNECT_RETRY_S)
                continue
            with self._lock:
                if self._closing.is_set():  # closed while the last wait ended: leave cleanly
                    say_goodbye(self.connector)
                    return False
                self._down = None
            self._reconnecting.clear()
            self.reconnects += 1
            self.metrics.reconnects.inc()
            self._connected()
            return True
        return False

    def _connected(self) -> None:
        """Count the pairing; say (log, ``afd_ffn_member``) which FFN slots serve the round."""
        self.metrics.connected()
        topo = self.connector.topology
        self.metrics.ffn_members(topo.num_ffn_ranks, topo.members)
        logger.info(
            "AFD Attention %s %s its FFN role: FFN slots %s of %d serve round %s "
            "(expert_replicas=%d)",
            self.name,
            "reconnected to" if self.reconnects else "connected to",
            list(topo.members),
            topo.num_ffn_ranks,
            getattr(self.connector, "generation", "?"),
            topo.expert_replicas,
        )
