"""Worker selection, the version guard and patch idempotence."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
from afd_core.errors import AFDConfigError
from afd_runtime import patches
from afd_runtime.vllm_compat import UnsupportedVLLMError, check_vllm_version
from afd_runtime.workers import AFD_WORKERS, afd_worker_qualname

CPU = "vllm.v1.worker.cpu_worker.CPUWorker"


def test_version_guard() -> None:
    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.3.dev1") == "0.32.3.dev1"
    for bad in ("0.31.9", "0.33.0", "1.0.0", "0.3.2"):
        with pytest.raises(UnsupportedVLLMError, match=re.escape(bad)):
            check_vllm_version(bad)


@pytest.mark.parametrize("platform_worker", sorted(AFD_WORKERS))
def test_worker_selection_per_platform(platform_worker: str) -> None:
    attn, ffn = AFD_WORKERS[platform_worker]
    assert afd_worker_qualname("attention", platform_worker) == attn
    assert afd_worker_qualname("ffn", platform_worker) == ffn
    # Already selected (or given with ':'), it is kept.
    assert afd_worker_qualname("ffn", ffn) == ffn
    mod, _, cls = ffn.rpartition(".")
    assert afd_worker_qualname("ffn", f"{mod}:{cls}") == ffn


def test_worker_selection_errors_name_the_field() -> None:
    with pytest.raises(AFDConfigError, match=r"'parallel_config\.worker_cls': got 'my\.Worker'"):
        afd_worker_qualname("attention", "my.Worker")
    with pytest.raises(AFDConfigError, match=r"'role': got 'both'"):
        afd_worker_qualname("both", CPU)
    # The attention worker is not a valid FFN worker.
    with pytest.raises(AFDConfigError, match="worker_cls"):
        afd_worker_qualname("ffn", AFD_WORKERS[CPU][0])


def _vllm_config(
    afd: dict[str, Any] | None, worker: Any = CPU, backend: Any = "mp", world_size: int = 1
) -> SimpleNamespace:
    return SimpleNamespace(
        additional_config={} if afd is None else {"afd": afd},
        parallel_config=SimpleNamespace(
            worker_cls=worker, distributed_executor_backend=backend, world_size=world_size
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        scheduler_config=SimpleNamespace(async_scheduling=True),  # vLLM's default off CPU
        shutdown_timeout=0,
    )


def test_select_afd_worker_leaves_plain_configs_alone() -> None:
    cfg = _vllm_config(None)
    patches.select_afd_worker(cfg, on_cpu=True)
    assert cfg.parallel_config.worker_cls == CPU
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.cache_config.enable_prefix_caching is True
    assert cfg.shutdown_timeout == 0


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_afd_roles_on_cpu_run_their_worker_in_process(role: str) -> None:
    cfg = _vllm_config({"role": role, "port": 1})
    patches.select_afd_worker(cfg, requested_backend=None, on_cpu=True)
    assert cfg.parallel_config.distributed_executor_backend == "uni"


def test_in_process_executor_keeps_what_it_must() -> None:
    cases = [
        # (platform is CPU, user's --distributed-executor-backend, world size, vLLM's choice)
        (False, None, 1, "mp"),  # other platforms: vLLM's choice stands
        (True, "mp", 1, "mp"),  # the user asked for mp
        (True, None, 2, "mp"),  # more than one worker in the engine
        (True, None, 1, "ray"),  # a backend vLLM picked for a reason of its own
    ]
    for on_cpu, requested, world_size, chosen in cases:
        pc = SimpleNamespace(distributed_executor_backend=chosen, world_size=world_size)
        assert patches.in_process_executor(pc, requested, on_cpu) is False
        assert pc.distributed_executor_backend == chosen
    pc = SimpleNamespace(distributed_executor_backend="mp", world_size=1)
    assert patches.in_process_executor(pc, None, True) is True
    assert pc.distributed_executor_backend == "uni"
    assert patches.in_process_executor(pc, None, True) is True  # idempotent
    assert pc.distributed_executor_backend == "uni"


def test_select_afd_worker_per_role() -> None:
    ffn = _vllm_config({"role": "ffn", "port": 1})
    patches.select_afd_worker(ffn)
    assert ffn.parallel_config.worker_cls == AFD_WORKERS[CPU][1]
    assert ffn.cache_config.enable_prefix_caching is False
    assert ffn.shutdown_timeout == patches.AFD_SHUTDOWN_TIMEOUT_S
    attn = _vllm_config({"role": "attention", "port": 1})
    attn.shutdown_timeout = 3
    patches.select_afd_worker(attn)
    assert attn.parallel_config.worker_cls == AFD_WORKERS[CPU][0]
    assert attn.cache_config.enable_prefix_caching is True
    assert attn.shutdown_timeout == 3
    # The FFN-loss hold wraps EngineCore.step: the Attention role never steps a batch queue.
    assert attn.scheduler_config.async_scheduling is False
    assert ffn.scheduler_config.async_scheduling is True


def test_data_parallelism_must_match_the_topology() -> None:
    afd = {"role": "attention", "port": 1, "num_attention_ranks": 2}
    cfg = _vllm_config(afd)  # no --data-parallel-size: one engine for two ranks
    with pytest.raises(AFDConfigError) as err:
        patches.select_afd_worker(cfg, on_cpu=True)
    assert (err.value.field, err.value.value) == ("num_attention_ranks", 2)
    assert "--data-parallel-size (1)" in str(err.value)
    assert cfg.parallel_config.worker_cls == CPU  # refused before anything changed
    cfg.parallel_config.data_parallel_size = 2
    patches.select_afd_worker(cfg, on_cpu=True)
    assert cfg.parallel_config.worker_cls == AFD_WORKERS[CPU][0]
    ffn = _vllm_config({"role": "ffn", "port": 1, "num_attention_ranks": 2})
    ffn.parallel_config.data_parallel_size = 2
    with pytest.raises(AFDConfigError) as err:
        patches.select_afd_worker(ffn, on_cpu=True)
    assert (err.value.field, err.value.value) == ("--data-parallel-size", 2)
    ffn.parallel_config.data_parallel_size = 1
    patches.select_afd_worker(ffn, on_cpu=True)
    assert ffn.parallel_config.worker_cls == AFD_WORKERS[CPU][1]


@pytest.mark.parametrize("text", ['{"afd": {"role": "ffn",', "[1]", "", "afd"])
def test_unparsed_additional_config_text_is_refused_naming_the_flag(text: str) -> None:
    with pytest.raises(AFDConfigError) as err:
        patches.check_additional_config_text(SimpleNamespace(additional_config=text))
    assert (err.value.field, err.value.value) == ("--additional-config", text)


@pytest.mark.parametrize("value", [None, {}, {"afd": {"role": "ffn"}}, '{"afd": {}}'])
def test_parsed_or_valid_additional_config_is_left_to_vllm(value: Any) -> None:
    args = SimpleNamespace(additional_config=value)
    patches.check_additional_config_text(args)
    assert args.additional_config == value


def test_vllm_cli_malformed_additional_config_fails_in_the_patch() -> None:
    """Through vLLM's own parser: text not shaped like {...} reaches create_engine_config as a
    str, where the patch refuses it before vLLM builds (and pydantic rejects) the config."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    patches.apply_vllm_patches()
    text = '{"afd": {"role": "ffn", "port": 29700'
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(["--model", "unused-model-dir", "--additional-config", text])
    engine_args = EngineArgs.from_cli_args(ns)
    assert engine_args.additional_config == text  # vLLM's parser passed it through
    with pytest.raises(AFDConfigError) as err:
        engine_args.create_engine_config()
    assert (err.value.field, err.value.value) == ("--additional-config", text)
    assert "line 1 column 38 (char 37)" in str(err.value)  # the end of the text


def test_select_afd_worker_rejects_class_objects() -> None:
    with pytest.raises(AFDConfigError, match="worker_cls"):
        patches.select_afd_worker(_vllm_config({"role": "ffn", "port": 1}, worker=object))


def test_apply_patches_is_idempotent() -> None:
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core import EngineCoreProc
    from vllm.v1.engine.core_client import MPClient

    patches.apply_vllm_patches()
    first = (EngineArgs.create_engine_config, EngineCoreProc.run_busy_loop, MPClient.__init__)
    patches.apply_vllm_patches()
    assert (EngineArgs.create_engine_config, EngineCoreProc.run_busy_loop, MPClient.__init__) == (
        first
    )
    assert patches.patches_applied()


def test_apply_patches_refuses_other_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(UnsupportedVLLMError, match=r"0\.33\.0"):
        patches.apply_vllm_patches()


def test_non_loopback_host_without_secret_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AFD_SECRET", raising=False)
    cfg = _vllm_config({"role": "ffn", "port": 1, "host": "10.231.0.1"})
    with pytest.raises(AFDConfigError) as err:
        patches.select_afd_worker(cfg, on_cpu=True)
    assert err.value.field == "AFD_SECRET" and "10.231.0.1" in str(err.value)
    assert cfg.parallel_config.worker_cls == CPU  # refused before anything changed
    monkeypatch.setenv("AFD_SECRET", "s" * 16)
    patches.select_afd_worker(cfg, on_cpu=True)
    assert cfg.parallel_config.worker_cls == AFD_WORKERS[CPU][1]


AFD_CFG = SimpleNamespace(additional_config={"afd": {"role": "attention", "port": 29000}})
PLAIN_CFG = SimpleNamespace(additional_config={})


@pytest.fixture
def sigterm_raises_keyboard_interrupt() -> Any:
    """vLLM's API server handler during startup (``_interrupt_init``); restored afterwards."""
    import signal

    saved = signal.getsignal(signal.SIGTERM)

    def interrupt_init(*_: Any) -> None:
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt_init)
    yield
    signal.signal(signal.SIGTERM, saved)


def _blocking_init(seen: list[Any]) -> Any:
    def init(self: Any, asyncio_mode: bool, vllm_config: Any, *args: Any, **kw: Any) -> None:
        import time

        seen.append(vllm_config)
        import signal

        signal.raise_signal(signal.SIGTERM)
        time.sleep(2.0)  # the handler runs here (main thread, between bytecodes)

    return init


def test_engine_client_sigterm_during_startup_exits_zero_for_afd(
    sigterm_raises_keyboard_interrupt: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    enabled: list[int] = []
    monkeypatch.setattr(patches, "enable_multiprocess_metrics", lambda: enabled.append(len(seen)))
    init = patches.engine_client_init(_blocking_init(seen))
    with pytest.raises(SystemExit) as exit_:
        init(object(), True, AFD_CFG, None, False)
    assert exit_.value.code == 0
    assert seen == [AFD_CFG]
    assert enabled == [0]  # afd_* metrics turned on before the engine cores start
    import gc

    gc.unfreeze()
    assert getattr(init, "_afd_patched", False)


def test_engine_client_without_afd_keeps_vllm_behaviour(
    sigterm_raises_keyboard_interrupt: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    enabled: list[bool] = []
    monkeypatch.setattr(patches, "enable_multiprocess_metrics", lambda: enabled.append(True))
    init = patches.engine_client_init(_blocking_init([]))
    with pytest.raises(KeyboardInterrupt):
        init(object(), True, PLAIN_CFG, None, False)
    assert enabled == []


GIB = 2**30


def _kv_config(afd: dict[str, Any], kv_bytes: int | None = None, dp: int = 1) -> SimpleNamespace:
    cfg = _vllm_config(afd)
    cfg.cache_config.kv_cache_memory_bytes = kv_bytes
    cfg.cache_config.gpu_memory_utilization = 0.92
    cfg.parallel_config.data_parallel_size = dp
    return cfg


def test_cpu_attention_role_gets_a_kv_budget_that_leaves_room_for_the_ffn() -> None:
    from afd_core.config import parse_afd_config

    afd = {"role": "attention", "port": 1}
    cfg = _kv_config(afd)
    budget = patches.cpu_kv_budget(
        parse_afd_config({"afd": afd}), cfg, user_sized=False, total_bytes=24 * GIB
    )
    assert budget == 6 * GIB
    assert cfg.cache_config.kv_cache_memory_bytes == 6 * GIB
    # Two Attention ranks on the host share the same quarter.
    afd2 = {"role": "attention", "port": 1, "num_attention_ranks": 2}
    cfg2 = _kv_config(afd2, dp=2)
    patches.cpu_kv_budget(
        parse_afd_config({"afd": afd2}), cfg2, user_sized=False, total_bytes=24 * GIB
    )
    assert cfg2.cache_config.kv_cache_memory_bytes == 3 * GIB


def test_cpu_kv_budget_keeps_what_the_user_sized() -> None:
    from afd_core.config import parse_afd_config

    afd = {"role": "attention", "port": 1}
    parsed = parse_afd_config({"afd": afd})
    # VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory-bytes reach cache_config before AFD sees it.
    cfg = _kv_config(afd, kv_bytes=1 * GIB)
    assert patches.cpu_kv_budget(parsed, cfg, user_sized=False, total_bytes=24 * GIB) is None
    assert cfg.cache_config.kv_cache_memory_bytes == 1 * GIB
    # --gpu-memory-utilization given: vLLM's own sizing stands.
    cfg = _kv_config(afd)
    assert patches.cpu_kv_budget(parsed, cfg, user_sized=True, total_bytes=24 * GIB) is None
    assert cfg.cache_config.kv_cache_memory_bytes is None


def test_cpu_ffn_role_sizes_no_kv_cache() -> None:
    from afd_core.config import parse_afd_config

    afd = {"role": "ffn", "port": 1}
    cfg = _kv_config(afd)
    assert patches.cpu_kv_budget(parse_afd_config({"afd": afd}), cfg, user_sized=False) == 0
    assert cfg.cache_config.kv_cache_memory_bytes == 0


def test_select_afd_worker_applies_the_kv_budget_on_cpu_only() -> None:
    afd = {"role": "attention", "port": 1}
    off_cpu = _kv_config(afd)
    patches.select_afd_worker(off_cpu, on_cpu=False, kv_user_sized=False)
    assert off_cpu.cache_config.kv_cache_memory_bytes is None
    on_cpu = _kv_config(afd)
    patches.select_afd_worker(on_cpu, on_cpu=True, kv_user_sized=False)
    expected = int(patches.host_memory_bytes() * patches.CPU_KV_SHARE)
    assert on_cpu.cache_config.kv_cache_memory_bytes == expected
    assert 0 < expected < patches.host_memory_bytes() // 2


def test_engine_failures_report_cores_that_died_of_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal as sig

    monkeypatch.setattr(patches, "_engine_processes", [])
    monkeypatch.setattr(patches, "_engine_deaths", [])
    procs = [
        SimpleNamespace(name="EngineCore_DP0", pid=11, exitcode=None),  # still running
        SimpleNamespace(name="EngineCore_DP1", pid=12, exitcode=0),  # clean stop
        SimpleNamespace(name="EngineCore_DP2", pid=13, exitcode=-sig.SIGTERM),  # asked to stop
    ]
    client = SimpleNamespace(
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=procs))
    )
    assert patches.record_engine_processes(client, stop_on_death=False) == 3
    assert patches.record_engine_processes(client, stop_on_death=False) == 0  # idempotent
    assert patches.engine_failures() == []
    procs[0].exitcode = 1  # the engine core raised: EngineCore exits 1
    assert patches.engine_failures() == ["EngineCore_DP0 (pid 11) exited with code 1"]
    procs[1].exitcode = -sig.SIGILL  # a native crash is a failure too
    assert len(patches.engine_failures()) == 2


def test_engine_failures_record_the_engine_dead_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core's ENGINE_CORE_DEAD reaches vLLM's ``validate_alive``, which raises; the
    death is recorded even when the process is then stopped with SIGTERM by vLLM's cleanup."""
    monkeypatch.setattr(patches, "_engine_processes", [])
    monkeypatch.setattr(patches, "_engine_deaths", [])

    class DeadError(Exception):
        pass

    def validate_alive(frames: list[bytes]) -> None:
        if frames == [b"DEAD"]:
            raise DeadError

    resources = SimpleNamespace(validate_alive=validate_alive)
    patches.record_engine_processes(SimpleNamespace(resources=resources), stop_on_death=False)
    resources.validate_alive([b"output"])
    assert patches.engine_failures() == []
    with pytest.raises(DeadError):
        resources.validate_alive([b"DEAD"])
    assert patches.engine_failures() == ["an engine core reported a fatal error (DeadError)"]
    # Installing again does not wrap twice.
    patches.record_engine_processes(SimpleNamespace(resources=resources), stop_on_death=False)
    with pytest.raises(DeadError):
        resources.validate_alive([b"DEAD"])
    assert len(patches._engine_deaths) == 2
    assert len(patches.engine_failures()) == 1  # the same text once
