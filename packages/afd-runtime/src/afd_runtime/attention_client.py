"""Attention-side AFD client: announces each forward and exchanges MoE layers with the FFN role.

Per model forward the runner calls :meth:`AttentionClient.step` (a context manager) which sends
the control message ``[MAGIC, KIND_FORWARD, num_tokens, step]``; each remote MoE layer inside the
forward then sends its hidden states (and router logits when the gate is on Attention) with
:meth:`AttentionClient.send_layer` and waits with :meth:`AttentionClient.recv_layer` -- through
:class:`afd_runtime.pair_connector.PairAttentionConnector`, the afd-core connector the runner
installs in the AFD forward metadata.

Invariants:
* Layers are exchanged in forward order; the FFN checks the layer index of every message.
* A reply with ``STATUS_ERROR`` raises :class:`AFDRemoteFFNError` carrying the FFN's error text
  (read from the store); a timeout or a dead FFN raises :class:`AFDRemoteFFNError` too. Nothing
  waits longer than ``AFDConfig.timeout_s`` once a step started.
* :meth:`AttentionClient.close` says goodbye (best effort) and is idempotent.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar

import torch
import torch.distributed as dist
from afd_core.config import AFDConfig
from afd_core.topology import AFDTopology

from afd_runtime.ffn_service import error_key
from afd_runtime.transport import (
    KIND_FORWARD,
    KIND_GOODBYE,
    STATUS_OK,
    AFDTransportError,
    PairChannel,
    TransportSpec,
    check_agreement,
    dtype_code,
    header,
    open_store,
    publish_session,
    read_session,
)

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

#: How long an Attention rank waits for its FFN rank at startup.
ATTENTION_STARTUP_TIMEOUT_S = 900.0


class AFDRemoteFFNError(RuntimeError):
    """The FFN role failed to answer a layer (error reply, timeout or lost connection)."""


class AttentionClient:
    """One attention rank's link to its FFN rank."""

    def __init__(
        self,
        config: AFDConfig,
        attention_rank: int,
        *,
        startup_timeout_s: float = ATTENTION_STARTUP_TIMEOUT_S,
    ) -> None:
        self.config = config
        self.topology = AFDTopology.from_config(config)
        self.topology.check_role_rank("attention", attention_rank)
        self.attention_rank = attention_rank
        self.ffn_rank = self.topology.ffn_rank_for(attention_rank)
        self.spec = TransportSpec.from_config(config, startup_timeout_s=startup_timeout_s)
        self._store: dist.Store | None = None
        self._channel: PairChannel | None = None
        self._step = 0
        self.steps = 0

    @property
    def connected(self) -> bool:
        """True between :meth:`connect` and :meth:`close`."""
        return self._channel is not None and not self._channel.closed

    def connect(self) -> None:
        """Rendezvous with the FFN rank (attention rank 0 hosts the store). Idempotent."""
        if self.connected:
            return
        is_master = self.attention_rank == 0
        store = open_store(self.spec, is_master=is_master)
        self._store = store
        session = (
            publish_session(store)
            if is_master
            else read_session(store, self.spec.startup_timeout_s)
        )
        check_agreement(
            store,
            self.spec,
            session,
            me=f"attention{self.attention_rank}",
            peer=f"ffn{self.ffn_rank}",
        )
        self._channel = PairChannel(
            store,
            session,
            attention_rank=self.attention_rank,
            ffn_rank=self.ffn_rank,
            is_attention=True,
            timeout_s=self.spec.timeout_s,
            startup_timeout_s=self.spec.startup_timeout_s,
        )
        logger.info(
            "AFD attention rank %d connected to FFN rank %d", self.attention_rank, self.ffn_rank
        )

    def _ch(self) -> PairChannel:
        if self._channel is None or self._channel.closed:
            raise AFDRemoteFFNError(
                f"AFD attention rank {self.attention_rank} is not connected to its FFN rank"
            )
        return self._channel

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Announce one forward of ``num_tokens`` tokens (the control message)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens!r}; allowed: >= 0")
        self._wrap(lambda: self._ch().send(header(KIND_FORWARD, num_tokens, self._step), "control"))
        self._step += 1
        yield
        self.steps += 1

    def send_layer(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> None:
        """Send one layer's inputs (hidden states, and router logits when given) to the FFN."""
        n = hidden_states.shape[0]
        ch = self._ch()
        ldim = 0 if router_logits is None else router_logits.shape[-1]
        ldt = 0 if router_logits is None else dtype_code(router_logits.dtype)

        def run() -> None:
            ch.send(
                header(layer_idx, n, dtype_code(hidden_states.dtype), ldim, ldt),
                f"layer {layer_idx} header",
            )
            ch.send(hidden_states, f"layer {layer_idx} hidden")
            if router_logits is not None:
                ch.send(router_logits, f"layer {layer_idx} router logits")

        self._wrap(run)

    def recv_layer(
        self, layer_idx: int, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Wait for the FFN's ``[num_tokens, hidden_size]`` output of ``layer_idx``."""
        ch = self._ch()

        def run() -> torch.Tensor:
            reply = ch.recv_header(4, f"layer {layer_idx} reply")
            if reply[1] != STATUS_OK:
                raise AFDRemoteFFNError(
                    f"AFD FFN rank {self.ffn_rank} failed at layer {layer_idx}: "
                    f"{self._remote_error_text()}"
                )
            if reply[2] != layer_idx or reply[3] != num_tokens:
                raise AFDRemoteFFNError(
                    f"AFD protocol error: reply for layer={reply[2]} tokens={reply[3]}, "
                    f"expected layer={layer_idx} tokens={num_tokens}"
                )
            return ch.recv((num_tokens, hidden_size), dtype, f"layer {layer_idx}")

        return self._wrap(run)

    def exchange(
        self, layer_idx: int, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`send_layer` then :meth:`recv_layer` (same shape and dtype as the input)."""
        self.send_layer(layer_idx, hidden_states, router_logits)
        n, h = hidden_states.shape
        return self.recv_layer(layer_idx, n, h, hidden_states.dtype)

    def _wrap(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except AFDTransportError as exc:
            raise AFDRemoteFFNError(
                f"AFD FFN rank {self.ffn_rank} unreachable: {exc}; FFN reported: "
                f"{self._remote_error_text()}"
            ) from exc

    def _remote_error_text(self) -> str:
        store = self._store
        if store is None:
            return "(no store)"
        try:
            store.set_timeout(datetime.timedelta(seconds=2))
            return store.get(error_key(self.ffn_rank)).decode()
        except Exception:
            return "(no error published)"

    def close(self) -> None:
        """Say goodbye to the FFN rank (best effort) and release the channel. Idempotent."""
        ch, self._channel = self._channel, None
        if ch is None:
            return
        with suppress(Exception):
            ch.send(header(KIND_GOODBYE, 0, self._step), "goodbye")
        ch.close()
