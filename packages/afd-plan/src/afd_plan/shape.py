"""The shape of a MoE model, read from a Hugging Face ``config.json`` (no transformers, no torch).

Supported ``model_type`` values (:data:`FAMILIES`): ``qwen3_moe``, ``qwen3_5_moe`` (its
``text_config``, or a ``qwen3_5_moe_text`` config), ``deepseek_v2``, ``deepseek_v3`` and
``deepseek_v32`` (DeepSeek-V3.2: V3's shape plus the DSA lightning indexer).

Which layers are MoE layers (the rule each family's modelling code applies):

* DeepSeek: layer ``i`` (0-based) is MoE iff ``n_routed_experts > 0``,
  ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``; the others are dense MLPs of
  ``intermediate_size``. Shared experts: ``n_shared_experts`` of ``moe_intermediate_size`` each
  (one shared MLP of ``n_shared_experts * moe_intermediate_size``).
* Qwen3-MoE: layer ``i`` is MoE iff ``num_experts > 0``, ``i not in mlp_only_layers`` and
  ``(i + 1) % decoder_sparse_step == 0``; no shared experts.
* Qwen3.5-MoE: every layer is MoE, with one shared expert of
  ``shared_expert_intermediate_size``; ``layer_types`` (or, without it, every
  ``full_attention_interval``-th layer, default 4) says which layers run full (gated GQA)
  attention; the others run linear attention (Gated DeltaNet), whose decode state does not grow
  with the context.

Parameter counts (per layer; ``H`` hidden, ``I`` an MLP's intermediate size):

* a gated MLP (gate, up, down): ``3 * H * I``;
* GQA attention: ``H * heads * head_dim`` (q; twice that with Qwen3.5's output gate)
  ``+ 2 * H * kv_heads * head_dim`` (k, v) ``+ heads * head_dim * H`` (o);
* linear attention (Gated DeltaNet; key dim ``Dk = k_heads * dk``, value dim
  ``Dv = v_heads * dv``): ``H * (2 Dk + Dv)`` (qkv) ``+ H * Dv`` (z) ``+ 2 * H * v_heads``
  (b, a) ``+ (2 Dk + Dv) * conv_kernel`` (conv) ``+ Dv * H`` (out);
* MLA attention: ``H * q_lora + q_lora * heads * (nope + rope)`` (or ``H * heads * (nope + rope)``
  without ``q_lora_rank``) ``+ H * (kv_lora + rope)`` (kv_a) ``+ kv_lora * heads * (nope + v)``
  (kv_b) ``+ heads * v * H`` (o); DSA adds the indexer ``q_lora * idx_heads * idx_dim`` (wq_b)
  ``+ H * idx_dim`` (wk) ``+ H * idx_heads`` (weights_proj).

Norms, the router and biases are left out (under 0.1 % of any supported model's weights).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Final

from afd_plan.errors import AFDPlanError
from afd_plan.public_configs import PUBLIC_CONFIGS

__all__ = ["DTYPE_BYTES", "FAMILIES", "AttentionShape", "ModelShape", "load_model_shape"]

FAMILIES: Final[tuple[str, ...]] = (
    "qwen3_moe",
    "qwen3_5_moe",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
)
#: Bytes per element of the ``torch_dtype`` values a checkpoint may declare.
DTYPE_BYTES: Final[dict[str, int]] = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer's shape.

    ``kind`` is ``"gqa"`` (grouped-query attention: ``kv_heads`` keys/values of ``head_dim``;
    ``gated_query``: the query projection also yields an output gate, as in Qwen3.5),
    ``"mla"`` (multi-head latent attention: a compressed KV of ``kv_lora_rank + qk_rope_head_dim``
    per token, decoded in the absorbed form) or ``"linear"`` (Gated DeltaNet: a recurrent state
    of ``linear_v_heads * linear_k_dim * linear_v_dim`` FP32 values per sequence, read and
    written once per decode step, plus a short convolution state). ``index_topk > 0`` is
    DeepSeek-V3.2's sparse attention (DSA): a lightning indexer with ``index_n_heads`` heads of
    ``index_head_dim`` scores every cached token, and the main attention reads only the
    ``index_topk`` best tokens.
    """

    kind: str
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    gated_query: bool = False
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0

    def weight_params(self, hidden: int) -> int:
        """Parameters of one layer's attention projections (formulas in the module docstring)."""
        h = hidden
        if self.kind == "linear":
            dk = self.linear_k_heads * self.linear_k_dim
            dv = self.linear_v_heads * self.linear_v_dim
            conv = (2 * dk + dv) * self.conv_kernel
            return h * (2 * dk + dv) + h * dv + 2 * h * self.linear_v_heads + conv + dv * h
        if self.kind == "gqa":
            q = h * self.num_heads * self.head_dim * (2 if self.gated_query else 1)
            o = self.num_heads * self.head_dim * h
            return q + o + 2 * h * self.num_kv_heads * self.head_dim
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (
            h * self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
            if self.q_lora_rank
            else h * self.num_heads * qk
        )
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.num_heads * self.v_head_dim * h
        indexer = 0
        if self.index_topk:
            q_in = self.q_lora_rank or h
            indexer = (
                q_in * self.index_n_heads * self.index_head_dim
                + h * self.index_head_dim
                + h * self.index_n_heads
            )
        return q + kv_a + kv_b + o + indexer

    def kv_elems_per_token(self) -> int:
        """KV-cache elements one token keeps per layer: ``2 * kv_heads * head_dim`` (GQA) or
        ``kv_lora_rank + qk_rope_head_dim`` (MLA). The DSA indexer keys are
        :meth:`index_bytes_per_token`, stored apart; linear attention keeps none (its state is
        :meth:`state_bytes`)."""
        if self.kind == "linear":
            return 0
        if self.kind == "gqa":
            return 2 * self.num_kv_heads * self.head_dim
        return self.kv_lora_rank + self.qk_rope_head_dim

    def index_bytes_per_token(self) -> int:
        """DSA indexer key bytes per token per layer: ``index_head_dim`` FP8 values plus one FP32
        scale (DeepSeek-V3.2's indexer cache); 0 without DSA."""
        return self.index_head_dim + 4 if self.index_topk else 0

    def state_bytes(self, dtype_bytes: int) -> int:
        """Linear attention's per-sequence decode state in one layer: the FP32 recurrent state
        ``v_heads * dk * dv * 4`` plus the convolution state ``(2 Dk + Dv) * (kernel - 1) *
        dtype_bytes``; 0 for the other kinds."""
        if self.kind != "linear":
            return 0
        dk = self.linear_k_heads * self.linear_k_dim
        dv = self.linear_v_heads * self.linear_v_dim
        recurrent = self.linear_v_heads * self.linear_k_dim * self.linear_v_dim * 4
        return recurrent + (2 * dk + dv) * (self.conv_kernel - 1) * dtype_bytes

    def attended_tokens(self, context: float) -> float:
        """Tokens the main attention reads at ``context`` cached tokens: all of them, or
        ``min(context, index_topk)`` under DSA."""
        return min(context, self.index_topk) if self.index_topk else context

    def flops_per_token(self, hidden: int, context: float) -> float:
        """FLOPs of one decode token's attention in one layer at ``context`` cached tokens:
        ``2 * weight_params`` (projections) plus the score and value products:
        GQA ``4 * heads * head_dim * context``; MLA (absorbed)
        ``2 * heads * (2 * kv_lora + rope) * attended``; DSA adds the indexer's
        ``2 * idx_heads * idx_dim * context``; linear attention ``6 * v_heads * dk * dv`` (decay,
        delta-rule update and read-out of the state), whatever the context."""
        proj = 2.0 * self.weight_params(hidden)
        if self.kind == "linear":
            return proj + 6.0 * self.linear_v_heads * self.linear_k_dim * self.linear_v_dim
        if self.kind == "gqa":
            return proj + 4.0 * self.num_heads * self.head_dim * context
        attended = self.attended_tokens(context)
        core = 2.0 * self.num_heads * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * attended
        indexer = (
            2.0 * self.index_n_heads * self.index_head_dim * context if self.index_topk else 0.0
        )
        return proj + core + indexer


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a MoE model (see the module docstring for the rules).

    Invariants (checked by :func:`load_model_shape` and :meth:`__post_init__`): every count is
    positive where the family requires it; ``0 < top_k <= num_experts``; ``moe_layers`` are
    distinct indices in ``[0, num_layers)``; ``dtype`` is a key of :data:`DTYPE_BYTES`.
    """

    family: str
    hidden_size: int
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    dense_intermediate_size: int
    attention: AttentionShape
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    #: Layers running ``linear_attention`` instead of ``attention`` (Qwen3.5-MoE); else empty.
    linear_layers: tuple[int, ...] = ()
    linear_attention: AttentionShape | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise AFDPlanError("model_type", self.family, f"one of {', '.join(FAMILIES)}")
        if not 0 < self.top_k <= self.num_experts:
            raise AFDPlanError("top_k", self.top_k, f"1..num_experts ({self.num_experts})")
        if not self.moe_layers:
            raise AFDPlanError("moe_layers", self.moe_layers, "at least one MoE layer")
        if self.dtype not in DTYPE_BYTES:
            raise AFDPlanError("torch_dtype", self.dtype, f"one of {', '.join(DTYPE_BYTES)}")

    def attention_at(self, layer: int) -> AttentionShape:
        """The attention of layer ``layer``."""
        if layer in self.linear_layers and self.linear_attention is not None:
            return self.linear_attention
        return self.attention

    @cached_property
    def _groups(self) -> tuple[tuple[AttentionShape, bool, int], ...]:
        moe = set(self.moe_layers)
        groups: dict[tuple[AttentionShape, bool], int] = {}
        for i in range(self.num_layers):
            key = (self.attention_at(i), i in moe)
            groups[key] = groups.get(key, 0) + 1
        return tuple((att, is_moe, n) for (att, is_moe), n in groups.items())

    def layer_groups(self) -> dict[tuple[AttentionShape, bool], int]:
        """Layers counted by (attention, is MoE): the cost model prices each group once."""
        return {(att, is_moe): n for att, is_moe, n in self._groups}

    def attention_params(self) -> int:
        """Every layer's attention projections."""
        return sum(n * att.weight_params(self.hidden_size) for att, _, n in self._groups)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def expert_params(self) -> int:
        """One routed expert: ``3 * hidden * moe_intermediate_size``."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def shared_params(self) -> int:
        """A MoE layer's shared experts: ``3 * hidden * shared_intermediate_size`` (0 if none)."""
        return 3 * self.hidden_size * self.shared_intermediate_size

    def dense_mlp_params(self) -> int:
        """A dense layer's MLP: ``3 * hidden * dense_intermediate_size``."""
        return 3 * self.hidden_size * self.dense_intermediate_size

    def embedding_params(self) -> int:
        """Token embedding plus LM head: ``vocab * hidden`` each (once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


def load_model_shape(path: str | Path) -> ModelShape:
    """Read a :class:`ModelShape` from a checkpoint folder (its ``config.json``), the file, or
    the name of a public shape (:data:`afd_plan.public_configs.PUBLIC_CONFIGS`, e.g.
    ``deepseek-v3``) when no such file exists.

    Raises :class:`AFDPlanError` naming the field (``config.json:<key>``), the value and what is
    allowed: a missing file, invalid JSON, an unsupported ``model_type``, a missing or
    non-positive count, inconsistent MoE settings.
    """
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        public = PUBLIC_CONFIGS.get(str(path).lower())
        if public is not None:
            return shape_from_config(public)
        raise AFDPlanError(
            "model",
            str(path),
            "a checkpoint folder holding config.json, the file, or a public shape's name "
            f"({', '.join(sorted(PUBLIC_CONFIGS))})",
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AFDPlanError("config.json", str(file), "a readable JSON object", detail=str(e)) from e
    if not isinstance(data, dict):
        raise AFDPlanError("config.json", type(data).__name__, "a JSON object")
    return shape_from_config(data)


def shape_from_config(cfg: Mapping[str, Any]) -> ModelShape:
    """:func:`load_model_shape` on an already parsed ``config.json`` mapping."""
    family = cfg.get("model_type")
    if family == "qwen3_5_moe" and isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg["text_config"], "model_type": "qwen3_5_moe"}
    elif family == "qwen3_5_moe_text":
        cfg = {**cfg, "model_type": "qwen3_5_moe"}
        family = "qwen3_5_moe"
    if family not in FAMILIES:
        raise AFDPlanError("config.json:model_type", family, f"one of {', '.join(FAMILIES)}")
    r = _Reader(cfg)
    hidden = r.count("hidden_size")
    layers = r.count("num_hidden_layers")
    heads = r.count("num_attention_heads")
    vocab = r.count("vocab_size")
    dtype = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise AFDPlanError("config.json:torch_dtype", dtype, f"one of {', '.join(DTYPE_BYTES)}")
    tie = bool(cfg.get("tie_word_embeddings", False))
    linear_layers: tuple[int, ...] = ()
    linear_attn: AttentionShape | None = None
    if family == "qwen3_5_moe":
        experts = r.count("num_experts")
        moe = tuple(range(layers))
        attn = AttentionShape(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=r.count("num_key_value_heads", default=heads),
            head_dim=r.count("head_dim", default=hidden // heads),
            gated_query=True,
        )
        linear_attn = AttentionShape(
            kind="linear",
            num_heads=heads,
            linear_k_heads=r.count("linear_num_key_heads"),
            linear_v_heads=r.count("linear_num_value_heads"),
            linear_k_dim=r.count("linear_key_head_dim"),
            linear_v_dim=r.count("linear_value_head_dim"),
            conv_kernel=r.count("linear_conv_kernel_dim", default=4),
        )
        linear_layers = r.linear_layers(layers)
        shared = r.count("shared_expert_intermediate_size", default=0, minimum=0)
        dense_i = 0
    elif family == "qwen3_moe":
        experts = r.count("num_experts")
        step = r.count("decoder_sparse_step", default=1)
        mlp_only = r.int_list("mlp_only_layers", layers)
        moe = tuple(i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0)
        head_dim = r.count("head_dim", default=hidden // heads)
        attn = AttentionShape(
            kind="gqa",
            num_heads=heads,
            num_kv_heads=r.count("num_key_value_heads", default=heads),
            head_dim=head_dim,
        )
        shared = 0
        dense_i = r.count("intermediate_size") if len(moe) < layers else 0
    else:
        experts = r.count("n_routed_experts")
        first_dense = r.count("first_k_dense_replace", default=0, minimum=0)
        freq = r.count("moe_layer_freq", default=1)
        if first_dense >= layers:
            raise AFDPlanError(
                "config.json:first_k_dense_replace", first_dense, f"< num_hidden_layers ({layers})"
            )
        moe = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
        shared = r.count("n_shared_experts", default=0, minimum=0) * r.count(
            "moe_intermediate_size"
        )
        dense_i = r.count("intermediate_size") if len(moe) < layers else 0
        is_v32 = family == "deepseek_v32"
        attn = AttentionShape(
            kind="mla",
            num_heads=heads,
            q_lora_rank=r.count("q_lora_rank", default=0, minimum=0, allow_null=True),
            kv_lora_rank=r.count("kv_lora_rank"),
            qk_nope_head_dim=r.count("qk_nope_head_dim"),
            qk_rope_head_dim=r.count("qk_rope_head_dim"),
            v_head_dim=r.count("v_head_dim"),
            index_topk=r.count("index_topk") if is_v32 else 0,
            index_n_heads=r.count("index_n_heads") if is_v32 else 0,
            index_head_dim=r.count("index_head_dim") if is_v32 else 0,
        )
    top_k = r.count("num_experts_per_tok")
    if top_k > experts:
        raise AFDPlanError(
            "config.json:num_experts_per_tok", top_k, f"1..{experts} (the routed experts)"
        )
    if not moe:
        raise AFDPlanError(
            "config.json:num_hidden_layers", layers, "a layer layout with at least one MoE layer"
        )
    return ModelShape(
        family=family,
        hidden_size=hidden,
        num_layers=layers,
        moe_layers=moe,
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=r.count("moe_intermediate_size"),
        shared_intermediate_size=shared,
        dense_intermediate_size=dense_i,
        attention=attn,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        dtype=dtype,
        linear_layers=linear_layers,
        linear_attention=linear_attn,
    )


class _Reader:
    """Typed reads of ``config.json`` keys; every error names ``config.json:<key>``."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg

    def count(
        self, key: str, *, default: int | None = None, minimum: int = 1, allow_null: bool = False
    ) -> int:
        value = self.cfg.get(key, default)
        if value is None and allow_null and key in self.cfg:
            value = default
        if value is None:
            raise AFDPlanError(f"config.json:{key}", None, f"an integer >= {minimum} (missing)")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise AFDPlanError(f"config.json:{key}", value, f"an integer >= {minimum}")
        return value

    def linear_layers(self, layers: int) -> tuple[int, ...]:
        """Qwen3.5's linear-attention layers: ``layer_types`` entries ``"linear_attention"``, or
        every layer but each ``full_attention_interval``-th (default 4)."""
        types = self.cfg.get("layer_types")
        if types is None:
            interval = self.count("full_attention_interval", default=4)
            return tuple(i for i in range(layers) if (i + 1) % interval)
        kinds = ("linear_attention", "full_attention")
        if (
            not isinstance(types, list)
            or len(types) != layers
            or any(t not in kinds for t in types)
        ):
            raise AFDPlanError(
                "config.json:layer_types",
                types,
                f"a list of {layers} entries, each one of {', '.join(kinds)}",
            )
        return tuple(i for i, t in enumerate(types) if t == "linear_attention")

    def int_list(self, key: str, layers: int) -> tuple[int, ...]:
        value = self.cfg.get(key) or []
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value
        ):
            raise AFDPlanError(
                f"config.json:{key}", value, f"a list of layer indices in [0, {layers})"
            )
        return tuple(value)
