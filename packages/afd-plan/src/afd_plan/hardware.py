"""Hardware profiles: what one device (an Attention rank's or an FFN rank's) can do.

A profile is a small TOML or JSON file (the same keys in both). Every key, its unit and what is
allowed (:func:`load_profile` refuses an unknown key, a missing required key or a value out of
range, naming the key, the value and what is allowed):

=========================  ======================================================  ==========
key                        meaning                                                 allowed
=========================  ======================================================  ==========
``name``                   short name (``afd plan --hardware NAME``)               non-empty
``source``                 where the figures come from (spec sheet, measurement)   non-empty
``peak_flops``             table: dense peak FLOP/s per compute dtype, keys of     > 0
                           :data:`COMPUTE_DTYPES` (``bf16``, ``fp16``, ``fp32``,
                           ``int8``); at least ``bf16`` or ``fp32``
``memory_bandwidth``       device memory bandwidth, bytes/s                        > 0
``memory_bytes``           device memory, bytes                                    > 0
``link_bandwidth``         device-to-device bandwidth per direction, bytes/s       > 0
``link_latency``           one-way latency of one message on the link, s           >= 0
``message_overhead``       software cost per message (post, completion), s         >= 0
``compute_efficiency``     achieved / peak FLOP/s (default 1)                      (0, 1]
``memory_efficiency``      achieved / peak memory bandwidth (default 1)            (0, 1]
``link_efficiency``        achieved / peak link bandwidth (default 1)              (0, 1]
``kv_efficiency``          achieved / peak bandwidth on KV-cache and DSA indexer   (0, 1]
                           reads (default: ``memory_efficiency``)
``memory_usable_fraction`` share of ``memory_bytes`` for weights + KV (default 0.9) (0, 1]
``layer_overhead``         fixed time per layer per role step (launch, sync), s   >= 0
                           (default 0)
``step_overhead``          fixed software time per decode step of the serving      >= 0
                           engine (scheduling, input preparation, sampling), s
                           (default 0)
``sequence_overhead``      software time per sequence per decode step (sampling,   >= 0
                           output processing, streaming), s (default 0)
``messages_use_compute``   a message's software cost runs on the role's own        true/false
                           compute (a CPU host: the cores that compute also post
                           and complete messages), so stages cannot hide it
                           (default false: a host CPU posts, the device computes)
``compute_overlaps_memory`` a kernel streams its weights while it computes, so a     true/false
                           roofline term takes the slower of the two (default
                           true); false (one CPU core: streaming and arithmetic
                           share it) adds them
``host_cores``             the cores every role's engine shares (a CPU host where  int >= 0
                           all roles run on one machine): a deployment with more
                           engines than cores stretches every step
                           (:meth:`HardwareProfile.time_sharing`; default 0: each
                           role on its own device)
``oversubscription_cost``  with ``host_cores``: the stretch is                     >= 0
                           ``1 + cost * (engines - host_cores) / host_cores``
                           (default 1: ``engines / host_cores``, each engine's
                           share of time; ``afd bench --profile`` measures it,
                           a woken engine's wait for a core included)
``description``            free text (optional)                                    any string
=========================  ======================================================  ==========

Shipped profiles (``afd_plan/profiles/*.toml``, listed by :func:`shipped_profiles`) hold public
specification figures; the efficiency factors and per-message costs in them are assumptions,
marked as such in each file's ``source``.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Final

from afd_plan.errors import AFDPlanError

__all__ = [
    "CALIBRATED_PROFILE_NAME",
    "COMPUTE_DTYPES",
    "DEFAULT_PROFILE",
    "HardwareProfile",
    "calibrated_profile_path",
    "load_profile",
    "profile_from_mapping",
    "shipped_profiles",
]

COMPUTE_DTYPES: Final[tuple[str, ...]] = ("bf16", "fp16", "fp32", "int8")
#: The shipped profile ``afd plan`` falls back to when no calibrated profile exists.
DEFAULT_PROFILE: Final[str] = "h100-sxm"
#: Where a calibrated profile of this host lives (written by afd-models' ``afd bench --profile``):
#: ``$XDG_CACHE_HOME/afd/profile.json``, ``~/.cache/afd/profile.json`` without it.
CALIBRATED_PROFILE_NAME: Final[str] = "afd/profile.json"


def calibrated_profile_path(env: Mapping[str, str] | None = None) -> Path:
    """The documented path of this host's calibrated profile (it may not exist)."""
    env = os.environ if env is None else env
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / CALIBRATED_PROFILE_NAME


_REQUIRED: Final[tuple[str, ...]] = (
    "name",
    "source",
    "peak_flops",
    "memory_bandwidth",
    "memory_bytes",
    "link_bandwidth",
    "link_latency",
    "message_overhead",
)
_OPTIONAL: Final[dict[str, float]] = {
    "compute_efficiency": 1.0,
    "memory_efficiency": 1.0,
    "link_efficiency": 1.0,
    "memory_usable_fraction": 0.9,
    "layer_overhead": 0.0,
    "step_overhead": 0.0,
    "sequence_overhead": 0.0,
    "kv_efficiency": 0.0,
    "oversubscription_cost": 1.0,
}
#: Optional keys that are any finite number >= 0 (the others are fractions in (0, 1]).
_NON_NEGATIVE: Final[frozenset[str]] = frozenset(
    {"layer_overhead", "step_overhead", "sequence_overhead", "oversubscription_cost"}
)


@dataclass(frozen=True)
class HardwareProfile:
    """One device's costs (see the module docstring for units and ranges).

    The effective rates the cost model uses are ``peak * efficiency``: :meth:`flops` and
    :attr:`bandwidth`, :attr:`link_rate`; :attr:`usable_memory` is
    ``memory_bytes * memory_usable_fraction``.
    """

    name: str
    source: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth: float
    memory_bytes: float
    link_bandwidth: float
    link_latency: float
    message_overhead: float
    compute_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    link_efficiency: float = 1.0
    memory_usable_fraction: float = 0.9
    layer_overhead: float = 0.0
    step_overhead: float = 0.0
    sequence_overhead: float = 0.0
    kv_efficiency: float = 0.0
    messages_use_compute: bool = False
    compute_overlaps_memory: bool = True
    host_cores: int = 0
    oversubscription_cost: float = 1.0
    description: str = ""

    def flops(self, dtype: str) -> float:
        """Effective FLOP/s for GEMMs in ``dtype``: the peak times ``compute_efficiency``.

        ``bf16`` falls back to ``fp16`` then ``fp32``; ``int8`` falls back to the ``bf16`` chain
        (a device without integer units computes W8A8 in floating point)."""
        chain = {
            "int8": ("int8", "bf16", "fp16", "fp32"),
            "bf16": ("bf16", "fp16", "fp32"),
            "fp16": ("fp16", "bf16", "fp32"),
            "fp32": ("fp32", "bf16", "fp16"),
        }[dtype]
        for d in chain:
            if d in self.peak_flops:
                return self.peak_flops[d] * self.compute_efficiency
        raise AFDPlanError("peak_flops", dict(self.peak_flops), f"a rate for {dtype}")

    @property
    def bandwidth(self) -> float:
        """Effective memory bandwidth, bytes/s."""
        return self.memory_bandwidth * self.memory_efficiency

    @property
    def kv_bandwidth(self) -> float:
        """Effective bandwidth of KV-cache reads, bytes/s (``kv_efficiency``, else
        ``memory_efficiency``, times the peak)."""
        return self.memory_bandwidth * (self.kv_efficiency or self.memory_efficiency)

    @property
    def link_rate(self) -> float:
        """Effective link bandwidth per direction, bytes/s."""
        return self.link_bandwidth * self.link_efficiency

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.memory_usable_fraction

    def with_overrides(self, **changes: float | bool) -> HardwareProfile:
        """A copy with some fields replaced, validated like a loaded profile."""
        data = self.to_mapping()
        data.update(changes)
        return profile_from_mapping(data, origin=f"{self.name} (overridden)")

    def to_mapping(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "description": self.description,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "memory_bytes": self.memory_bytes,
            "link_bandwidth": self.link_bandwidth,
            "link_latency": self.link_latency,
            "message_overhead": self.message_overhead,
            "compute_efficiency": self.compute_efficiency,
            "memory_efficiency": self.memory_efficiency,
            "link_efficiency": self.link_efficiency,
            "memory_usable_fraction": self.memory_usable_fraction,
            "layer_overhead": self.layer_overhead,
            "step_overhead": self.step_overhead,
            "sequence_overhead": self.sequence_overhead,
            **({"kv_efficiency": self.kv_efficiency} if self.kv_efficiency else {}),
            **({"messages_use_compute": True} if self.messages_use_compute else {}),
            **({} if self.compute_overlaps_memory else {"compute_overlaps_memory": False}),
            **({"host_cores": self.host_cores} if self.host_cores else {}),
            **(
                {"oversubscription_cost": self.oversubscription_cost}
                if self.oversubscription_cost != 1.0
                else {}
            ),
        }

    def time_sharing(self, engines: int) -> float:
        """How much a deployment of ``engines`` engine processes stretches on a shared host:
        ``1 + oversubscription_cost * (engines - host_cores) / host_cores`` when they outnumber
        its cores, else 1 (always 1 with ``host_cores`` 0). With the default cost 1 that is
        ``engines / host_cores``: each engine runs about ``host_cores / engines`` of the time.
        A woken engine (a message arrived) also waits for a core, which the share of time does
        not hold: on the calibration host three engines on two cores measured 1.4-2.3x the 1:1
        pair's step from one run to the next, so ``afd bench --profile`` measures the cost."""
        if self.host_cores <= 0 or engines <= self.host_cores:
            return 1.0
        return 1.0 + self.oversubscription_cost * (engines - self.host_cores) / self.host_cores


def shipped_profiles() -> dict[str, Path]:
    """Shipped profile names -> their files (``afd_plan/profiles/<name>.toml``)."""
    root = resources.files("afd_plan") / "profiles"
    return {Path(str(p)).stem: Path(str(p)) for p in root.iterdir() if str(p).endswith(".toml")}


def load_profile(spec: str | Path) -> HardwareProfile:
    """A profile from a file path (``.toml`` or ``.json``) or a shipped profile's name."""
    p = Path(spec)
    if not p.is_file():
        shipped = shipped_profiles()
        if str(spec) not in shipped:
            raise AFDPlanError(
                "hardware",
                str(spec),
                f"a profile file (.toml or .json) or one of {', '.join(sorted(shipped))}",
            )
        p = shipped[str(spec)]
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AFDPlanError(
            "hardware", str(p), "a readable TOML or JSON profile", detail=str(e)
        ) from e
    if not isinstance(data, dict):
        raise AFDPlanError("hardware", str(p), "a TOML table or JSON object")
    return profile_from_mapping(data, origin=str(p))


def profile_from_mapping(data: Mapping[str, Any], *, origin: str = "profile") -> HardwareProfile:
    """Validate a parsed profile; every error names ``<origin>:<key>``, the value and the range."""
    flags = ("messages_use_compute", "compute_overlaps_memory")
    allowed_keys = {*_REQUIRED, *_OPTIONAL, "description", *flags, "host_cores"}
    for key in data:
        if key not in allowed_keys:
            raise AFDPlanError(f"{origin}:{key}", data[key], f"a key among {sorted(allowed_keys)}")
    for key in _REQUIRED:
        if key not in data:
            raise AFDPlanError(f"{origin}:{key}", None, "present (required)")
    for key in ("name", "source"):
        if not isinstance(data[key], str) or not data[key].strip():
            raise AFDPlanError(f"{origin}:{key}", data[key], "a non-empty string")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise AFDPlanError(f"{origin}:description", description, "a string")
    on_compute = data.get("messages_use_compute", False)
    overlaps = data.get("compute_overlaps_memory", True)
    for key, flag in zip(flags, (on_compute, overlaps), strict=True):
        if not isinstance(flag, bool):
            raise AFDPlanError(f"{origin}:{key}", flag, "true or false")
    cores = data.get("host_cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
        raise AFDPlanError(f"{origin}:host_cores", cores, "an integer >= 0 (0: own devices)")
    peaks = data["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise AFDPlanError(f"{origin}:peak_flops", peaks, f"a table keyed by {COMPUTE_DTYPES}")
    checked_peaks: dict[str, float] = {}
    for dtype, rate in peaks.items():
        if dtype not in COMPUTE_DTYPES:
            raise AFDPlanError(
                f"{origin}:peak_flops.{dtype}", rate, f"a key among {COMPUTE_DTYPES}"
            )
        checked_peaks[dtype] = _number(f"{origin}:peak_flops.{dtype}", rate, positive=True)
    if not {"bf16", "fp16", "fp32"} & checked_peaks.keys():
        raise AFDPlanError(f"{origin}:peak_flops", dict(peaks), "a rate for bf16, fp16 or fp32")
    values: dict[str, float] = {}
    for key in ("memory_bandwidth", "memory_bytes", "link_bandwidth"):
        values[key] = _number(f"{origin}:{key}", data[key], positive=True)
    for key in ("link_latency", "message_overhead"):
        values[key] = _number(f"{origin}:{key}", data[key], positive=False)
    for key, default in _OPTIONAL.items():
        raw = data.get(key, default)
        if key in _NON_NEGATIVE:
            values[key] = _number(f"{origin}:{key}", raw, positive=False)
        elif key == "kv_efficiency" and key not in data:
            values[key] = 0.0
        else:
            values[key] = _fraction(f"{origin}:{key}", raw)
    return HardwareProfile(
        name=data["name"],
        source=data["source"],
        description=description,
        messages_use_compute=on_compute,
        compute_overlaps_memory=overlaps,
        host_cores=cores,
        peak_flops=checked_peaks,
        **values,
    )


def _number(name: str, value: Any, *, positive: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise AFDPlanError(
            name, value, "a finite number > 0" if positive else "a finite number >= 0"
        )
    return float(value)


def _fraction(name: str, value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0 < value <= 1:
        raise AFDPlanError(name, value, "a number in (0, 1]")
    return float(value)
