"""Typed transfer metadata, payloads, the payload wire spec and the control message codec.

Invariants:
* :class:`AFDTransferMetadata` token counts are non-negative ints, one per peer: on the Attention
  side exactly one (its own tokens), on the FFN side one per served Attention rank, in the order of
  :meth:`AFDTopology.attention_ranks_for`. A count of 0 means nothing moves on the wire for that
  peer (both sides know the count from the control plane).
* :class:`AFDPayload` fields are tensors whose first dimension is the token count; optional fields
  are ``None``. Wire order of the fields is :data:`PAYLOAD_FIELDS`.
* :class:`AFDPayloadSpec` fixes, for a connector's lifetime, which fields travel and each field's
  width and dtype; both roles must agree (exchanged in the connector handshake). A payload is
  checked against the spec before any byte is sent.
* :class:`AFDControlMessage` encodes to a 1-D ``int64`` CPU tensor with a magic number and a
  protocol version; :meth:`AFDControlMessage.decode` rejects anything else with
  :class:`AFDProtocolError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_core.errors import AFDPayloadError, AFDProtocolError

__all__ = [
    "CONTROL_MAGIC",
    "CONTROL_VERSION",
    "PAYLOAD_FIELDS",
    "AFDControlMessage",
    "AFDFieldSpec",
    "AFDPayload",
    "AFDPayloadSpec",
    "AFDTransferMetadata",
    "dtype_from_name",
    "dtype_name",
]

PAYLOAD_FIELDS: tuple[str, ...] = (
    "hidden_states",
    "router_logits",
    "topk_ids",
    "topk_weights",
    "input_ids",
)
"""Every payload field, in wire order."""

CONTROL_MAGIC = 0x0AFDC7
"""First word of every encoded control message."""

CONTROL_VERSION = 1
"""Version of the control message wire format (bumped on any layout change)."""

_FLAG_WARMUP = 1
_FLAG_CAPTURE = 2
_FLAG_SHUTDOWN = 4
_FLAG_DRAFT = 8
_KNOWN_FLAGS = _FLAG_WARMUP | _FLAG_CAPTURE | _FLAG_SHUTDOWN | _FLAG_DRAFT
_HEADER_WORDS = 5  # magic, version, flags, num_stages, width

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """Stable wire name of a dtype (e.g. ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` for the dtypes AFD transfers."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise AFDPayloadError("dtype", name, f"one of {sorted(_DTYPES)}") from None


def _is_count(value: Any) -> bool:
    if type(value) is int:  # the common case first (hot path: once per transfer)
        return value >= 0
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class AFDTransferMetadata:
    """Which transfer this is: layer, stage (micro-batch) and token count per peer."""

    layer_idx: int
    stage_idx: int
    num_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not _is_count(self.layer_idx):
            raise AFDPayloadError("layer_idx", self.layer_idx, "a non-negative int")
        if not _is_count(self.stage_idx):
            raise AFDPayloadError("stage_idx", self.stage_idx, "a non-negative int")
        counts = self.num_tokens
        if isinstance(counts, list):
            counts = tuple(counts)
            object.__setattr__(self, "num_tokens", counts)
        if not isinstance(counts, tuple) or not counts or not all(map(_is_count, counts)):
            raise AFDPayloadError(
                "num_tokens", self.num_tokens, "a non-empty tuple of non-negative ints"
            )

    @classmethod
    def _of_counts(
        cls, layer_idx: int, stage_idx: int, num_tokens: tuple[int, ...]
    ) -> AFDTransferMetadata:
        """``cls(layer_idx, stage_idx, num_tokens)`` for counts and a stage index already
        validated (a control message's): only ``layer_idx`` is checked (hot path: once per
        transfer, on the FFN side's path from a receive's completion to the next posting)."""
        if not _is_count(layer_idx):
            raise AFDPayloadError("layer_idx", layer_idx, "a non-negative int")
        meta = object.__new__(cls)
        object.__setattr__(meta, "layer_idx", layer_idx)
        object.__setattr__(meta, "stage_idx", stage_idx)
        object.__setattr__(meta, "num_tokens", num_tokens)
        return meta

    @property
    def total_tokens(self) -> int:
        """Sum of :attr:`num_tokens`."""
        return sum(self.num_tokens)


@dataclass(frozen=True, eq=False)
class AFDPayload:
    """What one Attention rank sends to its FFN rank for one layer and stage.

    ``hidden_states`` is ``[tokens, hidden]``; ``router_logits`` ``[tokens, num_experts]``;
    ``topk_ids`` / ``topk_weights`` ``[tokens, top_k]``; ``input_ids`` ``[tokens]``.
    """

    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (  # the common case first (hot path: once per transfer)
            self.router_logits is None
            and self.topk_ids is None
            and self.topk_weights is None
            and self.input_ids is None
            and isinstance(self.hidden_states, torch.Tensor)
        ):
            return
        for name in PAYLOAD_FIELDS:
            value = getattr(self, name)
            if value is None and name != "hidden_states":
                continue
            if not isinstance(value, torch.Tensor):
                raise AFDPayloadError(name, type(value).__name__, "a torch.Tensor")

    @classmethod
    def _of_hidden_states(cls, hidden_states: torch.Tensor) -> AFDPayload:
        """``AFDPayload(hidden_states)`` for a tensor a connector just allocated (a receive
        buffer): the same object, without the dataclass ``__init__`` and ``__post_init__``
        (hot path: once per received transfer). The other fields read their ``None`` defaults
        from the class."""
        payload = object.__new__(cls)
        object.__setattr__(payload, "hidden_states", hidden_states)
        return payload

    @property
    def present_fields(self) -> tuple[str, ...]:
        """Names of the non-``None`` fields, in wire order."""
        return tuple(n for n in PAYLOAD_FIELDS if getattr(self, n) is not None)

    @property
    def num_tokens(self) -> int:
        """First dimension of ``hidden_states``."""
        return int(self.hidden_states.shape[0]) if self.hidden_states.dim() > 0 else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present fields by name, in wire order."""
        return {n: t for n in PAYLOAD_FIELDS if (t := getattr(self, n)) is not None}


@dataclass(frozen=True)
class AFDFieldSpec:
    """Wire description of one payload field: ``[tokens, width]`` (or ``[tokens]``) of ``dtype``."""

    name: str
    width: int | None
    dtype: torch.dtype

    def shape(self, num_tokens: int) -> tuple[int, ...]:
        """The tensor shape for ``num_tokens`` tokens."""
        return (num_tokens,) if self.width is None else (num_tokens, self.width)


def _check_width(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AFDPayloadError(name, value, "a positive int")


def _check_dtype(name: str, value: Any) -> None:
    if not isinstance(value, torch.dtype):
        raise AFDPayloadError(name, value, "a torch.dtype")


@dataclass(frozen=True)
class AFDPayloadSpec:
    """The agreed wire contract for payloads (fixed for a connector's lifetime).

    ``hidden_states`` always travels; router logits travel when ``router_logits_width`` is set
    (gate on Attention); top-k ids and weights when ``top_k`` is set; input ids when
    ``input_ids`` is true. The FFN reply is ``[tokens, hidden_size]`` of ``dtype``.
    """

    hidden_size: int
    dtype: torch.dtype
    router_logits_width: int | None = None
    router_logits_dtype: torch.dtype | None = None
    top_k: int | None = None
    topk_ids_dtype: torch.dtype = torch.int32
    topk_weights_dtype: torch.dtype = torch.float32
    input_ids: bool = False
    input_ids_dtype: torch.dtype = torch.int64
    _fields: tuple[AFDFieldSpec, ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _absent: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_width("hidden_size", self.hidden_size)
        _check_dtype("dtype", self.dtype)
        if self.router_logits_width is not None:
            _check_width("router_logits_width", self.router_logits_width)
        if self.router_logits_dtype is not None:
            _check_dtype("router_logits_dtype", self.router_logits_dtype)
        if self.top_k is not None:
            _check_width("top_k", self.top_k)
        _check_dtype("topk_ids_dtype", self.topk_ids_dtype)
        _check_dtype("topk_weights_dtype", self.topk_weights_dtype)
        _check_dtype("input_ids_dtype", self.input_ids_dtype)
        if not isinstance(self.input_ids, bool):
            raise AFDPayloadError("input_ids", self.input_ids, "a bool")
        fields = [AFDFieldSpec("hidden_states", self.hidden_size, self.dtype)]
        if self.router_logits_width is not None:
            fields.append(
                AFDFieldSpec(
                    "router_logits",
                    self.router_logits_width,
                    self.router_logits_dtype or self.dtype,
                )
            )
        if self.top_k is not None:
            fields.append(AFDFieldSpec("topk_ids", self.top_k, self.topk_ids_dtype))
            fields.append(AFDFieldSpec("topk_weights", self.top_k, self.topk_weights_dtype))
        if self.input_ids:
            fields.append(AFDFieldSpec("input_ids", None, self.input_ids_dtype))
        object.__setattr__(self, "_fields", tuple(fields))
        names = frozenset(f.name for f in fields)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_absent", tuple(n for n in PAYLOAD_FIELDS if n not in names))

    @property
    def fields(self) -> tuple[AFDFieldSpec, ...]:
        """The travelling fields, in wire order (``hidden_states`` first)."""
        return self._fields

    @property
    def field_names(self) -> frozenset[str]:
        """Names of the travelling fields."""
        return self._names

    def output_shape(self, num_tokens: int) -> tuple[int, int]:
        """Shape of the FFN reply for ``num_tokens`` tokens."""
        return (num_tokens, self.hidden_size)

    def validate_payload(self, payload: AFDPayload, num_tokens: int, device_type: str) -> None:
        """Raise :class:`AFDPayloadError` unless ``payload`` matches this spec exactly.

        Checks: no field outside the spec, every spec field present, shape ``spec.shape(n)``,
        dtype, device type, and (for ``hidden_states``) contiguity is not required (the connector
        makes a contiguous copy when needed).
        """
        if not isinstance(payload, AFDPayload):
            raise AFDPayloadError("payload", type(payload).__name__, "an AFDPayload")
        for name in self._absent:
            tensor = getattr(payload, name)
            if tensor is not None:
                raise AFDPayloadError(
                    name,
                    tuple(tensor.shape),
                    f"absent (this connector carries {sorted(self._names)})",
                )
        for spec in self._fields:
            tensor = getattr(payload, spec.name)
            if tensor is None:
                raise AFDPayloadError(
                    spec.name, None, f"a tensor of shape {spec.shape(num_tokens)}"
                )
            self.validate_tensor(spec, tensor, num_tokens, device_type)

    @staticmethod
    def validate_tensor(
        spec: AFDFieldSpec,
        tensor: torch.Tensor,
        num_tokens: int,
        device_type: str,
        *,
        name: str | None = None,
    ) -> None:
        """Check one tensor against its field spec (shape, dtype, device type).

        Errors name ``name`` when given (e.g. ``"outputs"``), else the spec's field name.
        """
        expected = (num_tokens,) if spec.width is None else (num_tokens, spec.width)
        if tensor.shape != expected or tensor.dtype != spec.dtype:
            label = spec.name if name is None else name
            if tuple(tensor.shape) != expected:
                raise AFDPayloadError(label, tuple(tensor.shape), f"shape {expected}")
            raise AFDPayloadError(label, tensor.dtype, f"dtype {spec.dtype}")
        # ``is_cpu`` is much cheaper than building ``tensor.device`` (hot path).
        if (not tensor.is_cpu) if device_type == "cpu" else tensor.device.type != device_type:
            label = spec.name if name is None else name
            raise AFDPayloadError(label, str(tensor.device), f"a {device_type} tensor")

    def to_wire(self) -> dict[str, Any]:
        """JSON-able description used in the connector handshake."""
        return {f.name: [f.width, dtype_name(f.dtype)] for f in self._fields}


@dataclass(frozen=True)
class AFDControlMessage:
    """Per-step control: token counts per stage and per Attention rank, plus step flags.

    ``stage_token_counts[s][i]`` is the token count of the ``i``-th Attention rank (of the set the
    message describes) in stage ``s``. Every stage has the same number of entries. ``shutdown``
    asks the FFN service loop to exit; a shutdown message may have zero stages. ``is_draft``
    marks a speculative draft model's forward (e.g. DeepSeek's MTP layer): the step runs only
    the connector's draft layers (its last ``num_draft_layers`` layer indices); any other step
    runs the target model's layers, before them.
    """

    stage_token_counts: tuple[tuple[int, ...], ...]
    is_warmup: bool = False
    is_capture: bool = False
    shutdown: bool = False
    is_draft: bool = False

    def __post_init__(self) -> None:
        counts = self.stage_token_counts
        if isinstance(counts, list | tuple):
            counts = tuple(tuple(s) if isinstance(s, list | tuple) else s for s in counts)
            object.__setattr__(self, "stage_token_counts", counts)
        if not isinstance(counts, tuple) or not all(isinstance(s, tuple) for s in counts):
            raise AFDPayloadError(
                "stage_token_counts", self.stage_token_counts, "a tuple of tuples of ints"
            )
        widths = {len(s) for s in counts}
        if len(widths) > 1 or 0 in widths:
            raise AFDPayloadError(
                "stage_token_counts",
                counts,
                "the same non-zero number of entries in every stage",
            )
        for stage in counts:
            if not all(map(_is_count, stage)):
                raise AFDPayloadError("stage_token_counts", counts, "non-negative ints")
        if not counts and not self.shutdown:
            raise AFDPayloadError(
                "stage_token_counts", counts, "at least one stage (unless shutdown=True)"
            )
        for name in ("is_warmup", "is_capture", "shutdown", "is_draft"):
            if not isinstance(getattr(self, name), bool):
                raise AFDPayloadError(name, getattr(self, name), "a bool")

    @classmethod
    def shutdown_message(cls) -> AFDControlMessage:
        """The message that tells the FFN service loop to exit."""
        return cls(stage_token_counts=(), shutdown=True)

    @property
    def num_stages(self) -> int:
        """Number of stages (micro-batches) in the step."""
        return len(self.stage_token_counts)

    @property
    def width(self) -> int:
        """Number of Attention ranks described per stage (0 for a stage-less shutdown)."""
        return len(self.stage_token_counts[0]) if self.stage_token_counts else 0

    def transfer_metadata(self, layer_idx: int, stage_idx: int) -> AFDTransferMetadata:
        """Transfer metadata for ``layer_idx`` and ``stage_idx`` with this step's counts."""
        counts = self.stage_token_counts
        if type(stage_idx) is not int or not 0 <= stage_idx < len(counts):
            raise AFDPayloadError("stage_idx", stage_idx, f"0..{self.num_stages - 1}")
        # The counts were validated when this message was built.
        return AFDTransferMetadata._of_counts(layer_idx, stage_idx, counts[stage_idx])

    def select(self, indices: Iterable[int]) -> AFDControlMessage:
        """The same message restricted to the Attention ranks at ``indices``."""
        idx = tuple(indices)
        return AFDControlMessage(
            tuple(tuple(stage[i] for i in idx) for stage in self.stage_token_counts),
            is_warmup=self.is_warmup,
            is_capture=self.is_capture,
            shutdown=self.shutdown,
            is_draft=self.is_draft,
        )

    @property
    def flags(self) -> int:
        """Bit set of the step flags (wire form)."""
        return (
            (_FLAG_WARMUP if self.is_warmup else 0)
            | (_FLAG_CAPTURE if self.is_capture else 0)
            | (_FLAG_SHUTDOWN if self.shutdown else 0)
            | (_FLAG_DRAFT if self.is_draft else 0)
        )

    def words(self) -> list[int]:
        """The wire words: magic, version, flags, stages, width, then the counts stage by stage."""
        words = [CONTROL_MAGIC, CONTROL_VERSION, self.flags, self.num_stages, self.width]
        for stage in self.stage_token_counts:
            words.extend(stage)
        return words

    def encode(self) -> torch.Tensor:
        """Wire form: ``int64[5 + stages*width]`` (see :meth:`words`)."""
        return torch.tensor(self.words(), dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> AFDControlMessage:
        """Inverse of :meth:`encode`; raises :class:`AFDProtocolError` on malformed input."""
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.dim() != 1:
            raise AFDProtocolError("AFD control message must be a 1-D int64 tensor")
        return cls.decode_words(tensor.tolist())

    @classmethod
    def decode_words(cls, words: Sequence[int]) -> AFDControlMessage:
        """:meth:`decode` of the message's words (a list of ints), e.g. a received wire prefix."""
        if len(words) < _HEADER_WORDS:
            raise AFDProtocolError(f"AFD control message too short: {len(words)} words")
        magic, version, flags, stages, width = words[:_HEADER_WORDS]
        if magic != CONTROL_MAGIC:
            raise AFDProtocolError(f"AFD control message has bad magic {magic:#x}")
        if version != CONTROL_VERSION:
            raise AFDProtocolError(
                f"AFD control message version {version} is not supported "
                f"(this build speaks version {CONTROL_VERSION})"
            )
        if flags & ~_KNOWN_FLAGS:
            raise AFDProtocolError(f"AFD control message has unknown flags {flags:#x}")
        if stages < 0 or width < 0 or len(words) != _HEADER_WORDS + stages * width:
            raise AFDProtocolError(
                f"AFD control message length {len(words)} does not match "
                f"{stages} stages x {width} ranks"
            )
        body = words[_HEADER_WORDS:]
        counts = tuple(tuple(body[s * width : (s + 1) * width]) for s in range(stages))
        try:
            return cls(
                counts,
                is_warmup=bool(flags & _FLAG_WARMUP),
                is_capture=bool(flags & _FLAG_CAPTURE),
                shutdown=bool(flags & _FLAG_SHUTDOWN),
                is_draft=bool(flags & _FLAG_DRAFT),
            )
        except AFDPayloadError as err:
            raise AFDProtocolError(f"AFD control message is invalid: {err}") from err
