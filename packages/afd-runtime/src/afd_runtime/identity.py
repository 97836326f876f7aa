"""The model identity both roles publish in the connector handshake (``model_identity``).

Both roles load the same checkpoint, each only its part of the weights, so the identity names
the checkpoint, not the loaded tensors. It is a JSON mapping with two sections::

    {"config":  {<HF config key>: <value>, ...},          # what vLLM serves (hf_config)
     "weights": {<file name>: {"size": int,               # bytes
                               "header": sha256 | None,   # safetensors header (names, dtypes,
                                                          #   shapes, offsets, metadata)
                               "samples": sha256}}}       # fixed content windows

afd-core compares it across every rank of both roles and names the first differing leaf (sorted
keys): ``model_identity.config.num_experts``, ``model_identity.weights['model.safetensors']
.samples``.

Rules (both roles must compute the same value from identical files anywhere on disk):

* **config**: ``hf_config.to_dict()`` (overrides such as ``--hf-overrides`` included), taken
  before the model is built (vLLM's model classes rewrite keys they read, e.g. DeepSeek's yarn
  ``rope_type`` becomes ``deepseek_yarn`` in its attention layers, which only the Attention role
  builds), nested
  configs descended, without :data:`EXCLUDED_CONFIG_KEYS` at any level (paths, versions, the
  attention implementation, and ``torch_dtype``/``dtype``: vLLM's ``--dtype`` governs the serving
  dtype, which the handshake compares separately as ``dtype``; the stored dtypes are in the
  weight headers). Non-finite floats become strings, other non-JSON values their ``str``.
* **weights**: the weight files of the checkpoint folder (``model_config.model`` when it is a
  folder or a file, else its local Hugging Face snapshot): every top-level ``*.safetensors``
  file, else every ``*.bin``, else every ``*.pt``; per file its size, the SHA-256 of its
  safetensors header (``None`` for other formats) and the SHA-256 of :data:`SAMPLE_WINDOWS`
  windows of :data:`SAMPLE_BYTES` bytes evenly spaced over the data section, the first at its
  start and the last at its end (a data section shorter than the windows together is read
  whole). Cost: the header plus at most 128 KiB per file, whatever the checkpoint size.
* ``--load-format dummy`` (random weights): ``{"load_format": "dummy"}``; a checkpoint whose
  files cannot be found locally: ``{"unresolved": "<model>@<revision>"}`` (then only the name
  is compared).

Limits (what it can miss): a change confined to bytes outside the sampled windows (e.g. a
handful of edited values in one tensor) with identical names, dtypes, shapes and offsets is not
detected; two fine-tunes of one architecture differ almost everywhere and are detected. Files
outside the top-level folder (``subfolder`` checkpoints) and tokenizer files are not covered
(the FFN role does not tokenize).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd_core.errors import AFDModelError

__all__ = [
    "EXCLUDED_CONFIG_KEYS",
    "SAMPLE_BYTES",
    "SAMPLE_WINDOWS",
    "WEIGHT_PATTERNS",
    "config_identity",
    "model_identity",
    "sample_windows",
    "weight_file_identity",
    "weight_files",
    "weights_identity",
]

logger = logging.getLogger(__name__)

EXCLUDED_CONFIG_KEYS: frozenset[str] = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "_commit_hash",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "attn_implementation",
        "_experts_implementation",
    }
)
"""HF config keys left out of the identity: where the checkpoint lies, which library wrote it,
and runtime choices vLLM makes (see the module docstring)."""

SAMPLE_WINDOWS = 32
"""Content windows sampled per weight file."""

SAMPLE_BYTES = 4096
"""Bytes per content window."""

WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt")
"""The weight files of a folder: every file of the first pattern that matches any."""


def _canonical(value: Any) -> Any:
    """``value`` as JSON that survives a round trip unchanged (see the module docstring)."""
    if isinstance(value, Mapping):
        return {
            str(k): _canonical(v)
            for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            if str(k) not in EXCLUDED_CONFIG_KEYS
        }
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if hasattr(value, "to_dict"):  # a nested PretrainedConfig
        return _canonical(value.to_dict())
    return str(value)


def config_identity(hf_config: Any) -> dict[str, Any]:
    """The ``config`` section: a ``PretrainedConfig`` (``to_dict()``) or a mapping (e.g. a
    parsed ``config.json``) without :data:`EXCLUDED_CONFIG_KEYS`, canonical JSON values."""
    data = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    out: dict[str, Any] = _canonical(data)
    return out


def sample_windows(data_len: int) -> list[tuple[int, int]]:
    """``(offset, length)`` in the data section of each sampled window: :data:`SAMPLE_WINDOWS`
    windows of :data:`SAMPLE_BYTES` from its start to its end, or the whole section when it is
    no longer than they are together."""
    if data_len <= SAMPLE_WINDOWS * SAMPLE_BYTES:
        return [(0, data_len)]
    last = data_len - SAMPLE_BYTES
    return [(i * last // (SAMPLE_WINDOWS - 1), SAMPLE_BYTES) for i in range(SAMPLE_WINDOWS)]


def weight_file_identity(path: Path) -> dict[str, Any]:
    """``{"size", "header", "samples"}`` of one weight file (see the module docstring).

    Raises:
        AFDModelError: a ``.safetensors`` file whose header length exceeds the file.
        OSError: the file cannot be read.
    """
    path = Path(path)
    size = path.stat().st_size
    header_digest: str | None = None
    data_start = 0
    samples = hashlib.sha256()
    with path.open("rb") as f:
        if path.suffix == ".safetensors":
            raw_len = f.read(8)
            header_len = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else size
            if 8 + header_len > size:
                raise AFDModelError(
                    "safetensors header length",
                    header_len,
                    f"at most {max(size - 8, 0)} (the file size {size} less the 8-byte length)",
                    detail=str(path),
                )
            header_digest = hashlib.sha256(f.read(header_len)).hexdigest()
            data_start = 8 + header_len
        data_len = size - data_start
        for offset, length in sample_windows(data_len):
            f.seek(data_start + offset)
            samples.update(f.read(length))
    return {"size": size, "header": header_digest, "samples": samples.hexdigest()}


def weight_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: every top-level file of the first of
    :data:`WEIGHT_PATTERNS` that matches any, sorted by name."""
    for pattern in WEIGHT_PATTERNS:
        found = sorted(p for p in Path(folder).glob(pattern) if p.is_file())
        if found:
            return found
    return []


def weights_identity(location: Path) -> dict[str, Any]:
    """The ``weights`` section of a checkpoint folder or a single weight file: per file (by
    name, relative to the folder) :func:`weight_file_identity`; ``{}`` when it holds none."""
    location = Path(location)
    files = [location] if location.is_file() else weight_files(location)
    return {p.name: weight_file_identity(p) for p in files}


def _checkpoint_location(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The local folder (or file) of ``model``: itself when it exists, else its Hugging Face
    snapshot in the local cache (vLLM downloaded it before the workers load); ``None`` when
    neither is found. Never downloads."""
    if os.path.exists(model):
        return Path(model)
    try:
        from vllm.transformers_utils.repo_utils import hf_api

        folder = hf_api().snapshot_download(
            repo_id=model, revision=revision, cache_dir=download_dir, local_files_only=True
        )
    except Exception as err:  # not cached, no hub client, a revision not found offline
        logger.warning("AFD model identity: no local snapshot of %r (%s)", model, err)
        return None
    return Path(folder)


def model_identity(vllm_config: Any, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity of the model ``vllm_config`` serves (see the module docstring); what each
    role passes to ``build_connector`` as ``model_identity``. ``config``: the config section
    taken earlier (:func:`config_identity` before the model was built); the weight files are
    looked up now (after the load, they are on disk)."""
    model_config = vllm_config.model_config
    section = config_identity(model_config.hf_config) if config is None else dict(config)
    identity: dict[str, Any] = {"config": section}
    load_config = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load_config, "load_format", "auto") or "auto")
    if load_format == "dummy":
        identity["weights"] = {"load_format": "dummy"}
    else:
        model = str(model_config.model)
        revision = getattr(model_config, "revision", None)
        where = _checkpoint_location(model, revision, getattr(load_config, "download_dir", None))
        if where is None:
            identity["weights"] = {"unresolved": f"{model}@{revision}"}
        else:
            identity["weights"] = weights_identity(where)
    logger.info(
        "AFD model identity: config sha256 %s, weights sha256 %s (%d entries)",
        _digest(identity["config"])[:16],
        _digest(identity["weights"])[:16],
        len(identity["weights"]),
    )
    return identity


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
