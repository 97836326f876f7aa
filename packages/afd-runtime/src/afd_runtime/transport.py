"""Point-to-point AFD transport between one Attention rank and one FFN rank.

Each (attention rank, FFN rank) pair gets its own two-member gloo process group, built on one
shared :class:`torch.distributed.TCPStore` at ``host:port`` (hosted by attention rank 0) under the
prefix ``afd/<session>/pair/<a>-<f>/``, where ``<session>`` is a random id attention rank 0
publishes under ``afd/session`` (so an FFN that outlives an Attention deployment never reads a
previous deployment's keys). The groups are independent of vLLM's own ``torch.distributed`` world:
nothing here calls ``init_process_group``.

Wire protocol (all int64 headers, tensors contiguous, shapes derived from headers):

* control  (Attention -> FFN): ``[MAGIC, kind, num_tokens, step]``; ``kind`` is
  :data:`KIND_FORWARD` (one model forward follows) or :data:`KIND_GOODBYE` (the peer leaves).
* layer    (Attention -> FFN): header ``[MAGIC, layer_idx, num_tokens, hidden_dtype, logits_dim,
  logits_dtype]`` then ``hidden_states [num_tokens, hidden]`` and, when ``logits_dim > 0``,
  ``router_logits [num_tokens, logits_dim]``.
* reply    (FFN -> Attention): header ``[MAGIC, status, layer_idx, num_tokens]`` then, when
  ``status == STATUS_OK``, ``output [num_tokens, hidden]``. On ``STATUS_ERROR`` the FFN rank has
  written its error text to the store key ``afd/error/ffn<f>`` before replying.

Invariants:

* Every blocking wait is bounded by the configured timeout; a timeout or a broken connection raises
  :class:`AFDTransportError` naming the peer and the phase.
* Both sides publish the config agreement hash under ``afd/<session>/agree/<role><rank>``; a
  mismatch raises :class:`AFDAgreementError` before any tensor is exchanged.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from afd_core.config import AFDConfig
from afd_core.topology import AFDTopology

MAGIC: Final[int] = 0xAFD0
KIND_FORWARD: Final[int] = 1
KIND_GOODBYE: Final[int] = 2
STATUS_OK: Final[int] = 0
STATUS_ERROR: Final[int] = 1

_IDLE_TIMEOUT: Final[datetime.timedelta] = datetime.timedelta(days=365)

_DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
)


class AFDTransportError(RuntimeError):
    """A transport failure: timeout, broken peer, protocol violation or config disagreement."""


def dtype_code(dtype: torch.dtype) -> int:
    """Wire code of ``dtype``; raises ``ValueError`` naming the dtype when unsupported."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} is not transferable; allowed: {_DTYPES}")
    return _DTYPES.index(dtype)


def dtype_from_code(code: int) -> torch.dtype:
    """Inverse of :func:`dtype_code`."""
    if not 0 <= code < len(_DTYPES):
        raise AFDTransportError(f"unknown dtype code {code}; allowed: 0..{len(_DTYPES) - 1}")
    return _DTYPES[code]


@dataclass(frozen=True)
class TransportSpec:
    """Where and how the AFD world rendezvous.

    Invariants: ``timeout_s`` bounds every steady-state wait, ``startup_timeout_s`` bounds the
    rendezvous (store connection, peer join, group formation); ``agreement`` is the
    :meth:`afd_core.config.AFDConfig.agreement_hash` both roles must share.
    """

    host: str
    port: int
    topology: AFDTopology
    timeout_s: float
    startup_timeout_s: float
    agreement: str

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"TransportSpec.port={self.port!r}; allowed: 1..65535")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError(
                f"TransportSpec timeouts must be > 0 (timeout_s={self.timeout_s!r}, "
                f"startup_timeout_s={self.startup_timeout_s!r})"
            )

    @classmethod
    def from_config(cls, config: AFDConfig, *, startup_timeout_s: float) -> TransportSpec:
        """Build the spec of ``config`` (host, port, topology, timeouts, agreement hash)."""
        return cls(
            host=config.host,
            port=config.port,
            topology=AFDTopology.from_config(config),
            timeout_s=config.timeout_s,
            startup_timeout_s=max(startup_timeout_s, config.timeout_s),
            agreement=config.agreement_hash(),
        )


def open_store(
    spec: TransportSpec, *, is_master: bool, timeout_s: float | None = None
) -> dist.TCPStore:
    """Open the shared rendezvous store (attention rank 0 hosts it).

    ``timeout_s`` (default: the startup timeout) bounds connecting as a client.
    """
    wait = spec.startup_timeout_s if timeout_s is None else timeout_s
    try:
        return dist.TCPStore(
            spec.host,
            spec.port,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=wait),
            wait_for_workers=False,
            use_libuv=True,
        )
    except Exception as exc:
        where = "host" if is_master else "reach"
        raise AFDTransportError(
            f"AFD could not {where} the rendezvous store at {spec.host}:{spec.port} within "
            f"{wait}s: {exc}"
        ) from exc


SESSION_KEY: Final[str] = "afd/session"


def publish_session(store: dist.Store) -> str:
    """Create and publish a fresh session id (attention rank 0, once per store)."""
    session = secrets.token_hex(8)
    store.set(SESSION_KEY, session)
    return session


def read_session(store: dist.Store, timeout_s: float) -> str:
    """The session id published on ``store``; raises :class:`AFDTransportError` on timeout."""
    try:
        store.wait([SESSION_KEY], datetime.timedelta(seconds=timeout_s))
        return bytes(store.get(SESSION_KEY)).decode()
    except Exception as exc:
        raise AFDTransportError(f"AFD session id not published within {timeout_s}s: {exc}") from exc


class AFDAgreementError(AFDTransportError):
    """The two roles were started with different AFD settings."""


def check_agreement(
    store: dist.Store, spec: TransportSpec, session: str, *, me: str, peer: str
) -> None:
    """Publish our agreement token and compare it with ``peer``'s (waits up to startup timeout)."""
    store.set(f"afd/{session}/agree/{me}", spec.agreement)
    key = f"afd/{session}/agree/{peer}"
    try:
        store.wait([key], datetime.timedelta(seconds=spec.startup_timeout_s))
    except Exception as exc:
        raise AFDTransportError(
            f"AFD peer {peer} did not join within {spec.startup_timeout_s}s: {exc}"
        ) from exc
    theirs = bytes(store.get(key)).decode()
    if theirs != spec.agreement:
        raise AFDAgreementError(
            f"AFD config disagreement between {me} and {peer}: {spec.agreement!r} != {theirs!r} "
            "(both roles must be started with the same 'afd' fields)"
        )


class PairChannel:
    """A two-member gloo group between attention rank ``a`` (pair rank 0) and FFN rank ``f``.

    All waits are bounded by ``timeout_s``. ``close()`` is idempotent.
    """

    def __init__(
        self,
        store: dist.Store,
        session: str,
        *,
        attention_rank: int,
        ffn_rank: int,
        is_attention: bool,
        timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        self.attention_rank = attention_rank
        self.ffn_rank = ffn_rank
        self.is_attention = is_attention
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._peer = 1 if is_attention else 0
        self.peer_name = f"ffn{ffn_rank}" if is_attention else f"attention{attention_rank}"
        prefix = dist.PrefixStore(f"afd/{session}/pair/{attention_rank}-{ffn_rank}/", store)
        try:
            self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                prefix,
                0 if is_attention else 1,
                2,
                datetime.timedelta(seconds=startup_timeout_s),
            )
        except Exception as exc:
            raise AFDTransportError(
                f"AFD pair group with {self.peer_name} failed to form within "
                f"{startup_timeout_s}s: {exc}"
            ) from exc
        self._pg.set_timeout(self.timeout)
        self.store = store
        self.session = session

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._pg is None

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise AFDTransportError(f"AFD channel to {self.peer_name} is closed")
        return self._pg

    def send(self, tensor: torch.Tensor, phase: str) -> None:
        """Send one contiguous tensor to the peer; waits until gloo accepted it."""
        t = tensor.contiguous()
        try:
            pg: Any = self._group()
            pg.send([t], self._peer, 0).wait(self.timeout)
        except AFDTransportError:
            raise
        except Exception as exc:
            raise AFDTransportError(
                f"AFD send to {self.peer_name} failed ({phase}): {exc}"
            ) from exc

    def recv(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        phase: str,
        timeout: datetime.timedelta | None = None,
    ) -> torch.Tensor:
        """Receive one tensor of ``shape``/``dtype`` from the peer (bounded by the timeout)."""
        out = torch.empty(shape, dtype=dtype)
        try:
            pg: Any = self._group()
            pg.recv([out], self._peer, 0).wait(timeout or self.timeout)
        except AFDTransportError:
            raise
        except Exception as exc:
            raise AFDTransportError(
                f"AFD receive from {self.peer_name} failed ({phase}): {exc}"
            ) from exc
        return out

    def recv_header_idle(self, length: int, phase: str) -> list[int]:
        """Like :meth:`recv_header` but waits without a deadline (an idle peer is healthy).

        A peer that dies still fails this wait at once (gloo reports the closed connection).
        """
        pg = self._group()
        pg.set_timeout(_IDLE_TIMEOUT)
        try:
            return self.recv_header(length, phase, timeout=_IDLE_TIMEOUT)
        finally:
            pg.set_timeout(self.timeout)

    def recv_header(
        self, length: int, phase: str, timeout: datetime.timedelta | None = None
    ) -> list[int]:
        """Receive an int64 header of ``length`` and check its magic."""
        header = self.recv((length,), torch.int64, phase, timeout=timeout).tolist()
        if header[0] != MAGIC:
            raise AFDTransportError(
                f"AFD protocol error from {self.peer_name} ({phase}): bad magic {header[0]:#x}"
            )
        return [int(v) for v in header]

    def close(self) -> None:
        """Release the group (idempotent)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.shutdown()


def header(*values: int) -> torch.Tensor:
    """An int64 wire header ``[MAGIC, *values]``."""
    return torch.tensor([MAGIC, *values], dtype=torch.int64)
