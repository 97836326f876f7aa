"""Exception types of afd-core.

Invariants:
* Every error raised by afd-core derives from :class:`AFDError`.
* Validation errors (:class:`AFDConfigError`, :class:`AFDPayloadError`) are ``ValueError``s that name
  the offending field and value and say what is allowed; they are raised before any side effect
  (no store key written, no byte sent).
* Runtime errors of a connector (:class:`AFDConnectorError` and subclasses) are ``RuntimeError``s;
  :class:`AFDTimeoutError` is also a ``TimeoutError``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AFDAccessError",
    "AFDCancelledError",
    "AFDConfigError",
    "AFDConnectorError",
    "AFDContextError",
    "AFDError",
    "AFDHandshakeError",
    "AFDNotInitializedError",
    "AFDOverlapError",
    "AFDPayloadError",
    "AFDPeerError",
    "AFDProtocolError",
    "AFDReadyHookError",
    "AFDRegistryError",
    "AFDStartupError",
    "AFDTimeoutError",
]


class AFDError(Exception):
    """Base class of every afd-core error."""


class AFDConfigError(AFDError, ValueError):
    """An invalid configuration value.

    Attributes:
        field: the configuration field (dotted for nested values, e.g. ``connector_extra_config.x``).
        value: the rejected value as given.
        allowed: a human-readable description of what is accepted.
    """

    def __init__(self, field: str, value: Any, allowed: str, *, detail: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        msg = f"invalid AFD config field {field!r}: got {value!r}; allowed: {allowed}"
        if detail:
            msg = f"{msg} ({detail})"
        super().__init__(msg)


class AFDPayloadError(AFDError, ValueError):
    """A payload or transfer metadata that does not match the agreed wire contract.

    Raised before any byte of the transfer is sent.

    Attributes:
        field: the payload/metadata field at fault (e.g. ``router_logits``, ``num_tokens``).
        value: the rejected value (usually a shape, dtype or count).
        allowed: what the contract expects.
    """

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid AFD payload field {field!r}: got {value!r}; expected {allowed}")


class AFDContextError(AFDError, RuntimeError):
    """AFD forward metadata was requested but none is installed for the current forward."""


class AFDOverlapError(AFDError, RuntimeError):
    """A stage of a two-stage overlap (:func:`afd_core.overlap.run_overlapped`) was stopped
    because another stage of the same step failed; the run raises that stage's error."""


class AFDRegistryError(AFDError, ValueError):
    """Unknown, duplicate or invalid connector registration."""


class AFDConnectorError(AFDError, RuntimeError):
    """Base class of connector runtime failures (initialisation, transfer, shutdown)."""


class AFDAccessError(AFDConnectorError):
    """This rank may not join the store it reached: the deployment secret (``AFD_SECRET``)
    differs from the store's, or the store serves without one. Raised before any key is read or
    written; the message never contains the secret."""


class AFDNotInitializedError(AFDConnectorError):
    """A transfer was attempted on a connector that is not initialised (or already closed)."""


class AFDProtocolError(AFDConnectorError):
    """A peer sent bytes that violate the wire protocol (bad magic, version, length or flags)."""


class AFDHandshakeError(AFDConnectorError):
    """Two ranks disagree on a handshake field at connector initialisation.

    Attributes:
        field: the handshake field that differs (e.g. ``hidden_size``).
        local: this rank's value.
        remote: the peer's value.
        peer_rank: the peer's world rank.

    ``hint`` (optional) is appended to the message: what the difference means to the user.
    """

    def __init__(
        self, field: str, local: Any, remote: Any, peer_rank: int, *, hint: str | None = None
    ) -> None:
        self.field = field
        self.local = local
        self.remote = remote
        self.peer_rank = peer_rank
        msg = (
            f"AFD handshake mismatch on field {field!r}: this rank has {local!r}, "
            f"world rank {peer_rank} has {remote!r}"
        )
        super().__init__(f"{msg} ({hint})" if hint else msg)


class AFDReadyHookError(AFDConnectorError):
    """This rank's ready hook (see ``afd_core.connector.ReadyHook``) failed during ``init``; the
    failure was published, so every peer's ``init`` fails naming this rank. ``__cause__`` holds
    the hook's exception. Not a transient condition: retrying the same hook fails again."""


class AFDTimeoutError(AFDConnectorError, TimeoutError):
    """A wait exceeded its timeout (``AFDConfig.timeout_s`` unless overridden)."""


class AFDPeerError(AFDConnectorError):
    """A peer failed, died or closed its connection during an operation.

    Attributes:
        rank: the failed peer's world rank when known, else ``None``.
        stage: the operation or startup stage during which the failure was observed.
        reason: the failure reason (published by the peer, or the transport error).
    """

    def __init__(self, rank: int | None, stage: str, reason: str) -> None:
        self.rank = rank
        self.stage = stage
        self.reason = reason
        who = f"world rank {rank}" if rank is not None else "a peer"
        super().__init__(f"AFD {who} failed during {stage!r}: {reason}")


class AFDStartupError(AFDPeerError):
    """A rank published a startup failure; every waiting peer raises this naming rank and stage."""


class AFDCancelledError(AFDConnectorError):
    """A startup wait was cancelled on purpose (:func:`afd_core.session.startup.cancel_startup`, e.g. by
    the process's SIGTERM handler): the rank is shutting down, not failing.

    Attributes:
        stage: the startup stage that was waiting.
        reason: why startup was cancelled (e.g. ``"SIGTERM"``).
    """

    def __init__(self, stage: str, reason: str) -> None:
        self.stage = stage
        self.reason = reason
        super().__init__(f"AFD startup cancelled during {stage!r}: {reason}")
