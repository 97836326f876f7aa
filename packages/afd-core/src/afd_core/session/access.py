"""Who can reach a P2P world: where its listeners bind and the deployment secret that gates it.

Binding (always): the rendezvous store listens only on the configured ``host`` (torch's
TCPStore is handed a socket bound here, :func:`listen_socket`), and gloo's device listens only
on :func:`local_address`, this rank's address on the route to ``host`` (loopback when ``host``
is).

Secret: the environment variable :data:`SECRET_ENV` (``AFD_SECRET``), given to every role. It is
required when ``host`` is not loopback (:func:`deployment_secret` raises
:class:`~afd_core.errors.AFDConfigError` naming it before any socket opens) and honoured on
loopback too. With a secret the store is never exposed: it serves on an ephemeral loopback port
and the public ``host:port`` is a :class:`StoreGate`, which relays a connection to it only after
a mutual HMAC-SHA256 challenge-response (fresh nonces on both sides, so nothing can be replayed).
Joiners reach the gate through a :class:`StoreTunnel` (a one-shot loopback relay that
authenticates before torch's store client connects through it).

Invariants:
* The secret itself never travels, is never logged and never appears in an error message.
* A connection that does not complete the handshake within :data:`HANDSHAKE_TIMEOUT_S` (junk
  bytes, a half-open connection, a wrong secret) is closed without a byte reaching the store;
  the gate keeps serving everyone else. At most :data:`MAX_PENDING` handshakes run at once.
* A joiner whose secret differs from the gate's gets :class:`~afd_core.errors.AFDAccessError`
  at once (the gate's proof does not verify); no key is read or written.

Not covered (the threat is a process that can reach the port, not one on the path): the
traffic is authenticated per connection, not encrypted or integrity-protected per message.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping

from afd_core.errors import AFDAccessError, AFDConfigError, AFDTimeoutError

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_PENDING",
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "StoreGate",
    "StoreTunnel",
    "deployment_secret",
    "is_loopback_host",
    "listen_socket",
    "local_address",
]

SECRET_ENV = "AFD_SECRET"
"""Environment variable holding the deployment secret (the same value for every role)."""

MIN_SECRET_CHARS = 16
HANDSHAKE_TIMEOUT_S = 5.0
"""How long the gate waits for a connection's handshake before closing it."""
MAX_PENDING = 128
"""Handshakes the gate runs at once; connections beyond are closed at once."""

_MAGIC = b"AFDGATE1"  # gate protocol version 1
_NONCE = 32
_MAC = 32
_OK = b"OK"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names a loopback address (``localhost``, ``127.0.0.0/8``, ``::1``).

    Any other name counts as not loopback (a secret is then required) without resolving it.
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def deployment_secret(host: str, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment secret from :data:`SECRET_ENV` (``None``: unset on a loopback ``host``).

    Raises:
        AFDConfigError: field ``AFD_SECRET``: unset while ``host`` is not loopback, or shorter
            than :data:`MIN_SECRET_CHARS` (the value is never shown, only its length).
    """
    env = os.environ if environ is None else environ
    raw = env.get(SECRET_ENV, "")
    allowed = (
        f"a deployment secret of at least {MIN_SECRET_CHARS} characters in the environment of "
        "every AFD role"
    )
    if not raw:
        if is_loopback_host(host):
            return None
        raise AFDConfigError(
            SECRET_ENV,
            "<unset>",
            allowed,
            detail=f"required because host={host!r} is not a loopback address",
        )
    if len(raw) < MIN_SECRET_CHARS:
        raise AFDConfigError(SECRET_ENV, f"<{len(raw)} characters>", allowed)
    return raw.encode("utf-8")


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return family, (str(addr[0]), int(addr[1]))


def listen_socket(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A TCP socket bound to ``host:port`` only (``port`` 0: an ephemeral one), listening."""
    family, addr = _resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (``host``'s own address when it is local).

    Found with a connected UDP socket: no packet is sent.
    """
    family, addr = _resolve(host, port)
    if is_loopback_host(host):
        return addr[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return str(probe.getsockname()[0])


# -- the handshake -------------------------------------------------------------------------


def _mac(secret: bytes, label: bytes, cnonce: bytes, snonce: bytes) -> bytes:
    return hmac.new(secret, _MAGIC + label + cnonce + snonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake timed out")
        sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


def _server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> bool:
    """The gate's side: True once the peer proved it knows ``secret``."""
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE, deadline)
    if not hmac.compare_digest(hello[: len(_MAGIC)], _MAGIC):
        return False
    cnonce = hello[len(_MAGIC) :]
    snonce = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + snonce + _mac(secret, b"gate", cnonce, snonce))
    proof = _recv_exact(sock, _MAC, deadline)
    if not hmac.compare_digest(proof, _mac(secret, b"join", cnonce, snonce)):
        return False
    sock.sendall(_OK)
    return True


def _client_handshake(sock: socket.socket, secret: bytes, where: str, deadline: float) -> None:
    """The joiner's side; raises :class:`AFDAccessError` when the gate does not know ``secret``."""
    cnonce = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + cnonce)
    try:
        reply = _recv_exact(sock, len(_MAGIC) + _NONCE + _MAC, deadline)
    except (OSError, TimeoutError) as err:
        raise AFDAccessError(
            f"the AFD store at {where} did not answer the {SECRET_ENV} handshake ({err}): it "
            f"serves without a deployment secret, or it is not an AFD store; set {SECRET_ENV} "
            "to the same value for every role"
        ) from None
    snonce, gate_proof = reply[len(_MAGIC) : len(_MAGIC) + _NONCE], reply[len(_MAGIC) + _NONCE :]
    if reply[: len(_MAGIC)] != _MAGIC or not hmac.compare_digest(
        gate_proof, _mac(secret, b"gate", cnonce, snonce)
    ):
        raise AFDAccessError(
            f"the AFD store at {where} holds a different deployment secret: {SECRET_ENV} must "
            "be the same for every role"
        )
    sock.sendall(_mac(secret, b"join", cnonce, snonce))
    if _recv_exact(sock, len(_OK), deadline) != _OK:
        raise AFDAccessError(f"the AFD store at {where} refused this rank's {SECRET_ENV} proof")


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Relay bytes both ways between ``a`` and ``b`` until either side closes (two threads)."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            src.settimeout(None)
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), daemon=True, name="afd-gate-pipe").start()


class StoreGate:
    """Serves ``listener`` (the public ``host:port``): relays an authenticated connection to the
    store at ``backend`` (loopback), closes every other one (see the module docstring)."""

    def __init__(
        self,
        listener: socket.socket,
        backend: tuple[str, int],
        secret: bytes,
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._listener = listener
        self._backend = backend
        self._secret = secret
        self._handshake_timeout_s = handshake_timeout_s
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._pending = 0
        self._stopped = threading.Event()
        self.admitted = 0
        """Connections that proved the secret."""
        self.rejected = 0
        """Connections closed before reaching the store (junk, timeout, wrong secret, overflow)."""
        listener.settimeout(0.2)  # the accept loop checks for close() this often
        self._thread = threading.Thread(target=self._serve, daemon=True, name="afd-store-gate")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                full = self._pending >= self._max_pending
                if full:
                    self.rejected += 1
                else:
                    self._pending += 1
            if full:
                conn.close()
                continue
            threading.Thread(
                target=self._admit, args=(conn,), daemon=True, name="afd-store-gate-hs"
            ).start()

    def _admit(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self._handshake_timeout_s
        try:
            ok = _server_handshake(conn, self._secret, deadline)
        except (OSError, TimeoutError):
            ok = False
        upstream = None
        if ok and not self._stopped.is_set():
            try:
                upstream = socket.create_connection(self._backend, timeout=5.0)
            except OSError:
                upstream = None
        with self._lock:
            self._pending -= 1
            if upstream is None:
                self.rejected += 1
            else:
                self.admitted += 1
        if upstream is None:
            conn.close()
            return
        _pipe(conn, upstream)

    def close(self) -> None:
        """Stop accepting (established relays end when their store connection does)."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._thread.join(timeout=2.0)
        self._listener.close()


class StoreTunnel:
    """A joiner's way to a :class:`StoreGate`: authenticates to ``host:port`` first (retrying a
    refused connection until ``timeout_s``: the gate may start later), then relays the one
    connection torch's store client makes to :attr:`port` (loopback) to the gate.

    Raises (from the constructor):
        AFDAccessError: the gate holds a different secret (or none).
        AFDTimeoutError: no gate accepted a connection within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float) -> None:
        where = f"{host}:{port}"
        deadline = time.monotonic() + timeout_s
        _, addr = _resolve(host, port)
        last: OSError | None = None
        upstream: socket.socket | None = None
        while upstream is None:
            if time.monotonic() >= deadline:
                raise AFDTimeoutError(
                    f"no AFD store gate accepted a connection at {where} within "
                    f"{timeout_s:g}s ({last})"
                )
            try:
                upstream = socket.create_connection(
                    addr, timeout=max(0.1, deadline - time.monotonic())
                )
            except OSError as err:
                last = err
                time.sleep(0.1)
        try:
            hs_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            _client_handshake(upstream, secret, where, max(hs_deadline, time.monotonic() + 1))
            self._local = listen_socket("127.0.0.1", 0, backlog=1)
        except BaseException:
            upstream.close()
            raise
        self._upstream = upstream
        self._local.settimeout(max(1.0, deadline - time.monotonic()))
        self.port = int(self._local.getsockname()[1])
        self._thread = threading.Thread(target=self._relay, daemon=True, name="afd-store-tunnel")
        self._thread.start()

    def _relay(self) -> None:
        try:
            conn, _ = self._local.accept()
        except OSError:
            self._upstream.close()
            return
        finally:
            self._local.close()
        _pipe(conn, self._upstream)

    def close(self) -> None:
        """Stop waiting for the store client (a relayed connection lives on until it closes)."""
        with contextlib.suppress(OSError):
            self._local.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._local.close()
        self._thread.join(timeout=2.0)
