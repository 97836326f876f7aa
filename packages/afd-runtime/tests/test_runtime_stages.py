"""Where the Attention runner splits a step into its two stages, and the runner patches that make
vLLM build the stages (afd_runtime.stages)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from afd_runtime.stages import install_stage_split, split_point


@pytest.mark.parametrize(
    ("query_lens", "computed", "expected"),
    [
        ([1, 1, 1, 1], [5, 6, 7, 8], 2),  # decode: half the requests each
        ([1, 1, 1], [5, 6, 7], 1),
        ([6, 4, 5], [0, 0, 0], 6),  # fresh prefills: cut after the first (6 | 9)
        ([1, 9], [12, 0], 1),  # a decode beside a fresh prefill
        ([3, 1], [0, 8], 3),
    ],
)
def test_split_at_the_balanced_request_boundary(
    query_lens: list[int], computed: list[int], expected: int
) -> None:
    assert split_point(query_lens, computed, 2) == expected


@pytest.mark.parametrize(
    ("query_lens", "computed", "stages"),
    [
        ([1], [4], 2),  # one request runs one stage
        ([7], [0], 2),
        ([1, 1], [3, 4], 1),  # one stage configured
        # A request that reads KV it did not write in an earlier step (prefix-cache hit or
        # chunked-prefill continuation): vLLM's own rule keeps such a step whole.
        ([1, 4], [3, 16], 2),
        ([5, 5], [0, 2], 2),
    ],
)
def test_steps_that_stay_whole(query_lens: list[int], computed: list[int], stages: int) -> None:
    assert split_point(query_lens, computed, stages) is None


@pytest.mark.parametrize(
    ("query_lens", "computed", "expected"),
    [
        ([1] * 31, [4] * 31, None),  # decodes below the decode threshold (32)
        ([1] * 32, [4] * 32, 16),
        ([300, 200], [0, 0], None),  # prefills below the prefill threshold (512)
        ([300, 212], [0, 0], 300),
        ([1, 511], [9, 0], 1),  # a mixed step counts against the prefill threshold
        ([1, 30], [9, 0], None),
    ],
)
def test_vllm_dbo_thresholds_decide_which_steps_split(
    query_lens: list[int], computed: list[int], expected: int | None
) -> None:
    assert split_point(query_lens, computed, 2, 32, 512) == expected


# -- the runner patches, on a stand-in runner (vLLM's own slice builder) -----------------------


class _Group:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def create_metadata_builders(self, *args: Any, num_metadata_builders: int = 1) -> None:
        self.calls.append((*args, num_metadata_builders))


class _Runner:
    """What install_stage_split touches on vLLM's GPU/CPU model runner."""

    def __init__(self, computed: list[int], mode: str = "NONE") -> None:
        pc = SimpleNamespace(dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)
        self.vllm_config = SimpleNamespace(parallel_config=pc)
        self.device = "cpu"
        self.input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array(computed))
        self.mode = SimpleNamespace(name=mode)
        self.attn_groups = [[_Group()]]
        self.thresholds_computed = 0

    def _determine_batch_execution_and_padding(self, **kw: Any) -> tuple[Any, ...]:
        return (self.mode, "descriptor", False, None, None)

    def _step(self, query_lens: list[int], allow: bool = True) -> tuple[bool, Any]:
        import vllm.v1.worker.gpu_model_runner as gmr

        q = np.array(query_lens, dtype=np.int32)
        result = self._determine_batch_execution_and_padding(
            num_tokens=int(q.sum()),
            num_reqs=len(q),
            num_scheduled_tokens_np=q,
            max_num_scheduled_tokens=int(q.max()),
            allow_microbatching=allow,
        )
        # The runner module's own call, as vLLM 0.32 makes it (num_ubatches is 1 without DBO).
        slices, _padded = gmr.maybe_create_ubatch_slices(result[2], q, int(q.sum()), len(q), 1)
        return result[2], slices

    def execute_model(self, query_lens: list[int], allow: bool = True) -> tuple[bool, Any]:
        return self._step(query_lens, allow)

    def initialize_metadata_builders(self, kv_cache_config: Any, sizes: list[int]) -> None:
        self.attn_groups[0][0].calls.append(("upstream",))

    def calculate_reorder_batch_threshold(self) -> None:
        self.thresholds_computed += 1


def _slices(slices: Any) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    return [
        ((s.request_slice.start, s.request_slice.stop), (s.token_slice.start, s.token_slice.stop))
        for s in slices
    ]


def test_real_steps_split_at_the_request_boundary_dummy_runs_do_not() -> None:
    runner = _Runner([5, 6, 7, 0])
    install_stage_split(runner, 2)
    install_stage_split(runner, 2)  # idempotent
    should, slices = runner.execute_model([1, 1, 1, 9])
    assert should is True
    assert _slices(slices) == [((0, 3), (0, 3)), ((3, 4), (3, 12))]
    # Outside execute_model (vLLM's dummy and profiling runs) nothing changes.
    assert runner._step([1, 1, 1, 9]) == (False, None)
    # One request, a vLLM veto or a full CUDA graph: whole.
    assert runner.execute_model([4]) == (False, None)
    assert runner.execute_model([1, 1, 1, 9], allow=False) == (False, None)
    full = _Runner([5, 6], mode="FULL")
    install_stage_split(full, 2)
    assert full.execute_model([1, 1]) == (False, None)


def test_one_stage_installs_nothing() -> None:
    runner = _Runner([5, 6])
    install_stage_split(runner, 1)
    assert runner.execute_model([1, 1]) == (False, None)


def test_every_attention_group_gets_one_metadata_builder_per_stage() -> None:
    runner = _Runner([0])
    install_stage_split(runner, 2)
    kv = SimpleNamespace(kv_cache_groups=[object()])
    runner.initialize_metadata_builders(kv, [16])
    assert runner.attn_groups[0][0].calls == [("upstream",), (runner.vllm_config, "cpu", 16, 2)]
    assert runner.thresholds_computed == 1
