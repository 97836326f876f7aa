"""``afd bench --profile`` with its engine runs: plain vLLM and an AFD 1:1 pair on the tiny
checkpoint give the profile's step, sequence and per-message costs, and on a host of fewer than
three cores AFD 1:2 its oversubscription cost (the rates and the wake-up are covered without
engines by ``test_models_calibrate.py``).

Marker ``bench`` (``nox -s bench``, not the default CI run): it asserts speed relations between
engine runs (AFD's step above plain vLLM's, a message above a thread wake-up), which belong to
benchmarks, not to the correctness suites."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from afd_models import cli
from afd_plan import load_profile

pytestmark = [pytest.mark.bench, pytest.mark.vllm_runtime, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_profile_measures_the_engine_and_the_exchange(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["bench", "--profile", "--quick", "--out", str(out), "--log-dir", str(tmp_path)]
    cache = os.environ.get("AFD_TINY_CACHE")
    if cache:
        argv += ["--cache-dir", cache]
    assert cli.main(argv) == cli.EXIT_OK
    profile = load_profile(out)
    # A vLLM decode step on CPU costs milliseconds of software; an AFD message far more than
    # a thread wake-up (it crosses processes, the connector and both roles' loops).
    assert 1e-4 < profile.step_overhead < 0.1
    assert 0 <= profile.sequence_overhead < profile.step_overhead
    raw = json.loads(out.with_name("profile.measurements.json").read_text())
    assert raw["engine"]["plain_tpot_s"].keys() == {"1", "16"}
    assert raw["engine"]["afd_tpot_s"] > raw["engine"]["plain_tpot_s"]["1"]
    assert profile.message_overhead > raw["wakeup_s"]
    assert "AFD 1:1 at batch 1" in profile.source
    shared = raw["engine"]["shared_tpot_s"]
    if (os.cpu_count() or 1) < 3:
        # Three engines on fewer cores: the 1:2 step is slower than the pair's, and what the
        # share of time does not explain lands in the cost (at least 0).
        assert shared > raw["engine"]["afd_tpot_s"]
        assert profile.host_cores == os.cpu_count() and profile.oversubscription_cost >= 0
        assert "AFD 1:2 gate on Attention at batch 1" in profile.source
    else:
        assert shared is None and "AFD 1:2" not in profile.source
