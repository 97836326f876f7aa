"""Hardware profiles: the shipped ones load and cite a source; every bad field is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_plan.errors import AFDPlanError
from afd_plan.hardware import (
    DEFAULT_PROFILE,
    calibrated_profile_path,
    load_profile,
    profile_from_mapping,
    shipped_profiles,
)
from afd_plan_inputs import ROUND_DEVICE


def test_shipped_profiles_load_and_cite_their_source() -> None:
    names = shipped_profiles()
    assert {"h100-sxm", "h200-sxm", "ascend-910c-die", "cpu-2core", DEFAULT_PROFILE} <= set(names)
    for name in names:
        hw = load_profile(name)
        assert hw.name == name and len(hw.source) > 40
    h100 = load_profile("h100-sxm")
    assert h100.flops("bf16") == pytest.approx(989e12 * 0.6)
    assert h100.bandwidth == pytest.approx(3.35e12 * 0.8)


def test_effective_rates(device: Any) -> None:
    hw = device.with_overrides(compute_efficiency=0.5, memory_efficiency=0.25)
    assert hw.flops("int8") == 1e12 and hw.flops("bf16") == 0.5e12
    assert hw.flops("fp16") == 0.5e12  # falls back to bf16
    assert hw.bandwidth == 0.25e11 and hw.kv_bandwidth == 0.25e11
    assert hw.with_overrides(kv_efficiency=0.5).kv_bandwidth == 0.5e11


def test_json_and_toml_files(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text(json.dumps(ROUND_DEVICE))
    assert load_profile(tmp_path / "p.json").memory_bandwidth == 1e11


@pytest.mark.parametrize(
    ("flag", "default"), [("messages_use_compute", False), ("compute_overlaps_memory", True)]
)
def test_a_flag_has_its_default_round_trips_and_is_written_only_when_set(
    flag: str, default: bool, tmp_path: Path
) -> None:
    assert getattr(profile_from_mapping(ROUND_DEVICE), flag) is default
    host = profile_from_mapping({**ROUND_DEVICE, flag: not default})
    assert getattr(host, flag) is (not default)
    (tmp_path / "host.json").write_text(json.dumps(host.to_mapping()))
    assert load_profile(tmp_path / "host.json") == host
    assert flag not in profile_from_mapping(ROUND_DEVICE).to_mapping()


def test_host_cores_default_to_own_devices_and_round_trip(tmp_path: Path) -> None:
    own = profile_from_mapping(ROUND_DEVICE)
    assert own.host_cores == 0 and own.time_sharing(64) == 1.0
    host = profile_from_mapping({**ROUND_DEVICE, "host_cores": 2})
    assert [host.time_sharing(n) for n in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    (tmp_path / "host.json").write_text(json.dumps(host.to_mapping()))
    assert load_profile(tmp_path / "host.json") == host
    assert "host_cores" not in own.to_mapping()


def test_oversubscription_cost_scales_the_engines_beyond_the_cores(tmp_path: Path) -> None:
    # 1 + cost * (engines - cores) / cores on 2 cores: cost 1 is the share of time (above).
    host = profile_from_mapping({**ROUND_DEVICE, "host_cores": 2, "oversubscription_cost": 2.6})
    assert [host.time_sharing(n) for n in (2, 3, 4)] == pytest.approx([1.0, 2.3, 3.6])
    assert host.with_overrides(oversubscription_cost=0).time_sharing(3) == 1.0
    (tmp_path / "host.json").write_text(json.dumps(host.to_mapping()))
    assert load_profile(tmp_path / "host.json") == host
    # Without host_cores nothing is shared, whatever the cost.
    own = profile_from_mapping({**ROUND_DEVICE, "oversubscription_cost": 2.6})
    assert own.time_sharing(3) == 1.0
    assert "oversubscription_cost" not in profile_from_mapping(ROUND_DEVICE).to_mapping()


@pytest.mark.parametrize(
    ("change", "field", "allowed"),
    [
        ({"memory_bandwidth": 0}, "memory_bandwidth", "> 0"),
        ({"memory_bandwidth": "fast"}, "memory_bandwidth", "> 0"),
        ({"link_latency": -1}, "link_latency", ">= 0"),
        ({"step_overhead": -1e-3}, "step_overhead", ">= 0"),
        ({"sequence_overhead": "slow"}, "sequence_overhead", ">= 0"),
        ({"compute_efficiency": 1.5}, "compute_efficiency", "(0, 1]"),
        ({"peak_flops": {"fp8": 1e15}}, "peak_flops.fp8", "a key among"),
        ({"peak_flops": {"int8": 1e15}}, "peak_flops", "bf16, fp16 or fp32"),
        ({"colour": "green"}, "colour", "a key among"),
        ({"name": ""}, "name", "non-empty"),
        ({"messages_use_compute": 1}, "messages_use_compute", "true or false"),
        ({"messages_use_compute": "yes"}, "messages_use_compute", "true or false"),
        ({"compute_overlaps_memory": 0}, "compute_overlaps_memory", "true or false"),
        ({"host_cores": -1}, "host_cores", "an integer >= 0"),
        ({"host_cores": 2.0}, "host_cores", "an integer >= 0"),
        ({"host_cores": True}, "host_cores", "an integer >= 0"),
        ({"oversubscription_cost": -0.5}, "oversubscription_cost", ">= 0"),
        ({"oversubscription_cost": "high"}, "oversubscription_cost", ">= 0"),
    ],
)
def test_bad_profile_field_is_named(change: dict[str, Any], field: str, allowed: str) -> None:
    with pytest.raises(AFDPlanError) as err:
        profile_from_mapping({**ROUND_DEVICE, **change}, origin="p.toml")
    assert err.value.field == f"p.toml:{field}" and allowed in err.value.allowed
    assert field in str(err.value)


def test_missing_required_field() -> None:
    data = dict(ROUND_DEVICE)
    del data["link_bandwidth"]
    with pytest.raises(AFDPlanError, match=r"'p.toml:link_bandwidth': got None; allowed: present"):
        profile_from_mapping(data, origin="p.toml")


def test_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(AFDPlanError, match="h100-sxm") as err:
        load_profile("tpu-v9")
    assert err.value.field == "hardware" and err.value.value == "tpu-v9"


def test_calibrated_profile_path() -> None:
    assert calibrated_profile_path({"XDG_CACHE_HOME": "/c"}) == Path("/c/afd/profile.json")
    assert calibrated_profile_path({}) == Path.home() / ".cache" / "afd" / "profile.json"
