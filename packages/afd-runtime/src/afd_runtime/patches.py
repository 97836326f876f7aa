"""The only patches AFD applies to vLLM (0.32.x), installed by :func:`apply_vllm_patches`.

1. ``EngineArgs.create_engine_config``: when ``additional_config["afd"]`` is present, replace the
   platform's default worker class with the AFD worker of the role (see
   :func:`afd_runtime.workers.afd_worker_qualname`); for the FFN role also disable prefix caching
   (there is no KV cache to cache into); raise vLLM's default ``shutdown_timeout`` of 0 to
   :data:`AFD_SHUTDOWN_TIMEOUT_S` so SIGTERM stops workers gracefully instead of force-killing
   them; on the CPU platform run the engine's one worker in the engine core process
   (:func:`in_process_executor`); refuse data parallelism that cannot match the AFD topology
   (:func:`check_role_parallelism`), a checkpoint AFD does not serve
   (:mod:`afd_runtime.checkpoint_checks`) and a non-loopback ``host`` without ``AFD_SECRET``
   (afd-core's ``deployment_secret``). Without AFD config: unchanged, except that
   ``--additional-config`` text vLLM's parser passed through unparsed (not shaped ``{...}``; vLLM
   would reject it with a pydantic error naming neither the flag nor the fault) is refused first
   with afd-core's error naming the flag and where the JSON breaks
   (:func:`check_additional_config_text`). On the CPU platform an Attention role whose KV cache
   size the user left to vLLM gets :func:`cpu_kv_budget` (a quarter of the host's memory instead
   of vLLM's 92 %, which leaves no room for the FFN role on the same host), and an FFN role gets an
   explicit zero (it has no KV cache; vLLM's CPU worker would otherwise refuse to start when the
   other role already holds more than 8 % of the memory).
2. ``EngineCoreProc.run_busy_loop`` (and ``DPEngineCoreProc``'s own, the data-parallel engine
   core's): for the FFN role, run :func:`ffn_busy_loop` instead of the scheduler loop. It serves
   only client control requests (utility calls, shutdown) between bounded waits on the workers' service loop (:data:`FFN_WAIT_S` each, the worker's main thread
   sleeping on the service, not spinning in vLLM's RPC reader; :data:`FFN_INPROCESS_WAIT_S` when
   the worker runs in the engine core process) and raises the service's error
   (the engine then reports itself dead and the process exits non-zero); on SIGTERM it stops the
   loop and exits with ``SystemExit`` (status 0). The FFN engine's RPC response readers stop
   busy-spinning (:func:`quiet_rpc_readers`): they wait seconds per RPC by design. The Attention
   role keeps the upstream loop and its spinning readers: vLLM's idle-mode wake-up can miss a
   notification and then waits out a 5 s recheck (measured: quieted Attention readers stalled
   decode to ~0.3 tokens/s), which only the FFN engine's 2 s waits can afford. No AFD: upstream
   loop, unchanged. On both roles, a loop that ends with ``SystemExit`` status 0 (SIGTERM,
   drained) arms :func:`afd_runtime.clean_exit.exit_without_teardown_after`: once vLLM's own
   ``shutdown()`` has returned, the engine core exits without CPython's module teardown (~2 s per
   role per stop).
3. The Attention role's behaviour while its FFN role is lost (requests fail with a clear error,
   ``/health`` answers 503, the engine stays up): :mod:`afd_runtime.ffn_loss`.

3. ``MPClient.__init__`` (the API server's engine client; it waits for its engine cores to be
   built, and an AFD engine core is built only once its peer role is there): for AFD roles,
   run it under :func:`afd_runtime.signals.termination_reaches_main_thread`, so a SIGTERM during
   that wait (measured: the first one left the API server waiting) still stops it, and
   end it with ``SystemExit(0)`` instead of ``KeyboardInterrupt`` when SIGTERM stopped it
   (the engine cores are stopped by vLLM's own cleanup; their AFD startup wait ends on the
   SIGTERM they get, see :mod:`afd_runtime.signals`). SIGINT keeps vLLM's
   ``KeyboardInterrupt``. It also watches the engine cores it started for a fatal error
   (:func:`record_engine_processes`: wraps ``validate_alive`` on that client's resources object,
   and keeps the engine-core processes): vLLM's API server exits with status 0 when its engine
   core died, and ``afd serve`` asks :func:`engine_failures` to exit with 1 instead. Before it
   starts the engine cores, it turns on prometheus_client's multiprocess mode with
   vLLM's own ``setup_multiprocess_prometheus``
   (:func:`afd_runtime.metrics.enable_multiprocess_metrics`), so the ``afd_*`` metrics of the
   engine core processes reach this API server's ``/metrics`` (vLLM's stat loggers, built after
   the client, follow). No AFD: unchanged.

Invariants: idempotent (a marker attribute on each patched function); refuses any vLLM that is
not 0.32.x with :class:`afd_runtime.vllm_compat.UnsupportedVLLMError`, before patching anything.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from afd_core.config import AFDConfig, AFDRole, parse_additional_config_json, parse_afd_config
from afd_core.errors import AFDConfigError
from afd_core.session.access import deployment_secret

from afd_runtime.checkpoint_checks import check_served_checkpoint
from afd_runtime.clean_exit import exit_without_teardown_after
from afd_runtime.ffn_loss import ffn_loss_patches_applied, install_ffn_loss_patches
from afd_runtime.metrics import enable_multiprocess_metrics
from afd_runtime.roles import check_role_tensor_parallelism, check_speculative_decoding
from afd_runtime.signals import termination_reaches_main_thread
from afd_runtime.vllm_compat import check_vllm_version
from afd_runtime.workers import afd_worker_qualname

logger = logging.getLogger(__name__)

#: How long one ``afd_ffn_wait`` RPC blocks in the FFN workers (bounds the reaction to SIGTERM
#: and to client requests). Above vLLM's shm reader spin window (1 s), so the worker reads the
#: next RPC asleep, not spinning.
FFN_WAIT_S: Final[float] = 2.0
#: The same bound when the worker runs in the engine core process (vLLM's ``uni`` executor, the
#: CPU default for AFD roles): the wait is a direct call, there is no RPC reader to spin, so it
#: waits in short slices and answers client requests (the API server's startup utility calls,
#: SIGTERM's wake-up) within one slice. Measured with 2 s: an FFN role became healthy ~3 s
#: after its engine was ready, and stopped up to 2 s after SIGTERM.
FFN_INPROCESS_WAIT_S: Final[float] = 0.05
#: The share of the host's memory the CPU Attention role's KV cache takes when the user did not
#: size it (``VLLM_CPU_KVCACHE_SPACE``, ``--kv-cache-memory-bytes``, ``--gpu-memory-utilization``).
CPU_KV_SHARE: Final[float] = 0.25
#: Default ``shutdown_timeout`` (seconds) for AFD roles when vLLM's default (0) is in effect.
AFD_SHUTDOWN_TIMEOUT_S: Final[int] = 10
_MARK: Final[str] = "_afd_patched"


def in_process_executor(parallel_config: Any, requested_backend: Any, on_cpu: bool) -> bool:
    """Run an AFD engine's one worker inside its engine core process (vLLM's ``uni`` executor).

    vLLM's CPU platform forces the multiprocess executor even for one worker. The engine core
    then waits for every step's result in vLLM's shm reader, which busy-spins (``sched_yield``)
    between the steps' reads, so it spins for the whole step, and an AFD step is mostly waiting
    for the peer role: on a small host that spinning core is the one the peer needs (measured on
    2 cores, 1:1: the Attention engine core at ~85 % of a core while its worker waited on the
    FFN). In-process, the thread that waits for the peer sleeps in the transport. vLLM runs a
    one-worker engine in-process on its other platforms already, so only CPU changes; a backend
    the user chose (``--distributed-executor-backend``) is kept, and so is any engine with more
    than one worker (an Attention role with ``--tensor-parallel-size`` > 1 keeps vLLM's
    multiprocess executor, one worker per TP rank). Returns True when it selected ``uni``.

    vLLM's CPU thread binding (``VLLM_CPU_OMP_THREADS_BIND``) is applied when the multiprocess
    executor spawns its worker; in-process it does not apply: size and place the OpenMP threads
    with ``OMP_NUM_THREADS`` (and ``taskset``/``numactl``), or pass
    ``--distributed-executor-backend mp`` to get vLLM's CPU default back.
    """
    if not on_cpu or requested_backend is not None:
        return False
    if int(getattr(parallel_config, "world_size", 1)) != 1:
        return False
    if parallel_config.distributed_executor_backend not in (None, "mp", "uni"):
        return False
    parallel_config.distributed_executor_backend = "uni"
    return True


def check_additional_config_text(engine_args: Any) -> None:
    """Refuse ``--additional-config`` text that vLLM's argument parser left as a string.

    vLLM 0.32 parses the flag's value as JSON only when it looks like ``{...}``; anything else
    (a truncated object, a list, an empty string) reaches ``VllmConfig`` as a ``str`` and fails
    there with a pydantic type error. Raises :class:`AFDConfigError` naming
    ``--additional-config`` and where the JSON breaks instead, before any config is built. A
    string holding a valid JSON object, or any non-string value, is left to vLLM unchanged."""
    raw = getattr(engine_args, "additional_config", None)
    if isinstance(raw, str):
        parse_additional_config_json(raw)


def check_role_parallelism(cfg: AFDConfig, parallel_config: Any) -> None:
    """Refuse, before any engine starts, a role whose vLLM data parallelism cannot match the AFD
    topology (a mismatch otherwise shows up as a role waiting for ranks that never come).

    The Attention role runs ``num_attention_ranks`` ranks as vLLM data-parallel engines, so
    ``--data-parallel-size`` must equal it; an FFN server is one FFN rank (``--data-parallel-size``
    1: vLLM's data-parallel engine loop would bypass the FFN service loop)."""
    dp = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    if cfg.role is AFDRole.ATTENTION and dp != cfg.num_attention_ranks:
        raise AFDConfigError(
            "num_attention_ranks",
            cfg.num_attention_ranks,
            f"the Attention server's --data-parallel-size ({dp})",
            detail="each Attention rank is one vLLM data-parallel engine; start the Attention "
            f"role with --data-parallel-size {cfg.num_attention_ranks} or set "
            f"num_attention_ranks={dp} on both roles",
        )
    if cfg.role is AFDRole.FFN and dp != 1:
        raise AFDConfigError(
            "--data-parallel-size",
            dp,
            "1 on the FFN role",
            detail="an FFN server serves one FFN rank; do not pass --data-parallel-size to it",
        )
    check_role_tensor_parallelism(cfg, parallel_config)


def host_memory_bytes() -> int:
    """Physical memory of this host in bytes (what vLLM's CPU worker calls total memory)."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def cpu_kv_budget(
    cfg: AFDConfig, vllm_config: Any, user_sized: bool, total_bytes: int | None = None
) -> int | None:
    """Size an AFD role's CPU KV cache when the user did not; return the bytes set (or None).

    vLLM's CPU worker sizes the KV cache to ``--gpu-memory-utilization`` (92 %) of the host's
    memory and touches all of it at start-up, so an Attention role started as documented beside
    its FFN role on one host leaves that role nothing (measured: the Attention engine at 22.7 of
    24 GiB, then OOM-killed under load). When ``user_sized`` is False and
    ``cache_config.kv_cache_memory_bytes`` is unset (no ``VLLM_CPU_KVCACHE_SPACE``), the
    Attention role takes :data:`CPU_KV_SHARE` of ``total_bytes`` (default: this host's memory),
    split over its engines' workers (data-parallel ranks x workers per engine); the FFN role,
    which has no KV cache, gets 0 (explicit, so vLLM's start-up check of free memory against
    92 % of the host does not refuse an FFN that starts after its Attention role). Anything the
    user set is kept."""
    cache = vllm_config.cache_config
    if user_sized or getattr(cache, "kv_cache_memory_bytes", None) is not None:
        return None
    if cfg.role is AFDRole.FFN:
        cache.kv_cache_memory_bytes = 0
        return 0
    total = host_memory_bytes() if total_bytes is None else total_bytes
    pc = vllm_config.parallel_config
    workers = int(getattr(pc, "world_size", 1) or 1) * max(1, cfg.num_attention_ranks)
    budget = int(total * CPU_KV_SHARE) // workers
    cache.kv_cache_memory_bytes = budget
    logger.warning(
        "AFD Attention role on CPU: KV cache %.1f GiB per worker (%d%% of this host's %.1f GiB "
        "over %d worker(s), leaving room for the FFN role; vLLM alone would take %d%%). Set "
        "VLLM_CPU_KVCACHE_SPACE (GiB), --kv-cache-memory-bytes or --gpu-memory-utilization to "
        "size it yourself.",
        budget / 2**30,
        round(CPU_KV_SHARE * 100),
        total / 2**30,
        workers,
        round(float(getattr(cache, "gpu_memory_utilization", 0.92)) * 100),
    )
    return budget


def select_afd_worker(
    vllm_config: Any,
    requested_backend: Any = None,
    on_cpu: bool = False,
    kv_user_sized: bool = True,
) -> None:
    """Point ``parallel_config.worker_cls`` at the AFD worker when AFD is configured.

    ``requested_backend``: the ``--distributed-executor-backend`` the user gave (``None``:
    none); ``on_cpu``: vLLM's current platform is CPU (see :func:`in_process_executor`);
    ``kv_user_sized``: the user gave ``--kv-cache-memory-bytes`` or a non-default
    ``--gpu-memory-utilization`` (see :func:`cpu_kv_budget`, applied on CPU only)."""
    cfg = parse_afd_config(getattr(vllm_config, "additional_config", None))
    if cfg is None:
        return
    pc = vllm_config.parallel_config
    check_role_parallelism(cfg, pc)
    check_speculative_decoding(cfg, vllm_config)
    check_served_checkpoint(cfg, vllm_config)
    # A host off loopback needs AFD_SECRET: refuse now, not after the engine has started.
    deployment_secret(cfg.host)
    current = pc.worker_cls
    if not isinstance(current, str):
        raise AFDConfigError(
            "parallel_config.worker_cls", type(current).__qualname__, "a worker qualname string"
        )
    pc.worker_cls = afd_worker_qualname(cfg.role.value, current)
    if cfg.role is AFDRole.FFN:
        # The FFN role has no KV cache; vLLM's prefix-caching coordinator needs one group.
        vllm_config.cache_config.enable_prefix_caching = False
    sched = getattr(vllm_config, "scheduler_config", None)
    if cfg.role is AFDRole.ATTENTION and sched is not None and sched.async_scheduling:
        # The FFN-loss hold (afd_runtime.ffn_loss) wraps EngineCore.step; with async
        # scheduling vLLM steps through its batch queue instead, where a lost FFN would kill the
        # engine. vLLM turns it on by default off CPU.
        sched.async_scheduling = False
        logger.info(
            "AFD Attention role: async scheduling off (requests are held across an FFN loss "
            "in EngineCore.step)"
        )
    if getattr(vllm_config, "shutdown_timeout", None) == 0:
        # Give engines time to stop their workers (AFD goodbye, no force kill) on SIGTERM.
        vllm_config.shutdown_timeout = AFD_SHUTDOWN_TIMEOUT_S
    in_process_executor(pc, requested_backend, on_cpu)
    if on_cpu:
        cpu_kv_budget(cfg, vllm_config, kv_user_sized)
    logger.info(
        "AFD role=%s worker_cls=%s executor=%s",
        cfg.role.value,
        pc.worker_cls,
        pc.distributed_executor_backend,
    )


def _afd_role(engine_core: Any) -> AFDRole | None:
    cfg = parse_afd_config(getattr(engine_core.vllm_config, "additional_config", None))
    return None if cfg is None else cfg.role


def quiet_rpc_readers(executor: Any) -> int:
    """Make the engine's worker-response readers sleep instead of spin while they wait.

    vLLM's shm ``MessageQueue`` reader busy-spins (``sched_yield``) for ``busy_loop_s`` (1 s)
    after each read; the FFN engine waits seconds per RPC (:data:`FFN_WAIT_S`), so it would spin
    a core's worth of time beside the two roles. Sets ``busy_loop_s = 0`` on each response
    queue's reader condition; returns how many it changed (0 when this vLLM lays them out
    otherwise, which only costs CPU). Idempotent."""
    changed = 0
    for mq in getattr(executor, "response_mqs", None) or ():
        cond = getattr(mq, "_spin_condition", None)
        if cond is not None and getattr(cond, "is_reader", False) and hasattr(cond, "busy_loop_s"):
            cond.busy_loop_s = 0
            changed += 1
    return changed


def ffn_busy_loop(engine_core: Any) -> None:
    """The FFN engine's loop: client control requests between waits on the service loop."""
    from vllm.v1.engine import EngineCoreRequestType

    executor = engine_core.model_executor
    multiprocess = hasattr(executor, "response_mqs")
    if multiprocess and not quiet_rpc_readers(executor):
        logger.warning("AFD FFN engine: vLLM's RPC readers not found; they keep spinning")
    wait_s = FFN_WAIT_S if multiprocess else FFN_INPROCESS_WAIT_S
    engine_core.collective_rpc("afd_ffn_start")
    while engine_core.is_running():
        engine_core.collective_rpc("afd_ffn_wait", args=(wait_s,))
        while not engine_core.input_queue.empty():
            req_type, req = engine_core.input_queue.get_nowait()
            if req_type == EngineCoreRequestType.ADD:
                logger.warning("AFD FFN role ignores generation requests; send them to Attention")
            else:
                engine_core._handle_client_request(req_type, req)
    logger.info("AFD FFN engine: shutdown requested, stopping the service loop")
    engine_core.collective_rpc("afd_ffn_stop")
    raise SystemExit


# The engine client runs in the API server, where only vLLM's logger tree has handlers.
_client_logger = logging.getLogger("vllm.afd.patches")


def _is_afd_config(vllm_config: Any) -> bool:
    return parse_afd_config(getattr(vllm_config, "additional_config", None)) is not None


def engine_client_init(original: Callable[..., None]) -> Callable[..., None]:
    """The patched ``MPClient.__init__`` (see the module docstring, patch 3)."""

    @functools.wraps(original)
    def __init__(
        self: Any, asyncio_mode: bool, vllm_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        if not _is_afd_config(vllm_config):
            original(self, asyncio_mode, vllm_config, *args, **kwargs)
            return
        # Before the engine cores start: their afd_* metrics then reach this server's /metrics.
        enable_multiprocess_metrics()
        forwarder = None
        try:
            with termination_reaches_main_thread() as forwarder:
                _client_logger.info("AFD: waiting for the engine core(s); SIGTERM/SIGINT watched")
                original(self, asyncio_mode, vllm_config, *args, **kwargs)
        except KeyboardInterrupt:
            if forwarder is not None and signal.SIGTERM in forwarder.handled:
                _client_logger.info("AFD: SIGTERM while waiting for the engine core(s); exit 0")
                gc.freeze()  # no final cyclic-GC pass over the API server's heap at exit
                raise SystemExit(0) from None
            raise
        record_engine_processes(self)

    setattr(__init__, _MARK, True)
    return __init__


#: The engine-core processes of this API server's AFD engine clients, and the fatal errors they
#: reported (see :func:`engine_failures`).
_engine_processes: list[Any] = []
_engine_deaths: list[str] = []


def record_engine_processes(client: Any, *, stop_on_death: bool = True) -> int:
    """Watch ``client``'s engine cores for a fatal error; returns how many processes it found.

    Two signals, because either can be missed: the engine core's own ``ENGINE_CORE_DEAD``
    message (vLLM's client checks every output frame with ``resources.validate_alive``; this
    wraps that method on this client's resources object only, recording the death before vLLM
    raises ``EngineDeadError``), and the exit codes of the processes vLLM's local process manager
    started (a native crash sends no message). Engines vLLM does not start as local processes
    (Ray) are watched through the message only. With ``stop_on_death`` a watcher thread stops
    this API server when an engine core died and the server did not stop (:func:`_death_watch`).
    Idempotent per client."""
    resources = getattr(client, "resources", None)
    if resources is None:
        return 0
    validate = getattr(resources, "validate_alive", None)
    if validate is not None and not getattr(validate, _MARK, False):

        def validate_alive(frames: Any) -> None:
            try:
                validate(frames)
            except Exception as err:
                _engine_deaths.append(
                    f"an engine core reported a fatal error ({type(err).__name__})"
                )
                _engine_died.set()
                raise

        setattr(validate_alive, _MARK, True)
        resources.validate_alive = validate_alive
    manager = getattr(resources, "engine_manager", None)
    procs = [p for p in getattr(manager, "processes", None) or () if p not in _engine_processes]
    _engine_processes.extend(procs)
    if stop_on_death and (procs or validate is not None):
        _start_death_watch()
    return len(procs)


#: Set when an AFD engine core of this API server died of an error.
_engine_died = threading.Event()
#: How long after an engine core's death the API server may take to stop on its own (vLLM's
#: watchdog looks every 5 s once it serves) before :func:`_death_watch` stops it.
ENGINE_DEATH_EXIT_S: Final[float] = 15.0
_death_watch_started = threading.Event()


def _start_death_watch() -> None:
    if _death_watch_started.is_set():
        return
    _death_watch_started.set()
    threading.Thread(target=_death_watch, name="afd-engine-death-watch", daemon=True).start()


def _death_watch() -> None:
    """Stop this API server when an AFD engine core died and the server did not stop by itself.

    vLLM's API server stops on its engine's death only through its watchdog, which runs once the
    HTTP server serves; an engine core that dies while the API server still starts (an FFN whose
    service fails seconds after its engine came up, e.g. refused as a second server for a served
    ``ffn_rank``) leaves a start-up call waiting on the dead engine for good (seen: 10 minutes).
    SIGTERM is how vLLM itself is asked to stop: during start-up it interrupts the wait, while
    serving it starts the graceful shutdown; ``afd serve`` then exits 1 (:func:`engine_failures`)."""
    while not _engine_died.wait(1.0):
        if engine_failures():
            break
    time.sleep(ENGINE_DEATH_EXIT_S)
    if not engine_failures():
        return
    _client_logger.error(
        "AFD: an engine core died (%s) and the API server did not stop; stopping it",
        "; ".join(engine_failures()),
    )
    os.kill(os.getpid(), signal.SIGTERM)


def engine_failures() -> list[str]:
    """What ended this API server's AFD engine cores in failure: a fatal error an engine core
    reported (e.g. the FFN service loop raised), or an engine-core process that exited with a
    code other than 0 and SIGTERM's (the stop vLLM's own shutdown asks for), e.g. a native crash.

    vLLM's API server ends normally (status 0) once its engine core died; ``afd serve`` exits
    with status 1 instead when this list is not empty, so a supervisor sees a failed role."""
    out = list(dict.fromkeys(_engine_deaths))
    for proc in _engine_processes:
        code = proc.exitcode
        if code is not None and code not in (0, -signal.SIGTERM):
            out.append(f"{proc.name} (pid {proc.pid}) exited with code {code}")
    return out


def busy_loop_patch(original_loop: Callable[[Any], None]) -> Callable[[Any], None]:
    """Patch 2 around one engine-core class's ``run_busy_loop`` (see the module docstring)."""

    @functools.wraps(original_loop)
    def run_busy_loop(self: Any) -> None:
        role = _afd_role(self)
        if role is None:
            return original_loop(self)
        try:
            if role is AFDRole.FFN:
                ffn_busy_loop(self)
            return original_loop(self)
        except SystemExit as exc:
            if exc.code in (None, 0):
                exit_without_teardown_after(self)
            raise

    setattr(run_busy_loop, _MARK, True)
    return run_busy_loop


def apply_vllm_patches() -> None:
    """Install the patches (idempotent; vLLM 0.32.x only)."""
    check_vllm_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
    from vllm.v1.engine.core_client import MPClient

    original_create = EngineArgs.create_engine_config
    if not getattr(original_create, _MARK, False):

        @functools.wraps(original_create)
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm.platforms import current_platform

            check_additional_config_text(self)
            vllm_config = original_create(self, *args, **kwargs)
            select_afd_worker(
                vllm_config,
                requested_backend=self.distributed_executor_backend,
                on_cpu=current_platform.is_cpu(),
                kv_user_sized=self.kv_cache_memory_bytes is not None
                or self.gpu_memory_utilization != EngineArgs.gpu_memory_utilization,
            )
            return vllm_config

        setattr(create_engine_config, _MARK, True)
        EngineArgs.create_engine_config = create_engine_config

    # The data-parallel engine core (an Attention role with several DP ranks) has its own loop.
    for engine_cls in (EngineCoreProc, DPEngineCoreProc):
        original_loop = engine_cls.__dict__["run_busy_loop"]
        if not getattr(original_loop, _MARK, False):
            engine_cls.run_busy_loop = busy_loop_patch(original_loop)

    original_client_init = MPClient.__init__
    if not getattr(original_client_init, _MARK, False):
        MPClient.__init__ = engine_client_init(original_client_init)

    install_ffn_loss_patches()


def patches_applied() -> bool:
    """True when every patch is installed."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc
    from vllm.v1.engine.core_client import MPClient

    return bool(
        getattr(EngineArgs.create_engine_config, _MARK, False)
        and getattr(EngineCoreProc.run_busy_loop, _MARK, False)
        and getattr(DPEngineCoreProc.run_busy_loop, _MARK, False)
        and getattr(MPClient.__init__, _MARK, False)
        and ffn_loss_patches_applied()
    )
