"""The AFD configuration carried in vLLM's ``additional_config["afd"]``.

Invariants:
* :class:`AFDConfig` is frozen and always valid: ``__post_init__`` checks every field (strict types,
  ranges, ``ffn_rank < num_ffn_ranks`` on the FFN role, the gate on Attention when
  ``num_ffn_ranks > 1`` (expert parallelism), ``expert_dispatch`` fitting the FFN compute,
  connector known, able to serve the topology and its
  ``connector_extra_config`` accepted by that connector) and raises :class:`AFDConfigError` naming
  the field, the value and what is allowed.
* :meth:`AFDConfig.from_mapping` is the user-facing parser: unknown keys are rejected, afd-plugin
  aliases are accepted but an alias together with its canonical key is an error, and coercion is
  strict (``bool`` is never an int, ``float`` is never an int, ints are never booleans).
* :meth:`AFDConfig.agreement_hash` covers exactly the fields both roles must agree on (everything
  but :data:`LOCAL_FIELDS`: ``role``, ``ffn_rank``, the timeouts, ``ffn_compute`` and the expert
  quantization, each process's own choices; FFN ranks compare their quantization geometry in the
  connector handshake instead) and is stable across
  processes and Python versions.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from afd_core.errors import AFDConfigError

ConnectorCheck = Callable[[str, Mapping[str, Any]], Mapping[str, Any]]
"""``(connector name, connector_extra_config) -> normalised extra config``: raises
:class:`AFDConfigError` naming ``connector`` or ``connector_extra_config.<key>``."""

_CONNECTOR_CHECK: ConnectorCheck | None = None


def set_connector_check(check: ConnectorCheck) -> None:
    """Install the connector part of :class:`AFDConfig` validation. Called once by
    :mod:`afd_core.connector.factory` when it is imported (``import afd_core`` imports it), so
    that the config never imports the connector registry (no import cycle config <-> connector).
    Until it is installed, the connector name and extra config are only checked for shape."""
    global _CONNECTOR_CHECK
    _CONNECTOR_CHECK = check


__all__ = [
    "ADDITIONAL_CONFIG_FLAG",
    "AFD_ADDITIONAL_CONFIG_KEY",
    "CONFIG_ALIASES",
    "CONFIG_FIELDS",
    "CONNECTOR_NAME_ALIASES",
    "EXPERT_DISPATCH_KINDS",
    "EXPERT_QUANT_SCHEMES",
    "FFN_COMPUTE_KINDS",
    "LOCAL_FIELDS",
    "MAX_STAGES",
    "AFDConfig",
    "AFDConfigError",
    "AFDRole",
    "parse_additional_config_json",
    "parse_afd_config",
]

AFD_ADDITIONAL_CONFIG_KEY = "afd"
"""Key under vLLM's ``additional_config`` whose presence enables AFD."""

ADDITIONAL_CONFIG_FLAG = "--additional-config"
"""The ``vllm serve`` flag carrying ``additional_config`` as JSON text (the field named by
:func:`parse_additional_config_json`'s errors)."""

CONFIG_FIELDS: tuple[str, ...] = (
    "role",
    "connector",
    "host",
    "port",
    "num_attention_ranks",
    "num_ffn_ranks",
    "expert_replicas",
    "attention_tp_size",
    "ffn_rank",
    "compute_gate_on_attention",
    "num_stages",
    "timeout_s",
    "startup_timeout_s",
    "ffn_loss_grace_s",
    "ffn_compute",
    "expert_dispatch",
    "expert_quant",
    "expert_quant_group_size",
    "connector_extra_config",
)
"""Canonical keys accepted under ``additional_config["afd"]``."""

FFN_COMPUTE_KINDS: tuple[str, ...] = ("native", "layered", "mega")
"""Values of ``ffn_compute`` (how the FFN role computes its experts). ``native`` runs the model's
own vLLM ``FusedMoE``; ``layered`` / ``mega`` are afd-compute-npu's computes (the runtime says
which of them it can serve)."""

EXPERT_DISPATCH_KINDS: tuple[str, ...] = ("attention", "ffn")
"""Values of ``expert_dispatch`` (who sends a token to the FFN ranks holding its experts when
``num_ffn_ranks > 1``). ``attention``: each Attention peer sends a token to every FFN rank that
holds one of its top-k experts and adds their partial outputs. ``ffn``: each Attention peer sends
all of its tokens to one FFN rank (:meth:`afd_core.topology.AFDTopology.home_ffn_rank`), whose
compute dispatches them among the FFN ranks and combines them itself (afd-compute-npu's Mega,
``ffn_compute='mega'``: one fused collective over the FFN ranks' group), and gets each token's
whole output back from it. Both roles must agree."""

EXPERT_QUANT_SCHEMES: tuple[str, ...] = ("none", "w8a8", "w4a8")
"""Values of ``expert_quant`` (how the FFN role stores its routed experts): ``none`` keeps the
checkpoint's float experts (``ffn_compute='native'``); ``w8a8`` / ``w4a8`` quantize them at load
for afd-compute-npu's ``layered`` / ``mega`` computes (W4A8 per channel, or per group of
``expert_quant_group_size`` input rows when that is > 0)."""

LOCAL_FIELDS: tuple[str, ...] = (
    "role",
    "ffn_rank",
    "timeout_s",
    "startup_timeout_s",
    "ffn_loss_grace_s",
    "ffn_compute",
    "expert_quant",
    "expert_quant_group_size",
)
"""Fields each process may set on its own: excluded from :meth:`AFDConfig.agreement_hash`."""

CONFIG_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "afd_role": "role",
        "afd_connector": "connector",
        "afd_host": "host",
        "afd_port": "port",
    }
)
"""afd-plugin spellings accepted as aliases of canonical keys (never both at once)."""

CONNECTOR_NAME_ALIASES: Mapping[str, str] = MappingProxyType(
    {"P2pNcclAFDConnector": "p2p", "P2PConnector": "p2p"}
)
"""afd-plugin connector names mapped to afd-core registry names."""

_TRUE_STRINGS = frozenset({"true", "1", "yes", "on"})
_FALSE_STRINGS = frozenset({"false", "0", "no", "off"})
_MAX_RANKS = 65536

MAX_STAGES = 2
"""Largest ``num_stages``: the Attention role overlaps at most two micro-batches per step."""


class AFDRole(enum.StrEnum):
    """The role of a vLLM instance in an AFD deployment."""

    ATTENTION = "attention"
    FFN = "ffn"


# --------------------------------------------------------------------------------------------
# Strict coercion helpers (used by from_mapping; __post_init__ checks types without coercion).


def _coerce_role(value: Any) -> AFDRole:
    if isinstance(value, AFDRole):
        return value
    if isinstance(value, str):
        try:
            return AFDRole(value.strip().lower())
        except ValueError:
            pass
    raise AFDConfigError("role", value, "one of 'attention', 'ffn'")


def _coerce_int(name: str, value: Any) -> int:
    # bool is a subclass of int: reject it explicitly; floats (even 2.0) are rejected too.
    if isinstance(value, bool | float):
        raise AFDConfigError(name, value, "an integer (not bool, not float)")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text and (text.isdigit() or (text[0] in "+-" and text[1:].isdigit())):
            return int(text)
    raise AFDConfigError(name, value, "an integer or a decimal integer string")


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE_STRINGS:
            return True
        if text in _FALSE_STRINGS:
            return False
    raise AFDConfigError(
        name, value, "a boolean or one of the strings true/false/1/0/yes/no/on/off"
    )


def _coerce_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise AFDConfigError(name, value, "a number (not bool)")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise AFDConfigError(name, value, "a number or a numeric string")


def _coerce_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value.strip()
    raise AFDConfigError(name, value, "a string")


def _freeze_extra(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise AFDConfigError("connector_extra_config", value, "a mapping with string keys")
    for key in value:
        if not isinstance(key, str):
            raise AFDConfigError(
                "connector_extra_config", dict(value), "a mapping with string keys"
            )
    return MappingProxyType(dict(value))


def _json_default(value: Any) -> Any:
    raise TypeError(f"not JSON-serialisable: {value!r}")


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AFDConfig:
    """Typed, validated AFD configuration (see the README for the field table).

    Construct it with :meth:`from_mapping` (user input, coercing) or directly with exact types.
    Direct construction does not coerce: ``port="1239"`` is rejected, ``port=1239`` is accepted.
    """

    role: AFDRole
    connector: str = "p2p"
    host: str = "127.0.0.1"
    port: int = 1239
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    #: How many of the ``num_ffn_ranks`` FFN ranks hold each routed expert (R). With R > 1 the
    #: FFN ranks are slots of an elastic set: the Attention role serves with any live subset
    #: that holds every expert, re-forms the set when a rank is lost or joins, and routes each
    #: expert to one live holder (:meth:`afd_core.expert_map.ExpertMap.replicated`).
    expert_replicas: int = 1
    #: The Attention role's ``--tensor-parallel-size`` (T): each of its A data-parallel ranks
    #: runs T TP workers, and every TP worker is a peer of the FFN ranks (A x T peers).
    attention_tp_size: int = 1
    ffn_rank: int = 0
    compute_gate_on_attention: bool = False
    num_stages: int = 1
    timeout_s: float = 120.0
    startup_timeout_s: float = 300.0
    #: Attention role: how long requests are held (preempted, KV freed) while the FFN role is
    #: lost before they fail; 0 fails them at once.
    ffn_loss_grace_s: float = 60.0
    ffn_compute: str = "native"
    #: Who dispatches a token to the FFN ranks of its experts (:data:`EXPERT_DISPATCH_KINDS`).
    expert_dispatch: str = "attention"
    expert_quant: str = "none"
    expert_quant_group_size: int = 0
    connector_extra_config: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )

    def __post_init__(self) -> None:
        # role: an AFDRole, or its exact string value.
        if isinstance(self.role, AFDRole):
            role = self.role
        elif isinstance(self.role, str) and self.role in {r.value for r in AFDRole}:
            role = AFDRole(self.role)
        else:
            raise AFDConfigError("role", self.role, "one of 'attention', 'ffn'")
        object.__setattr__(self, "role", role)

        if not isinstance(self.connector, str) or not self.connector.strip():
            raise AFDConfigError("connector", self.connector, "a non-empty connector name")
        connector = CONNECTOR_NAME_ALIASES.get(self.connector, self.connector)
        object.__setattr__(self, "connector", connector)

        if not isinstance(self.host, str) or not self.host or self.host != self.host.strip():
            raise AFDConfigError(
                "host", self.host, "a non-empty host name or IP address without whitespace"
            )
        if any(ch.isspace() for ch in self.host):
            raise AFDConfigError(
                "host", self.host, "a non-empty host name or IP address without whitespace"
            )

        self._check_int("port", self.port, 1, 65535)
        self._check_int("num_attention_ranks", self.num_attention_ranks, 1, _MAX_RANKS)
        self._check_int("num_ffn_ranks", self.num_ffn_ranks, 1, _MAX_RANKS)
        self._check_int("attention_tp_size", self.attention_tp_size, 1, _MAX_RANKS)
        if (
            isinstance(self.expert_replicas, bool)
            or not isinstance(self.expert_replicas, int)
            or not 1 <= self.expert_replicas <= self.num_ffn_ranks
        ):
            raise AFDConfigError(
                "expert_replicas",
                self.expert_replicas,
                f"an integer in 1..{self.num_ffn_ranks} (num_ffn_ranks: each routed expert "
                "lives on that many FFN ranks, at most all of them)",
            )
        if self.num_attention_ranks * self.attention_tp_size > _MAX_RANKS:
            raise AFDConfigError(
                "attention_tp_size",
                self.attention_tp_size,
                f"at most {_MAX_RANKS // self.num_attention_ranks} with "
                f"num_attention_ranks={self.num_attention_ranks} (at most {_MAX_RANKS} Attention "
                "peers: data-parallel ranks x TP size)",
            )
        if not isinstance(self.compute_gate_on_attention, bool):
            raise AFDConfigError(
                "compute_gate_on_attention", self.compute_gate_on_attention, "a bool"
            )
        if self.num_ffn_ranks > 1 and not self.compute_gate_on_attention:
            # Expert parallelism dispatches each token to the FFN ranks holding its top-k
            # experts, so the routing must be known where the tokens are: on Attention.
            raise AFDConfigError(
                "compute_gate_on_attention",
                False,
                f"true when num_ffn_ranks={self.num_ffn_ranks} > 1 (the FFN ranks hold disjoint "
                "expert ranges; the Attention role routes each token to the ranks of its top-k "
                "experts, so the gate must run there)",
            )
        # Two-stage overlap (DBO): the Attention role splits a step into two micro-batches and
        # hides one's FFN round trip behind the other's attention. Both roles must agree.
        self._check_int("num_stages", self.num_stages, 1, MAX_STAGES)
        if self.role is AFDRole.FFN:
            self._check_int("ffn_rank", self.ffn_rank, 0, self.num_ffn_ranks - 1)
        elif self.ffn_rank != 0 or isinstance(self.ffn_rank, bool):
            raise AFDConfigError(
                "ffn_rank", self.ffn_rank, "0 or absent on the Attention role (an FFN-role field)"
            )
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not math.isfinite(self.timeout_s)
            or self.timeout_s <= 0
        ):
            raise AFDConfigError("timeout_s", self.timeout_s, "a finite number of seconds > 0")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        if (
            isinstance(self.startup_timeout_s, bool)
            or not isinstance(self.startup_timeout_s, int | float)
            or not math.isfinite(self.startup_timeout_s)
            or self.startup_timeout_s <= 0
        ):
            raise AFDConfigError(
                "startup_timeout_s", self.startup_timeout_s, "a finite number of seconds > 0"
            )
        object.__setattr__(self, "startup_timeout_s", float(self.startup_timeout_s))
        if (
            isinstance(self.ffn_loss_grace_s, bool)
            or not isinstance(self.ffn_loss_grace_s, int | float)
            or not math.isfinite(self.ffn_loss_grace_s)
            or self.ffn_loss_grace_s < 0
        ):
            raise AFDConfigError(
                "ffn_loss_grace_s",
                self.ffn_loss_grace_s,
                "a finite number of seconds >= 0 (0: fail held requests at once)",
            )
        object.__setattr__(self, "ffn_loss_grace_s", float(self.ffn_loss_grace_s))
        if self.ffn_compute not in FFN_COMPUTE_KINDS:
            raise AFDConfigError(
                "ffn_compute", self.ffn_compute, f"one of {list(FFN_COMPUTE_KINDS)}"
            )
        if self.expert_quant not in EXPERT_QUANT_SCHEMES:
            raise AFDConfigError(
                "expert_quant", self.expert_quant, f"one of {list(EXPERT_QUANT_SCHEMES)}"
            )
        if self.ffn_compute == "native" and self.expert_quant != "none":
            raise AFDConfigError(
                "expert_quant",
                self.expert_quant,
                "'none' with ffn_compute='native' (vLLM's FusedMoE computes the float experts); "
                "quantized experts need ffn_compute 'layered' or 'mega'",
            )
        if self.ffn_compute != "native" and self.expert_quant == "none":
            raise AFDConfigError(
                "ffn_compute",
                self.ffn_compute,
                f"'native' with expert_quant='none' ({self.ffn_compute!r} computes quantized "
                "experts: set expert_quant to 'w8a8' or 'w4a8')",
            )
        self._check_expert_dispatch()
        self._check_int("expert_quant_group_size", self.expert_quant_group_size, 0, 1 << 20)
        if self.expert_quant_group_size and self.expert_quant != "w4a8":
            raise AFDConfigError(
                "expert_quant_group_size",
                self.expert_quant_group_size,
                f"0 with expert_quant={self.expert_quant!r} (groups exist for 'w4a8' only)",
            )

        extra = _freeze_extra(self.connector_extra_config)
        # The selected connector owns (and validates) its extra config; the connector factory
        # installs that check (see set_connector_check): this module imports no connector code.
        check = _CONNECTOR_CHECK
        normalized = extra if check is None else check(connector, extra)
        object.__setattr__(self, "connector_extra_config", MappingProxyType(dict(normalized)))

    def _check_expert_dispatch(self) -> None:
        """``expert_dispatch`` against the FFN compute and the expert placement (``ffn_compute``
        is an FFN-role field: the Attention role's own value is not checked against it)."""
        value = self.expert_dispatch
        if value not in EXPERT_DISPATCH_KINDS:
            raise AFDConfigError("expert_dispatch", value, f"one of {list(EXPERT_DISPATCH_KINDS)}")
        is_ffn = self.role is AFDRole.FFN
        if value == "ffn":
            if is_ffn and self.ffn_compute != "mega":
                raise AFDConfigError(
                    "expert_dispatch",
                    value,
                    f"'attention' with ffn_compute={self.ffn_compute!r} (only 'mega' dispatches "
                    "tokens among the FFN ranks itself)",
                )
            if self.expert_replicas > 1:
                raise AFDConfigError(
                    "expert_dispatch",
                    value,
                    f"'attention' with expert_replicas={self.expert_replicas} (Mega's fused "
                    "dispatch places each expert on exactly one FFN rank)",
                )
        elif is_ffn and self.ffn_compute == "mega" and self.num_ffn_ranks > 1:
            raise AFDConfigError(
                "expert_dispatch",
                value,
                f"'ffn' with ffn_compute='mega' and num_ffn_ranks={self.num_ffn_ranks} (Mega "
                "dispatches the tokens among the FFN ranks itself: each Attention rank sends its "
                "tokens to one FFN rank; set expert_dispatch='ffn' on every role)",
            )

    @staticmethod
    def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise AFDConfigError(name, value, f"an integer in {lo}..{hi} (not bool, not float)")
        if not lo <= value <= hi:
            raise AFDConfigError(name, value, f"an integer in {lo}..{hi}")

    # ----------------------------------------------------------------------------------------

    @property
    def is_attention(self) -> bool:
        """True for the Attention role."""
        return self.role is AFDRole.ATTENTION

    @property
    def is_ffn(self) -> bool:
        """True for the FFN role."""
        return self.role is AFDRole.FFN

    @property
    def needs_ffn_group(self) -> bool:
        """True on an FFN rank whose compute is a collective over the FFN ranks (Mega's fused
        dispatch and combine): its connector opens a process group of the FFN ranks for it
        (:meth:`afd_core.connector.AFDConnectorBase.ffn_process_group`)."""
        return self.role is AFDRole.FFN and self.ffn_compute == "mega"

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> AFDConfig:
        """Parse the user-facing mapping (the value of ``additional_config["afd"]``).

        Raises:
            AFDConfigError: not a mapping, unknown key, alias conflict, missing ``role``, or any
                invalid value (the error names the field).
        """
        if not isinstance(raw, Mapping):
            raise AFDConfigError(AFD_ADDITIONAL_CONFIG_KEY, raw, "a mapping of AFD config fields")
        canonical: dict[str, Any] = {}
        source_key: dict[str, str] = {}
        for key, value in raw.items():
            if not isinstance(key, str):
                raise AFDConfigError(str(key), value, f"keys among {list(CONFIG_FIELDS)}")
            name = CONFIG_ALIASES.get(key, key)
            if name not in CONFIG_FIELDS:
                raise AFDConfigError(
                    key,
                    value,
                    f"known keys {list(CONFIG_FIELDS)} (aliases {dict(CONFIG_ALIASES)}); "
                    "connector-specific values go under 'connector_extra_config'",
                    detail="unknown AFD config key",
                )
            if name in canonical:
                raise AFDConfigError(
                    name,
                    value,
                    "exactly one of the canonical key and its alias",
                    detail=f"both {source_key[name]!r} and {key!r} were given",
                )
            canonical[name] = value
            source_key[name] = key
        if "role" not in canonical:
            raise AFDConfigError("role", None, "one of 'attention', 'ffn' (required)")

        kwargs: dict[str, Any] = {"role": _coerce_role(canonical["role"])}
        if "connector" in canonical:
            kwargs["connector"] = _coerce_str("connector", canonical["connector"])
        if "host" in canonical:
            kwargs["host"] = _coerce_str("host", canonical["host"])
        for name in (
            "port",
            "num_attention_ranks",
            "num_ffn_ranks",
            "expert_replicas",
            "attention_tp_size",
            "ffn_rank",
            "num_stages",
            "expert_quant_group_size",
        ):
            if name in canonical:
                kwargs[name] = _coerce_int(name, canonical[name])
        if "compute_gate_on_attention" in canonical:
            kwargs["compute_gate_on_attention"] = _coerce_bool(
                "compute_gate_on_attention", canonical["compute_gate_on_attention"]
            )
        for name in ("timeout_s", "startup_timeout_s", "ffn_loss_grace_s"):
            if name in canonical:
                kwargs[name] = _coerce_float(name, canonical[name])
        if "ffn_compute" in canonical:
            kwargs["ffn_compute"] = _coerce_str("ffn_compute", canonical["ffn_compute"]).lower()
        if "expert_dispatch" in canonical:
            kwargs["expert_dispatch"] = _coerce_str(
                "expert_dispatch", canonical["expert_dispatch"]
            ).lower()
        if "expert_quant" in canonical:
            kwargs["expert_quant"] = _coerce_str("expert_quant", canonical["expert_quant"]).lower()
        if "connector_extra_config" in canonical:
            extra = canonical["connector_extra_config"]
            kwargs["connector_extra_config"] = {} if extra is None else _freeze_extra(extra)
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, Any]:
        """The canonical mapping; ``from_mapping(c.to_mapping()) == c``."""
        return {
            "role": self.role.value,
            "connector": self.connector,
            "host": self.host,
            "port": self.port,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "expert_replicas": self.expert_replicas,
            "attention_tp_size": self.attention_tp_size,
            "ffn_rank": self.ffn_rank,
            "compute_gate_on_attention": self.compute_gate_on_attention,
            "num_stages": self.num_stages,
            "timeout_s": self.timeout_s,
            "startup_timeout_s": self.startup_timeout_s,
            "ffn_loss_grace_s": self.ffn_loss_grace_s,
            "ffn_compute": self.ffn_compute,
            "expert_dispatch": self.expert_dispatch,
            "expert_quant": self.expert_quant,
            "expert_quant_group_size": self.expert_quant_group_size,
            "connector_extra_config": dict(self.connector_extra_config),
        }

    def agreement_fields(self) -> dict[str, Any]:
        """The fields both roles must agree on: all but :data:`LOCAL_FIELDS`."""
        return {k: v for k, v in self.to_mapping().items() if k not in LOCAL_FIELDS}

    def agreement_hash(self) -> str:
        """SHA-256 (hex) of :meth:`agreement_fields` as canonical JSON (sorted keys)."""
        text = json.dumps(
            self.agreement_fields(),
            sort_keys=True,
            separators=(",", ":"),
            default=_json_default,
        )
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


#: Characters of the raw text shown on each side of a JSON syntax error.
_JSON_CONTEXT_CHARS = 24


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def parse_additional_config_json(text: str) -> dict[str, Any]:
    """Parse the raw text of ``--additional-config`` into the ``additional_config`` mapping.

    Nothing else is validated here (the ``afd`` value is :func:`parse_afd_config`'s job); this
    only turns text into a mapping, so that a user's typo is reported as the flag's error
    instead of whatever the consumer of the string says later.

    Raises:
        AFDConfigError: ``field`` is :data:`ADDITIONAL_CONFIG_FLAG` and ``value`` the text, when
            the text is not JSON (the message gives the line, column and the text around the
            position where parsing stopped), is JSON but not an object, or repeats a key within
            one object (JSON parsers keep the last silently).
    """
    if not isinstance(text, str):
        raise AFDConfigError(ADDITIONAL_CONFIG_FLAG, text, "JSON text (a str)")
    try:
        value = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except _DuplicateKeyError as e:
        raise AFDConfigError(
            ADDITIONAL_CONFIG_FLAG,
            text,
            "a JSON object whose keys are unique within each object",
            detail=f"key {e.key!r} appears twice in one object; JSON parsers keep the last",
        ) from None
    except json.JSONDecodeError as e:
        before = text[max(e.pos - _JSON_CONTEXT_CHARS, 0) : e.pos]
        after = text[e.pos : e.pos + _JSON_CONTEXT_CHARS]
        raise AFDConfigError(
            ADDITIONAL_CONFIG_FLAG,
            text,
            'a JSON object, e.g. \'{"afd": {"role": "attention", "port": 29700}}\'',
            detail=f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
            f"(char {e.pos}): {before!r} <-- here --> {after!r}",
        ) from None
    if not isinstance(value, dict):
        raise AFDConfigError(
            ADDITIONAL_CONFIG_FLAG,
            text,
            'a JSON object, e.g. \'{"afd": {"role": "attention", "port": 29700}}\'',
            detail=f"the JSON is a {type(value).__name__}, not an object",
        )
    return value


def parse_afd_config(additional_config: Any) -> AFDConfig | None:
    """Parse ``additional_config["afd"]``; ``None`` when AFD is not configured.

    Args:
        additional_config: vLLM's ``additional_config`` mapping, ``None``, the raw
            ``--additional-config`` JSON text (see :func:`parse_additional_config_json`), or an
            object with an ``additional_config`` attribute (e.g. a ``VllmConfig``).

    Raises:
        AFDConfigError: ``additional_config`` is not a mapping (or JSON text of one), or the
            ``afd`` value is invalid.
    """
    if (
        additional_config is not None
        and not isinstance(additional_config, Mapping | str)
        and hasattr(additional_config, "additional_config")
    ):
        additional_config = additional_config.additional_config
    if isinstance(additional_config, str):
        additional_config = parse_additional_config_json(additional_config)
    if additional_config is not None and not isinstance(additional_config, Mapping):
        raise AFDConfigError(
            "additional_config",
            additional_config,
            "a mapping, JSON object text, None, or a VllmConfig",
        )
    if additional_config is None:
        return None
    if AFD_ADDITIONAL_CONFIG_KEY not in additional_config:
        return None
    return AFDConfig.from_mapping(additional_config[AFD_ADDITIONAL_CONFIG_KEY])
