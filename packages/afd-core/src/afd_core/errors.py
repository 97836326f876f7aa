"""Exception types of afd-core.

Invariants:
* Every error raised by afd-core derives from :class:`AFDError`; the other AFD packages derive
  theirs from it too (afd-runtime raises nothing else).
* An error about one rejected value derives from :class:`AFDFieldError`, the one place that
  formats ``field`` / ``value`` / ``allowed`` into a message; a package names its errors by
  setting :attr:`AFDFieldError.subject` instead of formatting its own.
* Validation errors (:class:`AFDConfigError`, :class:`AFDPayloadError`) are ``ValueError``s that name
  the offending field and value and say what is allowed; they are raised before any side effect
  (no store key written, no byte sent).
* :class:`AFDModelError` (a loaded model breaks the AFD model contract) and
  :class:`AFDStateError` (an operation called in a state where it cannot run) mix in no builtin
  type: nothing that calls AFD code dispatches on one for them.
* Runtime errors of a connector (:class:`AFDConnectorError` and subclasses) are ``RuntimeError``s;
  :class:`AFDTimeoutError` is also a ``TimeoutError``.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "AFDAccessError",
    "AFDCancelledError",
    "AFDConfigError",
    "AFDConnectorError",
    "AFDContextError",
    "AFDError",
    "AFDFieldError",
    "AFDHandshakeError",
    "AFDModelError",
    "AFDNotInitializedError",
    "AFDOverlapError",
    "AFDPayloadError",
    "AFDPeerError",
    "AFDProtocolError",
    "AFDRankServedError",
    "AFDRegistryError",
    "AFDStartupError",
    "AFDStateError",
    "AFDTimeoutError",
]


class AFDError(Exception):
    """Base class of every AFD error (afd-core's and every other AFD package's)."""


class AFDFieldError(AFDError):
    """One rejected value: names the field, the value and what is allowed.

    The message is ``invalid <subject> '<field>': got <value!r>; <allowed_label> <allowed>``,
    followed by `` (<detail>)`` when a detail is given. Subclasses set :attr:`subject` (and, where
    the wording differs, :attr:`allowed_label`); none formats its own message.

    Attributes:
        field: the field, argument or tensor at fault (dotted for nested values, e.g.
            ``connector_extra_config.x``).
        value: the rejected value as given (a shape or a scalar, never a whole tensor).
        allowed: a human-readable description of what is accepted.
        detail: extra context appended to the message, or ``None``.
    """

    #: What the message calls the rejected thing (``invalid <subject> 'field': ...``).
    subject: ClassVar[str] = "AFD value"
    #: The words that introduce ``allowed`` in the message.
    allowed_label: ClassVar[str] = "allowed:"

    def __init__(self, field: str, value: Any, allowed: str, *, detail: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.detail = detail
        msg = f"invalid {self.subject} {field!r}: got {value!r}; {self.allowed_label} {allowed}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class AFDConfigError(AFDFieldError, ValueError):
    """An invalid configuration value (a ``ValueError``; see :class:`AFDFieldError`)."""

    subject = "AFD config field"


class AFDPayloadError(AFDFieldError, ValueError):
    """A payload or transfer metadata that does not match the agreed wire contract.

    Raised before any byte of the transfer is sent. ``field`` is the payload/metadata field at
    fault (e.g. ``router_logits``, ``num_tokens``), ``value`` usually a shape, dtype or count,
    ``allowed`` what the contract expects.
    """

    subject = "AFD payload field"
    allowed_label = "expected"


class AFDModelError(AFDFieldError):
    """A model (or its weight files) that breaks the AFD model contract a role needs: a missing
    adapter attribute, an FFN output of the wrong shape or dtype, an unreadable checkpoint header.

    ``field`` names the attribute, output or file property at fault.
    """

    subject = "AFD model value"


class AFDStateError(AFDError):
    """An operation was called in a state where it cannot run: before the object it needs was
    built, re-entered while running, or an entry point a role does not serve."""


class AFDContextError(AFDError, RuntimeError):
    """AFD forward metadata was requested but none is installed for the current forward."""


class AFDOverlapError(AFDError, RuntimeError):
    """A stage of a two-stage overlap (the runtime's executor, ``afd_runtime.overlap``) was stopped
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


class AFDRankServedError(AFDConfigError):
    """A role rank another live process already serves (e.g. a second FFN server started with
    the ``ffn_rank`` of a running one): refused at once, naming the field and the rank, without
    touching the running deployment (no failure is published into its round)."""


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
