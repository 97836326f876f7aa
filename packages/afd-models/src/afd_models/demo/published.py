"""Tiny checkpoints whose ``config.json`` is a published model's, with only its sizes scaled down.

Our own tiny builder (:mod:`afd_models.demo.tiny`) writes the configs we chose; users bring
checkpoints somebody else saved, with keys and values we never set (yarn ``rope_scaling``,
``q_lora_rank: null``, ``moe_layer_freq``, a declared MTP layer whose weights are not shipped, a
``quantization_config``, ...). A published fixture keeps every key of the published file as it is
and replaces only sizes (:func:`scaled_config`): layer counts, hidden and intermediate sizes,
head counts and dimensions, expert counts, the vocabulary (the tiny tokenizer's). The weights are
seeded random values under the published tensor names (:func:`afd_models.demo.tiny.tensor_shapes`;
``tests/test_models_published_checkpoints.py`` checks them against the names of each model's
published checkpoint, recorded in ``published/<key>.weights.txt``). Where each file came from:
``published/SOURCES.md``.

Invariants: same :class:`PublishedSpec` => byte-identical files (cached by content hash, like
the tiny checkpoints); a scaled config differs from the published one only in
:data:`SIZE_KEYS` and the token ids of the tiny tokenizer; scaling keeps what routing and the
CPU kernels need (experts divisible by ``n_group``, ``num_experts_per_tok`` within the groups kept,
MLA's ``kv_lora_rank + qk_rope_head_dim`` as published, the ratio of query to key-value heads).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from afd_models.demo.tiny import (
    CORPUS,
    DTYPES,
    GENERATOR_VERSION,
    TinyDType,
    _vocab_size,
    build_tokenizer_json,
    checkpoint_files,
    default_cache_dir,
    ensure_cached_checkpoint,
)

#: The published configs (``<key>.config.json``), their tensor names and their sources.
PUBLISHED_DIR: Final[Path] = Path(__file__).parent / "published"

#: The keys :func:`scaled_config` may change (besides the tokenizer's token ids).
SIZE_KEYS: Final[frozenset[str]] = frozenset(
    {
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "q_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts",
        "num_local_experts",
        "first_k_dense_replace",
        "max_window_layers",
        "mlp_only_layers",
        "vocab_size",
    }
)

LAYERS: Final[int] = 4
HIDDEN: Final[int] = 128
EXPERTS: Final[int] = 16


def published_keys() -> tuple[str, ...]:
    """Every published config shipped here (``<key>.config.json``), sorted."""
    return tuple(
        sorted(p.name.removesuffix(".config.json") for p in PUBLISHED_DIR.glob("*.config.json"))
    )


def published_config(key: str) -> dict[str, Any]:
    """The published ``config.json`` of ``key``, as published."""
    path = PUBLISHED_DIR / f"{key}.config.json"
    if not path.is_file():
        raise ValueError(f"published config {key!r} not found; allowed: {list(published_keys())}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def published_weight_names(key: str) -> tuple[str, ...] | None:
    """Tensor names of the model's published checkpoint (the non-layer tensors, layer 0, the
    first MoE layer with experts 0 and 1, the MTP layer), or ``None`` when none were recorded."""
    path = PUBLISHED_DIR / f"{key}.weights.txt"
    if not path.is_file():
        return None
    lines = (line.strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


def scaled_config(published: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """``published`` with its sizes scaled down (see the module docstring); every other key kept.

    MLA models (``kv_lora_rank`` set) keep ``kv_lora_rank`` and ``qk_rope_head_dim`` as
    published (vLLM's CPU MLA kernel needs their sum to be 576, as in every DeepSeek release) and
    ``head_dim`` where the config states it (MLA's rope dimension)."""
    config = dict(published)
    mla = published.get("kv_lora_rank") is not None
    heads = 4
    sizes: dict[str, Any] = {
        "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "moe_intermediate_size": 64,
        "num_attention_heads": heads,
        "vocab_size": vocab_size,
    }
    kv = published.get("num_key_value_heads")
    if kv is not None:
        # Keep multi-head attention multi-head and grouped-query attention grouped.
        sizes["num_key_value_heads"] = heads if kv == published["num_attention_heads"] else 2
    if published.get("shared_expert_intermediate_size"):
        sizes["shared_expert_intermediate_size"] = 64
    if "head_dim" in published and not mla:
        sizes["head_dim"] = 32
    if mla:
        sizes["qk_nope_head_dim"] = 32
        sizes["v_head_dim"] = 32
        if published.get("q_lora_rank") is not None:
            sizes["q_lora_rank"] = 64
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if published.get(key):
            sizes[key] = _experts(published, int(published[key]))
    if "first_k_dense_replace" in published:
        sizes["first_k_dense_replace"] = min(int(published["first_k_dense_replace"]), 1)
    if "max_window_layers" in published:
        sizes["max_window_layers"] = min(int(published["max_window_layers"]), LAYERS)
    if published.get("mlp_only_layers"):
        sizes["mlp_only_layers"] = [i for i in published["mlp_only_layers"] if i < LAYERS]
    assert set(sizes) <= SIZE_KEYS, set(sizes) - SIZE_KEYS
    config.update({k: v for k, v in sizes.items() if k in published})
    return config


def _experts(published: dict[str, Any], count: int) -> int:
    """:data:`EXPERTS` (or fewer when published with fewer), a multiple of ``n_group`` with room
    for ``num_experts_per_tok`` in the ``topk_group`` groups kept."""
    groups = int(published.get("n_group") or 1)
    kept = int(published.get("topk_group") or groups)
    top_k = int(published.get("num_experts_per_tok") or 1)
    per_group = max(EXPERTS // groups, -(-top_k // kept), 1)
    return min(count, per_group * groups)


@dataclass(frozen=True)
class PublishedSpec:
    """A tiny checkpoint of the published config ``key``.

    ``draft_weights=False``: the config still declares its MTP layers
    (``num_nextn_predict_layers``) but no tensor of them is written, as transformers saves a
    DeepSeek-V3 and as many published derivatives ship. ``dequantized=True``: the published
    config without its ``quantization_config``, as the published BF16 conversions of FP8
    releases (DeepSeek-V3, Kimi-K2) ship it; every other key as published.
    """

    key: str
    draft_weights: bool = True
    dequantized: bool = False
    seed: int = 0
    dtype: TinyDType = "float32"

    def __post_init__(self) -> None:
        if self.key not in published_keys():
            raise ValueError(f"PublishedSpec.key={self.key!r}; allowed: {list(published_keys())}")
        if self.dtype not in DTYPES:
            raise ValueError(f"PublishedSpec.dtype={self.dtype!r} is not one of {DTYPES}")

    @property
    def name(self) -> str:
        name = self.key + ("-dequantized" if self.dequantized else "")
        return name + ("" if self.draft_weights else "-no-mtp-weights")

    def config(self, vocab_size: int) -> dict[str, Any]:
        """The checkpoint's ``config.json`` content (before the tokenizer's token ids)."""
        published = published_config(self.key)
        if self.dequantized:
            published.pop("quantization_config", None)
        return scaled_config(published, vocab_size)


def _files(spec: PublishedSpec) -> Iterator[tuple[str, bytes]]:
    tokenizer_json = build_tokenizer_json()
    config = spec.config(_vocab_size(tokenizer_json))
    return checkpoint_files(
        config, tokenizer_json, spec.seed, spec.dtype, draft_weights=spec.draft_weights
    )


def _hash(spec: PublishedSpec) -> str:
    payload = {
        "generator_version": GENERATOR_VERSION,
        "spec": [spec.key, spec.draft_weights, spec.dequantized, spec.seed, spec.dtype],
        "config": spec.config(0),
        "corpus": list(CORPUS),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def ensure_published_checkpoint(spec: PublishedSpec, cache_dir: Path | None = None) -> Path:
    """The cached checkpoint of ``spec`` (``<cache_dir>/published-<name>-s<seed>-<dtype>-<hash>``),
    built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"published-{spec.name}-s{spec.seed}-{spec.dtype}-{_hash(spec)}"
    return ensure_cached_checkpoint(target, lambda: _files(spec))
