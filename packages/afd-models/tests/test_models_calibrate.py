"""``afd bench --profile``: this host's costs measured and written as the profile afd plan reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from afd_models import cli
from afd_models.demo.calibrate import Calibration, GemmPoint, profile_mapping
from afd_plan import load_profile, profile_from_mapping


def _calibration() -> Calibration:
    return Calibration(
        gemm=(
            GemmPoint(tokens=1, seconds=2e-4, flops_per_s=5e9, weight_bytes_per_s=1e10),
            GemmPoint(tokens=64, seconds=1e-3, flops_per_s=7e10, weight_bytes_per_s=2e9),
            GemmPoint(tokens=256, seconds=4e-3, flops_per_s=6e10, weight_bytes_per_s=5e8),
        ),
        memory_bandwidth=9e9,
        link_rtt_s={4096: 1e-4, 4 << 20: 3e-3},
        link_latency_s=5e-5,
        link_bandwidth=1.4e9,
        wakeup_s=8e-6,
        memory_bytes=24 << 30,
        threads=2,
    )


def test_the_profile_takes_the_best_gemm_rate_and_the_large_copys_bandwidth() -> None:
    profile = profile_mapping(_calibration())
    assert profile["peak_flops"] == {"fp32": 7e10}  # the fastest of the measured GEMMs
    assert profile["memory_bandwidth"] == 9e9  # not the cache-resident GEMM's 1e10
    assert (profile["link_latency"], profile["link_bandwidth"]) == (5e-5, 1.4e9)
    assert profile["message_overhead"] == 8e-6
    assert profile["memory_bytes"] == float(24 << 30)
    assert profile["compute_efficiency"] == profile["memory_efficiency"] == 1.0
    loaded = profile_from_mapping(profile, origin="test")  # a valid profile
    assert loaded.name == "calibrated"
    assert loaded.messages_use_compute is True  # a CPU host: the exchange runs on the cores
    assert loaded.compute_overlaps_memory is False  # one core: streaming and arithmetic add


@pytest.mark.timeout(300)
def test_afd_bench_profile_writes_the_default_profile_afd_plan_then_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # --no-engine: the vLLM runs are test_bench_models_calibrate.py's; the rates and the wake-up
    # are measured here.
    assert cli.main(["bench", "--profile", "--quick", "--no-engine"]) == cli.EXIT_OK
    out = tmp_path / "cache" / "afd" / "profile.json"
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    profile = load_profile(out)
    assert profile.name == "calibrated"
    assert profile.peak_flops["fp32"] > 1e8 and profile.memory_bandwidth > 1e8
    assert profile.link_bandwidth > 1e6 and 0 < profile.link_latency < 0.1
    assert 0 < profile.message_overhead < 0.01
    raw = json.loads((out.parent / "profile.measurements.json").read_text())
    assert [p["tokens"] for p in raw["gemm"]] == [1, 4, 16, 64, 256]
    # afd plan picks it up without --hardware.
    assert cli.main(["plan", "--model", "deepseek-v3", "--devices", "8", "--top", "1"]) in (
        cli.EXIT_OK,
        1,  # nothing fits a CPU host's memory: still the calibrated profile was read
    )
    assert "hardware: calibrated" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--quick"], "--quick goes with --profile"),
        (["bench", "--no-engine"], "--no-engine goes with --profile"),
        (["bench", "--profile", "--hardware", "cpu-2core"], "--hardware goes without --profile"),
    ],
)
def test_profile_only_flags_are_refused_elsewhere(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_bench_profile_is_refused_before_any_engine_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "--hardware", "no-such-device"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "afd bench: error:" in err and "no-such-device" in err and "cpu-2core" in err
