"""The FFN role's connector-driven service loop.

One daemon thread per served attention rank (``afd-ffn-serve-a<rank>``) runs::

    recv control -> for each MoE layer (in forward order): recv hidden (+ router logits),
    compute (FFNCompute), reply

Compute is serialised by one lock (vLLM's forward context is process-global). The loop never
touches vLLM's scheduler or KV cache.

Invariants:
* A failure (compute error, protocol violation, transfer timeout, a peer that vanished without
  saying goodbye) is stored (first error wins), written to the store key ``afd/error/ffn<rank>``
  and, for compute errors, answered with ``STATUS_ERROR`` so the Attention side raises a clear
  error instead of waiting. :meth:`FFNService.raise_if_failed` re-raises it in the engine.
* A peer that sends ``KIND_GOODBYE`` ends its session cleanly; the thread then waits for the next
  Attention deployment (a new session id), so an FFN outlives Attention restarts.
* Waiting for the next control message is unbounded (an idle FFN is healthy); every wait inside
  a step is bounded by the configured timeout.
* :meth:`FFNService.stop` is idempotent; threads blocked waiting for an idle peer are daemon
  threads and end with the process.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence

import torch.distributed as dist
from afd_core.config import AFDConfig
from afd_core.topology import AFDTopology

from afd_runtime.compute import FFNCompute
from afd_runtime.transport import (
    KIND_FORWARD,
    KIND_GOODBYE,
    STATUS_ERROR,
    STATUS_OK,
    AFDAgreementError,
    AFDTransportError,
    PairChannel,
    TransportSpec,
    check_agreement,
    dtype_from_code,
    header,
    open_store,
    read_session,
)

logger = logging.getLogger(__name__)

#: How long the FFN waits for its Attention peers to appear (they may start later).
FFN_STARTUP_TIMEOUT_S = 900.0
#: How often a waiting FFN retries reaching its Attention deployment.
CONNECT_RETRY_S = 2.0
#: How long ``stop`` waits (in total) for the threads to finish their current step.
FFN_STOP_JOIN_S = 5.0


def _port_open(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port`` (cheap, silent probe)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class FFNServiceError(RuntimeError):
    """The FFN service loop failed; ``__cause__`` holds the original error."""


def error_key(ffn_rank: int) -> str:
    """Store key where FFN rank ``ffn_rank`` publishes its failure text."""
    return f"afd/error/ffn{ffn_rank}"


class FFNService:
    """Serves the attention ranks of one FFN rank until stopped or failed."""

    def __init__(
        self,
        config: AFDConfig,
        ffn_rank: int,
        layer_indices: Sequence[int],
        hidden_size: int,
        compute: FFNCompute,
        *,
        startup_timeout_s: float = FFN_STARTUP_TIMEOUT_S,
    ) -> None:
        if not layer_indices:
            raise ValueError("layer_indices is empty; allowed: at least one MoE layer index")
        self.config = config
        self.ffn_rank = ffn_rank
        self.topology = AFDTopology.from_config(config)
        self.topology.check_role_rank("ffn", ffn_rank)
        self.layer_indices = tuple(layer_indices)
        self.hidden_size = hidden_size
        self.compute = compute
        self.spec = TransportSpec.from_config(config, startup_timeout_s=startup_timeout_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._store: dist.Store | None = None
        self.steps_served = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start one serving thread per attention rank; each connects in the background."""
        if self._threads:
            return
        for a in self.topology.attention_ranks_for(self.ffn_rank):
            t = threading.Thread(
                target=self._thread_main, args=(a,), name=f"afd-ffn-serve-a{a}", daemon=True
            )
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        """Ask every thread to stop; wait at most :data:`FFN_STOP_JOIN_S` in total (idempotent).

        A thread blocked waiting for an idle peer's next control message cannot be interrupted
        (gloo offers no cancellation); it is a daemon thread and ends with the process.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        deadline = time.monotonic() + FFN_STOP_JOIN_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def failed(self) -> bool:
        """True once a thread stored an error."""
        return self._error is not None

    def raise_if_failed(self) -> None:
        """Re-raise the stored loop error as :class:`FFNServiceError`."""
        err = self._error
        if err is not None:
            raise FFNServiceError(f"AFD FFN service loop failed: {err}") from err

    def _record(self, err: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = err
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(error_key(self.ffn_rank), f"{type(err).__name__}: {err}")

    # ------------------------------------------------------------------ serving
    def _connect(self, attention_rank: int, previous: str | None) -> PairChannel | None:
        """Join the next Attention session (one whose id differs from ``previous``).

        Waiting for an Attention deployment to appear is unbounded (retried every
        :data:`CONNECT_RETRY_S` seconds until stopped); a deployment that vanishes mid-handshake
        is skipped; a config disagreement is fatal. Returns ``None`` when stopped.
        """
        while not self._stop.is_set():
            if not _port_open(self.spec.host, self.spec.port):
                time.sleep(CONNECT_RETRY_S / 4)
                continue
            try:
                store = open_store(self.spec, is_master=False, timeout_s=CONNECT_RETRY_S)
                session = read_session(store, CONNECT_RETRY_S)
            except AFDTransportError:
                continue
            if session == previous:
                time.sleep(CONNECT_RETRY_S / 10)
                continue
            self._store = store
            try:
                check_agreement(
                    store,
                    self.spec,
                    session,
                    me=f"ffn{self.ffn_rank}",
                    peer=f"attention{attention_rank}",
                )
                return PairChannel(
                    store,
                    session,
                    attention_rank=attention_rank,
                    ffn_rank=self.ffn_rank,
                    is_attention=False,
                    timeout_s=self.spec.timeout_s,
                    startup_timeout_s=self.spec.startup_timeout_s,
                )
            except AFDAgreementError:
                raise
            except Exception as exc:
                logger.warning(
                    "AFD handshake with attention rank %d failed: %s", attention_rank, exc
                )
                previous = session
        return None

    def _thread_main(self, attention_rank: int) -> None:
        session: str | None = None
        try:
            while not self._stop.is_set():
                ch = self._connect(attention_rank, session)
                if ch is None:
                    return
                session = ch.session
                logger.info(
                    "AFD FFN rank %d serving attention rank %d (session %s)",
                    self.ffn_rank,
                    attention_rank,
                    session,
                )
                while not self._stop.is_set() and self._serve_one_step(ch):
                    pass
                ch.close()
                logger.info("AFD attention rank %d said goodbye", attention_rank)
        except BaseException as exc:
            if self._stop.is_set():
                return
            logger.error("AFD FFN service for attention rank %d failed: %s", attention_rank, exc)
            self._record(exc)

    def _serve_one_step(self, ch: PairChannel) -> bool:
        ctrl = ch.recv_header_idle(4, "control")
        kind, num_tokens = ctrl[1], ctrl[2]
        if kind == KIND_GOODBYE:
            return False
        if kind != KIND_FORWARD:
            raise AFDTransportError(f"AFD protocol error: unknown control kind {kind}")
        for expected in self.layer_indices:
            hdr = ch.recv_header(6, f"layer {expected} header")
            layer, n, hdt, ldim, ldt = hdr[1:]
            if layer != expected or n != num_tokens:
                raise AFDTransportError(
                    f"AFD protocol error: got layer={layer} tokens={n}, expected layer={expected} "
                    f"tokens={num_tokens}"
                )
            hidden = ch.recv((n, self.hidden_size), dtype_from_code(hdt), f"layer {layer} hidden")
            logits = (
                ch.recv((n, ldim), dtype_from_code(ldt), f"layer {layer} router logits")
                if ldim > 0
                else None
            )
            try:
                with self._lock:
                    out = self.compute(layer, hidden, logits)
            except Exception as exc:
                self._record(exc)
                ch.send(header(STATUS_ERROR, layer, n), f"layer {layer} error reply")
                raise
            ch.send(header(STATUS_OK, layer, n), f"layer {layer} reply header")
            ch.send(out, f"layer {layer} output")
        self.steps_served += 1
        return True
