"""afd-runtime's stage executor: the ping-pong that runs a split step, one stage at a time.

The stages yield through afd-core's hook point (:func:`afd_core.forward_context.dbo_yield`), which
reaches the executor only because the runtime's hooks are installed (as a worker does at start).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from afd_core.errors import AFDConfigError, AFDOverlapError, AFDTimeoutError
from afd_core.forward_context import current_stage_idx, dbo_yield, install_stage_hooks
from afd_runtime import overlap, stage_hooks
from afd_runtime.overlap import current_overlap_stage, run_overlapped


@pytest.fixture(autouse=True)
def runtime_hooks() -> Iterator[None]:
    previous = install_stage_hooks(None)
    stage_hooks.install()
    yield
    install_stage_hooks(previous)


def _layers(stage: int, log: list[tuple[int, int, str]], layers: int = 3) -> object:
    def run() -> int:
        for layer in range(layers):
            log.append((stage, layer, "send"))
            dbo_yield()
            log.append((stage, layer, "recv"))
        return 100 + stage

    return run


def test_stages_alternate_at_every_yield_in_stage_order() -> None:
    log: list[tuple[int, int, str]] = []
    results = run_overlapped([_layers(0, log), _layers(1, log)], timeout_s=10)  # type: ignore[list-item]
    assert results == [100, 101]
    assert log == [
        (0, 0, "send"),
        (1, 0, "send"),
        (0, 0, "recv"),
        (0, 1, "send"),
        (1, 0, "recv"),
        (1, 1, "send"),
        (0, 1, "recv"),
        (0, 2, "send"),
        (1, 1, "recv"),
        (1, 2, "send"),
        (0, 2, "recv"),
        (1, 2, "recv"),
    ]


def test_only_one_stage_runs_at_a_time_even_with_delays() -> None:
    running: list[int] = []
    overlaps: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def stage(idx: int) -> object:
        def run() -> int:
            for layer in range(4):
                with lock:
                    running.append(idx)
                    if len(running) > 1:
                        overlaps.append(tuple(running))
                time.sleep(0.002 * ((idx + layer) % 3))
                with lock:
                    running.remove(idx)
                dbo_yield()
            return idx

        return run

    assert run_overlapped([stage(0), stage(1)], timeout_s=10) == [0, 1]  # type: ignore[list-item]
    assert overlaps == []


def test_inside_a_stage_its_index_and_resume_hook_apply() -> None:
    seen: list[tuple[int | None, int]] = []
    resumed: list[int] = []

    def stage() -> None:
        seen.append((current_overlap_stage(), current_stage_idx()))
        dbo_yield()
        seen.append((current_overlap_stage(), current_stage_idx()))

    run_overlapped([stage, stage], timeout_s=10, on_resume=resumed.append)
    assert seen == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert resumed == [0, 1, 0, 1]
    assert current_overlap_stage() is None


def test_a_lone_stage_never_waits_at_a_yield() -> None:
    log: list[tuple[int, int, str]] = []
    assert run_overlapped([_layers(0, log)], timeout_s=10) == [100]  # type: ignore[list-item]
    assert [e[2] for e in log] == ["send", "recv"] * 3


def test_a_failing_stage_stops_the_other_and_its_error_is_raised() -> None:
    log: list[tuple[int, int, str]] = []
    boom = KeyError("stage 1 broke")

    def failing() -> None:
        log.append((1, 0, "send"))
        dbo_yield()
        raise boom

    with pytest.raises(KeyError) as info:
        run_overlapped([_layers(0, log), failing], timeout_s=10)  # type: ignore[list-item]
    assert info.value is boom
    # Stage 0 received layer 0 and sent layer 1; its next yield raised, so it never received it.
    assert log == [(0, 0, "send"), (1, 0, "send"), (0, 0, "recv"), (0, 1, "send")]
    # Nothing is left running: the pooled stage threads are idle and serve the next run.
    assert not [w for w in overlap._POOL if w.busy]
    assert run_overlapped([lambda: 1, lambda: 2], timeout_s=10) == [1, 2]


def test_stage_threads_are_pooled_across_runs() -> None:
    names: list[str] = []

    def stage() -> None:
        names.append(threading.current_thread().name)

    run_overlapped([stage, stage], timeout_s=10)
    first = set(names)
    names.clear()
    for _ in range(5):
        run_overlapped([stage, stage], timeout_s=10)
    assert set(names) <= first | {threading.current_thread().name} and len(first) == 2
    assert all(n.startswith("afd-stage-") for n in first)


def test_the_stopped_stage_sees_an_overlap_error_naming_the_failed_stage() -> None:
    caught: list[BaseException] = []

    def first() -> None:
        try:
            dbo_yield()
        except AFDOverlapError as exc:
            caught.append(exc)
            raise

    def second() -> None:
        raise ValueError("bad shapes")

    with pytest.raises(ValueError, match="bad shapes"):
        run_overlapped([first, second], timeout_s=10)
    assert len(caught) == 1 and "stage 1 failed with ValueError: bad shapes" in str(caught[0])


def test_a_stage_holding_the_turn_past_the_timeout_fails_the_run() -> None:
    release = threading.Event()

    def hog() -> None:
        release.wait(5)

    def waiter() -> None:
        dbo_yield()

    start = time.monotonic()
    with pytest.raises(
        AFDTimeoutError, match=r"stage 1 waited 0\.3s for its turn; stage 0 kept it"
    ):
        run_overlapped([hog, waiter], timeout_s=0.3)
    release.set()
    assert time.monotonic() - start < 4


@pytest.mark.parametrize("timeout", [0, -1, True, "1"])
def test_run_rejects_bad_arguments(timeout: object) -> None:
    with pytest.raises(AFDConfigError, match="timeout_s"):
        run_overlapped([lambda: None], timeout_s=timeout)  # type: ignore[arg-type]
    with pytest.raises(AFDConfigError, match="stages"):
        run_overlapped([], timeout_s=1)


def test_without_the_runtime_hooks_a_yield_does_not_reach_the_executor() -> None:
    """The executor is reached through the hook point only: with no hooks installed the stages
    never hand over the turn, so stage 0 runs to its end before stage 1 starts."""
    install_stage_hooks(None)
    log: list[tuple[int, int, str]] = []
    assert run_overlapped([_layers(0, log), _layers(1, log)], timeout_s=10) == [100, 101]  # type: ignore[list-item]
    assert [e[0] for e in log] == [0] * 6 + [1] * 6
