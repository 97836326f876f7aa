"""The connector contract every AFD transport implements (the registry is :mod:`afd_core.connector.factory`).

Call protocol (one step; ``S`` stages, ``L`` layers; both roles follow the same order)::

    Attention rank                               FFN rank
    send_control(msg)            ───────────▶    recv_control() -> msg (counts per served rank)
    for layer: for stage:                        for layer: for stage:
      h = send_dispatch(payloads, meta)    ──▶     meta, payloads = recv_dispatch(layer, stage)
      (overlap: yield_stage())                      outputs = compute(payloads)
      parts = recv_combine(h)              ◀──     send_combine(outputs, meta)

``payloads``/``parts`` hold one entry per FFN rank of the Attention rank (``F = 1``: one, carrying
every token); the FFN side's ``meta``/``payloads`` one per served Attention rank. Every (layer,
stage) travels, also with zero tokens.

Invariants:
* Construction is cheap and side-effect free; :meth:`AFDConnectorBase.init` is collective (every
  rank of the connector world calls it) and raises on any disagreement; :meth:`close` is
  idempotent, safe after a partial or failed ``init`` and leaves ``is_initialized`` false;
  ``init`` after ``close`` works.
* A payload/metadata that does not match the agreed :class:`AFDPayloadSpec` raises
  :class:`AFDPayloadError` before any byte is sent.
* Every blocking wait is bounded by ``config.timeout_s`` (unless a call documents otherwise) and
  raises :class:`AFDTimeoutError` or :class:`AFDPeerError` instead of hanging.
* A handle returned by :meth:`send_dispatch` is consumed by exactly one :meth:`recv_combine`.

Transports built on the shared session layer (:mod:`afd_core.session`: rendezvous, rounds,
handshake, liveness, failure publication, goodbye) derive from
:class:`afd_core.connector.session_base.AFDSessionConnector` and implement only byte movement.
"""

from __future__ import annotations

import contextlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import torch

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorError,
    AFDPayloadError,
    AFDProtocolError,
)
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.topology import AFDTopology

__all__ = [
    "AFDConnectorBase",
    "AFDGroupInfo",
    "AFDTransferHandle",
    "check_transfer_counts",
    "merge_control_messages",
]


@dataclass(frozen=True)
class AFDGroupInfo:
    """The communication group a connector set up, as values (for a compute that binds to it,
    e.g. afd-compute-npu's Mega): a label unique to this initialisation (for logs; the
    communicator's own name comes from :meth:`AFDConnectorBase.data_process_group`), the world
    size, this rank and the world ranks it exchanges data with."""

    name: str
    world_size: int
    rank: int
    peer_ranks: tuple[int, ...]


class AFDTransferHandle:
    """The Attention side's ticket for one in-flight transfer.

    ``metadata`` is the metadata given to ``send_dispatch``; ``state`` is connector-private.
    A handle may be passed to ``recv_combine`` exactly once.
    """

    __slots__ = ("__weakref__", "_consumed", "connector_id", "metadata", "state")

    def __init__(self, metadata: AFDTransferMetadata, state: Any, connector_id: int) -> None:
        self.metadata = metadata
        self.state = state
        self.connector_id = connector_id
        self._consumed = False

    @property
    def consumed(self) -> bool:
        """True once ``recv_combine`` took this handle."""
        return self._consumed

    def consume(self) -> None:
        """Mark consumed; raises :class:`AFDConnectorError` on a second use."""
        if self._consumed:
            raise AFDConnectorError(
                f"AFD transfer handle for layer {self.metadata.layer_idx} stage "
                f"{self.metadata.stage_idx} was already received"
            )
        self._consumed = True

    def __repr__(self) -> str:
        return f"AFDTransferHandle({self.metadata!r}, consumed={self._consumed})"


def _canonical_identity(model_identity: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model_identity`` as it travels in the handshake (a JSON round trip: string keys, lists
    for tuples), so that a rank's own value compares equal to a peer's decoded one.

    Raises:
        AFDConfigError: not ``None`` or a mapping, or not JSON-serialisable with string keys and
            finite numbers (NaN never compares equal, so it could never agree).
    """
    if model_identity is None:
        return {}
    allowed = "None or a JSON-serialisable mapping (string keys, finite numbers)"
    if not isinstance(model_identity, Mapping):
        raise AFDConfigError("model_identity", type(model_identity).__name__, allowed)
    try:
        text = json.dumps(dict(model_identity), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise AFDConfigError(
            "model_identity", type(model_identity).__name__, allowed, detail=str(err)
        ) from None
    canonical: dict[str, Any] = json.loads(text)
    return canonical


class AFDConnectorBase(ABC):
    """Abstract base of every AFD connector.

    Subclasses implement the data plane (``send_dispatch``/``recv_combine`` on the Attention side,
    ``recv_dispatch``/``send_combine`` on the FFN side; one FFN rank is the case ``F = 1``) and may
    implement the control plane (``send_control``/``recv_control``; set
    ``has_control_plane = True``).
    """

    name: ClassVar[str] = "abstract"
    has_control_plane: ClassVar[bool] = False

    def __init__(
        self,
        config: AFDConfig,
        topology: AFDTopology | None = None,
        role_rank: int = 0,
        *,
        payload_spec: AFDPayloadSpec,
        num_layers: int,
        device: torch.device | str | None = None,
        role_agreement: Mapping[str, Any] | None = None,
        model_identity: Mapping[str, Any] | None = None,
        num_draft_layers: int = 0,
    ) -> None:
        if not isinstance(config, AFDConfig):
            raise AFDConfigError("config", type(config).__name__, "an AFDConfig")
        if topology is None:
            topology = AFDTopology.from_config(config)
        if not isinstance(topology, AFDTopology):
            raise AFDConfigError("topology", type(topology).__name__, "an AFDTopology")
        if topology != AFDTopology.from_config(config):
            raise AFDConfigError(
                "topology",
                topology,
                f"num_attention_ranks={config.num_attention_ranks}, "
                f"num_ffn_ranks={config.num_ffn_ranks}, "
                f"attention_tp_size={config.attention_tp_size} as in the config",
            )
        topology.check_role_rank(config.role, role_rank)
        if not isinstance(payload_spec, AFDPayloadSpec):
            raise AFDConfigError("payload_spec", payload_spec, "an AFDPayloadSpec")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise AFDConfigError("num_layers", num_layers, "a positive int")
        if (
            isinstance(num_draft_layers, bool)
            or not isinstance(num_draft_layers, int)
            or not 0 <= num_draft_layers < num_layers
        ):
            raise AFDConfigError(
                "num_draft_layers",
                num_draft_layers,
                f"an int in 0..{num_layers - 1} (the last layer indices of num_layers={num_layers} "
                "that only a draft model's steps run)",
            )
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError):
            raise AFDConfigError(
                "device", device, "a torch device (cpu, cuda[:i], npu[:i])"
            ) from None
        if role_agreement is not None and not isinstance(role_agreement, Mapping):
            raise AFDConfigError("role_agreement", role_agreement, "None or a mapping")
        identity = _canonical_identity(model_identity)
        self.config = config
        self.topology = topology
        self.role_rank = role_rank
        #: Values every rank of this rank's role must publish equal at init (e.g. the FFN ranks'
        #: quantization geometry); ranks of the other role do not compare them.
        self.role_agreement: dict[str, Any] = dict(role_agreement or {})
        #: What identifies the served model (e.g. ``{"config": ..., "weights": ...}``, see
        #: ``afd_runtime.identity``); every rank of both roles must publish it equal at init.
        #: Held as its canonical JSON form (string keys, lists, finite numbers).
        self.model_identity: dict[str, Any] = identity
        self.payload_spec = payload_spec
        self.num_layers = num_layers
        #: The last ``num_draft_layers`` layer indices belong to a speculative draft model (e.g.
        #: DeepSeek's MTP layer): a step marked ``is_draft`` runs only them, any other step ends
        #: before them (:meth:`step_last_layer`).
        self.num_draft_layers = num_draft_layers
        self.device = dev
        self._failure: AFDConnectorError | None = None
        self._failure_event = threading.Event()

    def step_last_layer(self, is_draft: bool) -> int:
        """The last layer index a step runs: ``num_layers - 1`` for a draft step, else the last
        index before the draft layers."""
        return self.num_layers - 1 - (0 if is_draft else self.num_draft_layers)

    # -- identity --------------------------------------------------------------------------

    @property
    def role(self) -> AFDRole:
        """This rank's role."""
        return self.config.role

    @property
    def world_rank(self) -> int:
        """This rank's rank in the connector world (Attention first, then FFN)."""
        return self.topology.world_rank(self.role, self.role_rank)

    def group_info(self) -> AFDGroupInfo:
        """The group this initialised connector exchanges data on (see :class:`AFDGroupInfo`).

        Raises:
            AFDConnectorError: the connector has no such group (the default).
        """
        raise AFDConnectorError(f"connector {self.name!r} exposes no communication group")

    def data_process_group(self) -> Any:
        """The torch.distributed process group this initialised connector moves data on (for a
        compute that binds a communicator to it: afd-runtime derives the communicator's name from
        it, e.g. HCCL's through torch-npu).

        Raises:
            AFDConnectorError: the connector has no process group (the default; e.g. the
                in-process transport) or is not started.
        """
        raise AFDConnectorError(f"connector {self.name!r} moves data on no process group")

    def ffn_group_info(self) -> AFDGroupInfo:
        """FFN side: the group of the round's FFN ranks (ranks ``0..F-1`` in FFN-rank order),
        opened when ``config.needs_ffn_group`` (a compute that is a collective over the FFN
        ranks: Mega's fused dispatch and combine).

        Raises:
            AFDConnectorError: the connector has no such group (the default).
        """
        raise AFDConnectorError(f"connector {self.name!r} opens no group of the FFN ranks")

    def ffn_process_group(self) -> Any:
        """FFN side: the torch.distributed process group of :meth:`ffn_group_info` (the one a
        compute that dispatches among the FFN ranks binds its communicator to).

        Raises:
            AFDConnectorError: the connector has no such group (the default) or is not started.
        """
        raise AFDConnectorError(f"connector {self.name!r} opens no group of the FFN ranks")

    @property
    def supported_payload_fields(self) -> frozenset[str]:
        """Payload fields this connector carries (exactly those of its payload spec)."""
        return self.payload_spec.field_names

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        """Validate and normalise ``connector_extra_config``; the default accepts only ``{}``.

        Raises:
            AFDConfigError: naming ``connector_extra_config.<key>``.
        """
        for key, value in extra.items():
            raise AFDConfigError(
                f"connector_extra_config.{key}",
                value,
                f"no keys (connector {cls.name!r} takes no extra config)",
            )
        return {}

    # -- lifecycle -------------------------------------------------------------------------

    @abstractmethod
    def init(self) -> None:
        """Collective: connect, handshake and become ready (idempotent while initialised)."""

    def open_groups(self) -> None:
        """The first part of :meth:`init`: everything before this rank tells its peers it is
        ready, so a compute can bind to the connector's groups in between; then
        :meth:`confirm_ready`. The default (a transport without the split) is the whole
        :meth:`init`."""
        self.init()

    def confirm_ready(self) -> None:  # noqa: B027  (a default, not an abstract step)
        """The rest of :meth:`init` after :meth:`open_groups` (the default: nothing)."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; idempotent; safe after a partial or failed ``init``."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool:
        """True between a successful ``init`` and ``close``."""

    def announce_leave(self) -> bool:
        """Tell the peers that this rank leaves cleanly, without closing anything yet.

        For a rank stopping while another of its threads is blocked in a wait only the peers
        can end (an idle FFN rank in ``recv_control``): the peers learn of the leave, close
        their side, and that wait ends with a lost peer; the blocked thread then closes. Safe
        from any thread; never raises; True when the peers were told. The default (a
        connector that cannot tell them) tells nobody and returns False."""
        return False

    def membership_pending(self) -> bool:
        """Whether the FFN ranks serving this initialisation should change at the next step
        boundary (an FFN slot waits to join an elastic world, ``expert_replicas > 1``; world
        rank 0 is told). Never raises. The default: never."""
        return False

    def abort(self, op: str, reason: str) -> None:
        """Fail this rank on purpose: tell the peers why, then :meth:`close`. Never raises.

        A connector with a failure channel publishes ``reason`` there, so every peer's pending
        or next wait raises :class:`AFDPeerError` naming this rank, ``op`` and ``reason``
        instead of timing out. The default only closes (the peers then see a lost peer).
        """
        with contextlib.suppress(Exception):
            self.close()

    # -- peer failures ---------------------------------------------------------------------

    def peer_failure(self) -> AFDConnectorError | None:
        """The failure that ended this connector's current initialisation, or ``None``.

        Set when an operation failed (a peer lost, failed or timed out) or when the connector
        learnt outside any operation that a peer is gone (the P2P connector watches its FFN
        peers' heartbeats on the Attention side); the first failure wins; the next ``init``
        clears it. Non-blocking and thread-safe. A connector that detects nothing outside its
        operations reports a lost peer once an operation failed.
        """
        return self._failure

    def wait_peer_failure(self, timeout_s: float) -> AFDConnectorError | None:
        """Block up to ``timeout_s`` for :meth:`peer_failure` to be set; return it (or ``None``)."""
        self._failure_event.wait(timeout_s)
        return self._failure

    def _record_failure(self, failure: AFDConnectorError) -> None:
        """Record ``failure`` as :meth:`peer_failure` (the first one wins) and wake waiters."""
        if self._failure is None:
            self._failure = failure
        self._failure_event.set()

    def _clear_failure(self) -> None:
        self._failure = None
        self._failure_event.clear()

    @classmethod
    def publish_startup_failure(
        cls,
        config: AFDConfig,
        role_rank: int,
        stage: str,
        reason: str,
        *,
        timeout_s: float | None = None,
    ) -> bool:
        """Tell the peers that this rank (``config.role``, ``role_rank``) failed in ``stage``
        before its ``init`` (e.g. while loading its model), so their ``init`` fails at once with
        :class:`AFDStartupError` naming this rank, ``stage`` and ``reason`` instead of waiting
        ``startup_timeout_s``. Bounded in time (``timeout_s``, default the config's
        ``startup_timeout_s``); never raises; True when the failure was delivered. The default
        delivers nothing (returns False): the peers then time out."""
        return False

    def __enter__(self) -> AFDConnectorBase:
        self.init()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- data plane: dispatch to the FFN ranks, combine their replies ------------------------

    @abstractmethod
    def send_dispatch(
        self, payloads: Sequence[AFDPayload], metadata: AFDTransferMetadata
    ) -> AFDTransferHandle:
        """Attention side: send FFN rank ``f`` (``topology.peers_of``'s order) its
        ``payloads[f]``, ``metadata.num_tokens[f]`` rows (possibly 0), for one layer and stage;
        returns without waiting.

        With one FFN rank every token goes to it: the count equals the step's announced count
        for the stage. With several, each count is at most the announced one.
        """

    @abstractmethod
    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        """Attention side: wait for ``handle``'s replies, one ``[num_tokens[f], hidden]`` tensor
        per FFN rank (a rank sent 0 rows answers with an empty tensor, off the wire)."""

    @abstractmethod
    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        """FFN side: receive what every served Attention rank dispatched to this rank for
        ``layer_idx``/``stage_idx``: the metadata (one count per served rank, in
        ``attention_ranks_for`` order) and one payload per served rank. Reply with
        :meth:`send_combine` and that metadata."""

    @abstractmethod
    def send_combine(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, metadata: AFDTransferMetadata
    ) -> None:
        """FFN side: send each served Attention rank its ``[num_tokens[i], hidden_size]`` result.

        ``outputs`` is one tensor per served rank, or one tensor of all rows concatenated in
        served-rank order (split by ``metadata.num_tokens``); zero-row parts send nothing.
        """

    # -- control plane (optional) ----------------------------------------------------------

    def send_control(self, message: AFDControlMessage) -> None:
        """Attention side: announce the step's token counts (and flags) to every FFN rank."""
        raise AFDConnectorError(f"connector {self.name!r} has no control plane")

    def recv_control(self, timeout_s: float | None = None) -> AFDControlMessage:
        """FFN side: the step's counts, one entry per served Attention rank per stage."""
        raise AFDConnectorError(f"connector {self.name!r} has no control plane")


def check_transfer_counts(
    counts: tuple[int, ...], announced: Sequence[int], one_ffn_rank: bool
) -> None:
    """The data plane's count rule: with one FFN rank every token goes to it, so each count
    equals its peer's ``announced`` count for the stage; with several, each is at most it.

    Raises:
        AFDPayloadError: naming ``num_tokens``, the counts and what the rule allows.
    """
    for n, limit in zip(counts, announced, strict=True):
        if (n != limit) if one_ffn_rank else (n > limit):
            allowed = (
                f"{tuple(announced)} as announced (one FFN rank gets every token)"
                if one_ffn_rank
                else f"at most {tuple(announced)} rows (this step's announced counts)"
            )
            raise AFDPayloadError("num_tokens", counts, allowed)


def split_ffn_outputs(
    outputs: Sequence[torch.Tensor] | torch.Tensor,
    metadata: AFDTransferMetadata,
    width: int | None,
    num_served: int,
) -> Sequence[torch.Tensor]:
    """The FFN reply for each served Attention rank: one ``(total, width)`` tensor split by
    ``metadata.num_tokens``, or already one tensor per served rank (checked: the count).

    Raises:
        AFDPayloadError: the tensor is not ``(total, width)``, or the list has another count.
    """
    if isinstance(outputs, torch.Tensor):
        total = metadata.total_tokens
        if outputs.dim() != 2 or outputs.shape[0] != total:
            raise AFDPayloadError(
                "outputs", tuple(outputs.shape), f"shape {(total, width)} (all peers)"
            )
        return torch.split(outputs, list(metadata.num_tokens))
    parts = outputs if type(outputs) is list else list(outputs)
    if len(parts) != num_served:
        raise AFDPayloadError("outputs", len(parts), f"{num_served} tensors (one per served rank)")
    return parts


def merge_control_messages(
    messages: Sequence[AFDControlMessage], served: Sequence[int]
) -> AFDControlMessage:
    """An FFN rank's view of a step: the control messages of its served Attention ranks
    (``served``: their world ranks, same order; each message of width 1) merged into one, one
    count per served rank per stage (one served rank: its message itself).

    Raises:
        AFDProtocolError: the served ranks disagree on the stage count or a flag.
    """
    first = messages[0]
    for src, msg in zip(served[1:], messages[1:], strict=True):
        for name in ("num_stages", "is_warmup", "is_capture", "shutdown", "is_draft"):
            if getattr(msg, name) != getattr(first, name):
                raise AFDProtocolError(
                    f"served Attention ranks disagree on {name}: world rank "
                    f"{served[0]} sent {getattr(first, name)!r}, world rank {src} "
                    f"sent {getattr(msg, name)!r}"
                )
    if len(messages) == 1:
        return first
    return AFDControlMessage(
        tuple(tuple(m.stage_token_counts[s][0] for m in messages) for s in range(first.num_stages)),
        is_warmup=first.is_warmup,
        is_capture=first.is_capture,
        shutdown=first.shutdown,
        is_draft=first.is_draft,
    )
