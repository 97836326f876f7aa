"""The FFN role's service loop: one thread serves every Attention rank of this FFN rank.

It speaks only afd-core's connector contract (the connector ``AFDConfig.connector`` selects,
built by :func:`afd_core.connector.create_connector`). Per step::

    msg = connector.recv_control()                  # every served Attention rank's counts
    for layer in layer_indices:                     # forward order
        for stage in range(msg.num_stages):
            meta, payloads = connector.recv_dispatch(layer, stage)  # one per served rank
            out = compute(layer, cat(hidden), cat(logits), cat(topk))  # ONE call, all peers
                                                    # (+ input_ids=cat(ids) when carried)
            connector.send_combine(out, meta)       # split back by meta.num_tokens

Batching: the unit of work is (layer, stage) over all served Attention ranks; their tokens are
concatenated in served-rank order, computed once and split back by each rank's count. A
(layer, stage) whose total is zero tokens runs no compute (its empty reply moves no bytes).

One loop for every ``num_ffn_ranks``: with one FFN rank each served rank sends every token; with
expert parallelism (``F > 1``) every FFN rank serves every Attention rank, but per (layer,
stage) it gets only the tokens routed to its experts, with their global top-k ids and weights,
computes the sum over its own experts and replies.

Idle peers: the connector is lockstep (every served Attention rank announces every step). vLLM
data parallelism keeps its ranks in lockstep already: while any rank has requests, every idle
rank runs a dummy batch (one token) in the same iteration, so an idle rank costs its peers at
most one padded token per step; when every rank is idle nobody steps and the loop waits for the
next control message without a deadline (an idle FFN is healthy). A rank that stops stepping
while its peers step is a failed rank: its peers' waits end after ``timeout_s`` (or at once when
its connection drops).

Lifecycle and failures:

* The connector is initialised in the service thread, retried until the Attention deployment
  appears (each attempt bounded by ``startup_timeout_s``); the FFN outlives its Attention
  deployment: a shutdown control message (the Attention role's goodbye) or a lost peer closes
  the connector and the loop waits for the next deployment.
* A handshake disagreement with an Attention rank (different AFD settings, model shapes or
  checkpoint) refuses that Attention deployment (it fails its own start naming the field) and
  the FFN keeps waiting for a matching one: a misconfigured Attention cannot take a running FFN
  down. A disagreement between FFN ranks (quantization geometry), a failing ready hook (a Mega
  bind) and a protocol violation are fatal, and so is a compute error: it is published through the connector
  (:meth:`afd_core.connector.AFDConnectorBase.abort`), so the Attention ranks' waits fail at once
  with this rank's error text, and then re-raised by :meth:`FFNService.raise_if_failed`.
* A startup cancelled by SIGTERM/SIGINT (:class:`afd_core.errors.AFDCancelledError`, see
  :mod:`afd_runtime.signals`) ends the loop without an error, and so does :meth:`FFNService.stop`
  while the thread waits for an Attention deployment (its startup waits run in a
  :func:`~afd_core.session.startup.startup_cancel_scope` of the stop event; ``stop`` waits for
  the thread to end).
* :meth:`FFNService.stop` is idempotent. The transport cannot cancel a wait, so a thread
  blocked waiting for the next control message is ended by the peers: the rank announces its
  leave, the Attention ranks close their side within about two heartbeats, and the wait ends
  as a lost peer (bounded by :data:`FFN_LEAVE_JOIN_S`; past it, e.g. with an Attention role
  that is gone without closing, the daemon thread ends with the process).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from afd_core.config import AFDConfig
from afd_core.connector import AFDConnectorBase
from afd_core.errors import (
    AFDCancelledError,
    AFDError,
    AFDHandshakeError,
    AFDModelError,
    AFDPeerError,
    AFDProtocolError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDControlMessage, AFDPayload
from afd_core.session.startup import startup_cancel_scope
from afd_core.topology import AFDTopology

from afd_runtime.compute import BindingFFNCompute, FFNCompute, SteppedFFNCompute
from afd_runtime.faults import delay_injector, raise_if_injected
from afd_runtime.metrics import RoleMetrics

logger = logging.getLogger(__name__)

#: How long a waiting FFN pauses before trying to reach its Attention deployment again.
CONNECT_RETRY_S = 1.0
#: How long :meth:`FFNService.stop` waits for a step in progress to finish.
FFN_STOP_JOIN_S = 5.0
#: How long :meth:`FFNService.stop` waits for the Attention ranks to end an idle wait after this
#: rank's goodbye (their watchers look every second, their supervisors every second).
FFN_LEAVE_JOIN_S = 6.0

ConnectorFactory = Callable[[], AFDConnectorBase]


class FFNServiceError(AFDError):
    """The FFN service loop failed; ``__cause__`` holds the original error."""


@dataclass
class FFNServiceStats:
    """Counters of one FFN rank (monotonic for the life of the service), kept in step with the
    ``afd_*`` metrics the service publishes (:class:`afd_runtime.metrics.RoleMetrics`).

    ``compute_calls / steps`` is the number of compute calls per step: with batching it equals
    the number of MoE layers times stages, whatever the number of served Attention ranks.
    """

    steps: int = 0
    compute_calls: int = 0
    tokens: int = 0
    bytes: int = 0  # payload bytes received (every field, every layer)
    sent_bytes: int = 0  # reply bytes sent

    @property
    def tokens_per_call(self) -> float:
        """Mean tokens per compute call."""
        return self.tokens / self.compute_calls if self.compute_calls else 0.0


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


@dataclass(frozen=True)
class BatchedInputs:
    """One (layer, stage)'s inputs over every served Attention rank, concatenated in served-rank
    order: hidden states, and each optional field when the payloads carry it."""

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor] | None = None  # global (weights, ids)
    input_ids: torch.Tensor | None = None


def batch_payloads(payloads: Sequence[AFDPayload]) -> BatchedInputs:
    """Every peer's payload fields, concatenated in served-rank order (a field is present in
    every payload or in none: the payload spec decides)."""
    first = payloads[0]
    hidden = _cat([p.hidden_states for p in payloads])
    logits = ids = None
    topk = None
    if first.router_logits is not None:
        logits = _cat([p.router_logits for p in payloads])  # type: ignore[misc]
    if first.topk_ids is not None:
        weights = _cat([p.topk_weights for p in payloads])  # type: ignore[misc]
        topk = (weights, _cat([p.topk_ids for p in payloads]))  # type: ignore[misc]
    if first.input_ids is not None:
        ids = _cat([p.input_ids for p in payloads])  # type: ignore[misc]
    return BatchedInputs(hidden, logits, topk, ids)


def _payload_bytes(payloads: Sequence[AFDPayload]) -> int:
    return sum(t.numel() * t.element_size() for p in payloads for t in p.tensors().values())


class FFNService:
    """Serves the Attention ranks of one FFN rank until stopped or failed."""

    def __init__(
        self,
        config: AFDConfig,
        ffn_rank: int,
        layer_indices: Sequence[int],
        compute: FFNCompute,
        connector_factory: ConnectorFactory,
        draft_layer_indices: Sequence[int] = (),
    ) -> None:
        """``layer_indices``: every MoE layer this rank serves, the draft model's included;
        ``draft_layer_indices``: those a step marked ``is_draft`` runs (a speculative draft
        model's, e.g. DeepSeek's MTP layer, the last indices); every other step runs the rest."""
        if not layer_indices:
            raise AFDModelError(
                "layer_indices", list(layer_indices), "at least one MoE layer index"
            )
        if not set(draft_layer_indices) <= set(layer_indices):
            raise AFDModelError(
                "draft_layer_indices",
                list(draft_layer_indices),
                f"a subset of layer_indices {list(layer_indices)}",
            )
        self.config = config
        self.ffn_rank = ffn_rank
        topology = AFDTopology.from_config(config)
        topology.check_role_rank("ffn", ffn_rank)
        self.topology = topology
        self.num_peers = len(topology.attention_ranks_for(ffn_rank))
        self.layer_indices = tuple(layer_indices)
        self.draft_layer_indices = tuple(draft_layer_indices)
        draft = set(self.draft_layer_indices)
        self.target_layer_indices = tuple(i for i in self.layer_indices if i not in draft)
        self.compute = compute
        # Decided once: a stepped compute gets one scope per step (see _serve_step).
        self._step_scope = compute.step if isinstance(compute, SteppedFFNCompute) else None
        self._delay = delay_injector(f"ffn-{ffn_rank}")  # tests only (AFD_INJECT_DELAY_MS)
        self._factory = connector_factory
        self._connector: AFDConnectorBase | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._idle = threading.Event()  # set while waiting for a control message or a peer
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.stats = FFNServiceStats()
        self.metrics = RoleMetrics("ffn", ffn_rank)
        self.metrics.ffn_shape(self.num_peers, len(self.layer_indices))
        self.deployments = 0  # Attention deployments served (initialised connectors)
        self.refusals = 0  # Attention deployments refused at the handshake
        self._last_refusal = ""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the service thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._main, name=f"afd-ffn-service-{self.ffn_rank}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop and wait for it (idempotent; see the module docstring).

        A step in progress, and a wait for an Attention deployment (cancelled within one poll),
        are waited for up to :data:`FFN_STOP_JOIN_S`; a thread blocked
        waiting for the next control message is ended by its peers: this rank announces its
        leave (:meth:`~afd_core.connector.AFDConnectorBase.announce_leave`), the Attention
        ranks close their side, the wait ends as a lost peer, and the thread closes its
        connector, all before the process exits (a thread woken inside the transport while
        the interpreter finalizes aborts the process)."""
        if self._stop.is_set():
            return
        self._stop.set()
        t = self._thread
        if t is None:
            return
        connector = self._connector
        if not self._idle.is_set() or connector is None:
            # A step in progress, or a wait for an Attention deployment (cancelled by _stop).
            t.join(FFN_STOP_JOIN_S)
        elif connector.announce_leave():
            t.join(FFN_LEAVE_JOIN_S)
            if t.is_alive():
                logger.warning(
                    "AFD FFN rank %d: the Attention ranks did not end this rank's wait within "
                    "%.0fs of its goodbye; stopping without it",
                    self.ffn_rank,
                    FFN_LEAVE_JOIN_S,
                )

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s``; True once the thread has ended (failed or stopped)."""
        return self._done.wait(timeout_s)

    @property
    def failed(self) -> bool:
        """True once the loop stored an error."""
        return self._error is not None

    def raise_if_failed(self) -> None:
        """Re-raise the stored loop error as :class:`FFNServiceError`."""
        err = self._error
        if err is not None:
            raise FFNServiceError(f"AFD FFN service loop failed: {err}") from err

    # ------------------------------------------------------------------ serving
    def _main(self) -> None:
        try:
            while not self._stop.is_set():
                connector = self._connect()
                if connector is None:
                    return
                try:
                    self._serve(connector)
                finally:
                    connector.close()
                    self._connector = None
                    self.metrics.link_up.set(0)
        except BaseException as exc:
            if not self._stop.is_set():
                logger.error("AFD FFN rank %d service failed: %s", self.ffn_rank, exc)
                self._error = exc
        finally:
            self._done.set()

    def _connect(self) -> AFDConnectorBase | None:
        """Initialise a connector with the next Attention deployment; ``None`` when stopped.

        Waiting is unbounded (an FFN may start first or outlive its Attention deployment);
        an Attention deployment that disagrees is refused and waited past; a disagreement
        between FFN ranks and a failed bind (a Mega, :class:`AFDCommBindError`) are fatal:
        retrying could not change them."""
        while not self._stop.is_set():
            connector = self._factory()
            self._idle.set()
            try:
                with startup_cancel_scope(self._stop, "the FFN service stopped"):
                    connector.open_groups()
                    self._bind(connector)
                    connector.confirm_ready()
            except AFDCancelledError as exc:
                # SIGTERM/SIGINT or stop() while waiting for the Attention role: not a failure.
                connector.close()
                logger.info("AFD FFN rank %d: %s", self.ffn_rank, exc)
                return None
            except AFDHandshakeError as exc:
                connector.close()
                if not self._refuse_attention(exc):
                    raise
                self._stop.wait(CONNECT_RETRY_S)
                continue
            except (AFDTimeoutError, AFDPeerError) as exc:
                connector.close()
                logger.info("AFD FFN rank %d waiting for Attention: %s", self.ffn_rank, exc)
                self._stop.wait(CONNECT_RETRY_S)
                continue
            finally:
                self._idle.clear()
            self._connector = connector
            self.deployments += 1
            self.metrics.connected()
            logger.info(
                "AFD FFN rank %d serving %d Attention peer(s) through connector %r",
                self.ffn_rank,
                self.num_peers,
                connector.name,
            )
            return connector
        return None

    def _bind(self, connector: AFDConnectorBase) -> None:
        """Bind a compute that needs the connector's communicator (Mega) between
        ``open_groups()`` and ``confirm_ready()``; a failure is published to every peer in stage
        ``bind`` (their starts fail naming this rank and the reason) before it is raised."""
        if not (isinstance(self.compute, BindingFFNCompute) and self.compute.needs_bind):
            return
        try:
            self.compute.bind(connector)
        except AFDCancelledError:
            raise  # the process is stopping: not a bind failure (the caller closes)
        except BaseException as err:
            connector.abort("bind", f"{type(err).__name__}: {err}")
            raise

    def _refuse_attention(self, exc: AFDHandshakeError) -> bool:
        """True when ``exc`` is a disagreement with an Attention rank: that deployment is
        refused (it fails its own start naming the same field) and this FFN rank keeps waiting
        for a matching one. A disagreement between FFN ranks stays fatal."""
        attention_ranks = self.topology.num_attention_peers
        if not 0 <= exc.peer_rank < attention_ranks:
            return False
        text = str(exc)
        if text != self._last_refusal:
            self._last_refusal = text
            logger.error(
                "AFD FFN rank %d refused an Attention deployment and keeps waiting for one that "
                "matches: %s",
                self.ffn_rank,
                text,
            )
        self.refusals += 1
        self.metrics.refusals.inc()
        return True

    def _serve(self, connector: AFDConnectorBase) -> None:
        """Serve steps until the deployment says goodbye or is lost (returns), or a fatal
        error (raises)."""
        while not self._stop.is_set():
            self._idle.set()
            try:
                msg = connector.recv_control(timeout_s=float("inf"))
            except AFDProtocolError:
                raise
            except (AFDPeerError, AFDTimeoutError) as exc:
                if self._stop.is_set():  # the peers closed after this rank's goodbye (stop)
                    logger.info("AFD FFN rank %d left its Attention peers", self.ffn_rank)
                else:
                    logger.warning(
                        "AFD FFN rank %d lost its Attention peers: %s", self.ffn_rank, exc
                    )
                return
            finally:
                self._idle.clear()
            if msg.shutdown:
                logger.info("AFD FFN rank %d: the Attention deployment said goodbye", self.ffn_rank)
                return
            if msg.num_stages != self.config.num_stages:
                # The handshake compared num_stages, so only a peer breaking the protocol gets
                # here; its waits fail at once with this text instead of timing out.
                reason = (
                    f"num_stages: the Attention ranks announced {msg.num_stages} stage(s) for a "
                    f"step; this FFN rank serves num_stages={self.config.num_stages}"
                )
                connector.abort("recv_control", reason)
                raise AFDProtocolError(reason)
            try:
                self._serve_step(connector, msg)
            except AFDProtocolError:
                raise
            except (AFDPeerError, AFDTimeoutError) as exc:
                logger.warning("AFD FFN rank %d lost a peer mid-step: %s", self.ffn_rank, exc)
                return
            self.stats.steps += 1
            self.metrics.steps.inc()
            self.metrics.step_tokens.inc(sum(sum(c) for c in msg.stage_token_counts))

    def _serve_step(self, connector: AFDConnectorBase, msg: AFDControlMessage) -> None:
        scope = self._step_scope
        if scope is None:
            self._serve_layers(connector, msg)
            return
        with scope(max((sum(c) for c in msg.stage_token_counts), default=0)):
            self._serve_layers(connector, msg)

    def _serve_layers(self, connector: AFDConnectorBase, msg: AFDControlMessage) -> None:
        stats = self.stats
        layers = self.draft_layer_indices if msg.is_draft else self.target_layer_indices
        # A collective compute (Mega over several FFN ranks) is called for every (layer,
        # stage), with 0 rows too: every FFN rank joins each dispatch and combine.
        compute = self.compute
        collective = isinstance(compute, BindingFFNCompute) and compute.collective
        for layer in layers:
            for stage in range(msg.num_stages):
                meta, payloads = connector.recv_dispatch(layer, stage)
                if self._delay is not None:
                    self._delay()
                total = sum(meta.num_tokens)
                if not total:  # nothing of its own to compute; the reply moves no bytes
                    if collective:
                        self._compute(connector, layer, batch_payloads(payloads))
                    connector.send_combine([p.hidden_states for p in payloads], meta)
                    continue
                out = self._compute(connector, layer, batch_payloads(payloads))
                stats.compute_calls += 1
                stats.tokens += total
                self.metrics.compute_call(layer, total)
                self._count_bytes(payloads, out)
                connector.send_combine(out, meta)

    def _compute(
        self, connector: AFDConnectorBase, layer: int, inputs: BatchedInputs
    ) -> torch.Tensor:
        """One compute call; a failure is published to the peers (``abort``) and re-raised."""
        try:
            raise_if_injected(
                "ffn_compute", f"AFD FFN rank {self.ffn_rank} compute of layer {layer}"
            )
            hidden, logits, topk, ids = (
                inputs.hidden_states,
                inputs.router_logits,
                inputs.topk,
                inputs.input_ids,
            )
            if ids is not None:  # token-id routed layers (e.g. DeepSeek-V4 hash routing)
                return self.compute(layer, hidden, logits, topk, input_ids=ids)
            if topk is not None:
                return self.compute(layer, hidden, logits, topk)
            return self.compute(layer, hidden, logits)
        except Exception as exc:
            connector.abort(f"ffn compute (layer {layer})", f"{type(exc).__name__}: {exc}")
            raise

    def _count_bytes(self, payloads: Sequence[AFDPayload], out: torch.Tensor) -> None:
        received = _payload_bytes(payloads)
        sent = out.numel() * out.element_size()
        self.stats.bytes += received
        self.stats.sent_bytes += sent
        self.metrics.received.inc(received)
        self.metrics.sent.inc(sent)
