"""Deterministic tiny MoE checkpoints for end-to-end tests and ``afd demo``.

A tiny checkpoint is a Hugging Face style directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) holding random weights
and a byte-level BPE tokenizer trained locally on an embedded corpus. No network access is needed.

Invariants:

* Same :class:`TinySpec` (family, seed, dtype) => byte-identical files. Weights come from a
  ``torch.Generator`` seeded per tensor from ``(seed, tensor name)``, tensors are written in sorted
  name order, JSON files are written with sorted keys.
* The on-disk tensor names follow the original Hugging Face layout for the family (one tensor per
  expert: ``mlp.experts.<j>.{gate,up,down}_proj.weight``), which is what vLLM's loaders expect.
* Weights are scaled by ``1/sqrt(fan_in)`` and embeddings have unit variance, so logits are far
  from ties and greedy text differs between prompts.
* :func:`ensure_tiny_checkpoint` caches by content hash: the directory name embeds a hash of the
  spec, the model config, the corpus and :data:`GENERATOR_VERSION`; a directory is published with
  an atomic rename, so a partially written checkpoint is never reused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import torch

TinyFamily = Literal["qwen3_moe", "deepseek_v2", "deepseek_v3"]
TinyDType = Literal["float32", "bfloat16"]
TinyWidth = Literal["tiny", "wide"]
TinyDraft = Literal["random", "accepting"]

FAMILIES: Final[tuple[str, ...]] = get_args(TinyFamily)
DTYPES: Final[tuple[str, ...]] = get_args(TinyDType)
WIDTHS: Final[tuple[str, ...]] = get_args(TinyWidth)
DRAFTS: Final[tuple[str, ...]] = get_args(TinyDraft)
#: ``width="wide"`` (Qwen3-MoE only): hidden 1024, 16 query heads of 64 over 4 KV heads, experts
#: of 1024: 96 MiB of float32 routed experts per MoE layer, so a decode step's FFN work is bound by
#: reading expert weights as a real model's is (the tiny width is bound by per-call overhead).
#: ``afd bench``'s two-stage rows measure both.
WIDE_QWEN3_MOE: Final[dict[str, int]] = {
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
    "moe_intermediate_size": 1024,
}

#: Bump when anything that changes the produced bytes changes (layout, init, corpus handling).
GENERATOR_VERSION: Final[int] = 2

#: Name suffix and spread of DeepSeek-V3's ``noaux_tc`` routing bias (tiny ``deepseek_v3`` only).
CORRECTION_BIAS_SUFFIX: Final[str] = "mlp.gate.e_score_correction_bias"
CORRECTION_BIAS_STD: Final[float] = 0.25

#: ``draft="accepting"``: the target's decoder layers add their attention and MLP outputs scaled
#: by this (``o_proj`` and every ``down_proj``), so the final hidden state is dominated by the
#: current token's embedding and the next token is nearly a function of the current one.
ACCEPTING_TARGET_SCALE: Final[float] = 0.1
#: ``draft="accepting"``: the same for the draft (MTP) layer's own decoder block.
ACCEPTING_DRAFT_BLOCK_SCALE: Final[float] = 0.1
#: ``draft="accepting"``: scale of ``eh_proj``'s hidden-state half (its embedding half is the
#: identity), so the draft still reads the target's hidden state, a little.
ACCEPTING_HIDDEN_SCALE: Final[float] = 0.1

#: Default cache root; override with ``AFD_TINY_CACHE`` or an explicit ``cache_dir``.
DEFAULT_CACHE_ENV: Final[str] = "AFD_TINY_CACHE"

BOS_TOKEN: Final[str] = "<|bos|>"
EOS_TOKEN: Final[str] = "<|eos|>"
PAD_TOKEN: Final[str] = "<|pad|>"
SPECIAL_TOKENS: Final[tuple[str, ...]] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
TOKENIZER_VOCAB_TARGET: Final[int] = 1024

# A small fixed corpus (written for this project) the BPE tokenizer is trained on.
CORPUS: Final[tuple[str, ...]] = (
    "Attention and feed-forward layers can live in different processes.",
    "The attention side keeps the key-value cache, the scheduler and the sampler.",
    "The expert side holds the routed experts and answers every layer in order.",
    "A mixture of experts sends each token to a few experts chosen by a small gate.",
    "Greedy decoding always picks the token with the highest score.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Numbers like 1, 2, 3, 10, 42, 100 and 2026 appear in plain text too.",
    "Servers start, answer requests over HTTP, and stop when they receive a signal.",
    "Every prompt should produce the same tokens on both deployments.",
    "Small models with random weights are useful for testing the plumbing end to end.",
    "Tokens flow from the attention ranks to the expert ranks and back again.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "In the beginning there was a small model, and it produced strange words.",
    "Weights are loaded once; each role keeps only the part of the model it runs.",
    "Latency, throughput, memory and correctness are measured for every change.",
    "Rivers, mountains, forests and cities are drawn on the old paper map.",
    "She wrote the letter, folded it twice and sent it across the sea.",
    "Parity means identical output tokens, not merely similar text.",
    "The cache directory is keyed by a hash of everything that shapes the files.",
)

#: Prompts used by the E2E tests and ``afd demo``.
DEMO_PROMPTS: Final[tuple[str, ...]] = (
    "The attention side keeps",
    "A mixture of experts",
    "Hello world! How are",
    "def add(a, b):",
    "Rivers, mountains and",
    "Numbers like 42 and",
)


@dataclass(frozen=True)
class TinySpec:
    """What identifies a tiny checkpoint: the model family, the weight seed and the dtype.

    ``mtp_layers`` (``deepseek_v3`` only): DeepSeek's multi-token-prediction layers after the
    decoder layers (``num_nextn_predict_layers``), for speculative decoding with
    ``deepseek_mtp``: each is a full MoE decoder layer plus ``enorm``, ``hnorm``, ``eh_proj`` and
    a shared head, named ``model.layers.<num_hidden_layers + i>.*`` as in DeepSeek's checkpoints.

    ``draft`` (with ``mtp_layers``): ``"random"`` (the default) writes random MTP weights, whose
    guesses the target (nearly) never accepts; ``"accepting"`` writes weights whose drafts the
    target mostly accepts (see :func:`accepting_draft_tensors`): the target's layers are scaled
    down (not zeroed) so it is close to a bigram model, and the draft layer predicts that bigram.
    """

    family: TinyFamily = "qwen3_moe"
    seed: int = 0
    dtype: TinyDType = "float32"
    width: TinyWidth = "tiny"
    mtp_layers: int = 0
    draft: TinyDraft = "random"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"TinySpec.family={self.family!r} is not one of {FAMILIES}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"TinySpec.seed={self.seed!r} must be a non-negative int")
        if self.dtype not in DTYPES:
            raise ValueError(f"TinySpec.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.width not in WIDTHS:
            raise ValueError(f"TinySpec.width={self.width!r} is not one of {WIDTHS}")
        if isinstance(self.mtp_layers, bool) or self.mtp_layers not in (0, 1, 2):
            raise ValueError(f"TinySpec.mtp_layers={self.mtp_layers!r}; allowed: 0, 1 or 2")
        if self.mtp_layers and self.family != "deepseek_v3":
            raise ValueError(
                f"TinySpec.mtp_layers={self.mtp_layers!r} with family={self.family!r}; allowed: "
                "0 (MTP layers are DeepSeek-V3's)"
            )
        if self.draft not in DRAFTS:
            raise ValueError(f"TinySpec.draft={self.draft!r} is not one of {DRAFTS}")
        if self.draft != "random" and not self.mtp_layers:
            raise ValueError(
                f"TinySpec.draft={self.draft!r} with mtp_layers=0; allowed: 'random' (a draft "
                "needs an MTP layer)"
            )
        if self.width != "tiny" and self.family != "qwen3_moe":
            raise ValueError(
                f"TinySpec.width={self.width!r} with family={self.family!r}; allowed: 'tiny' "
                "(the wide checkpoint is a Qwen3-MoE)"
            )


def model_config(spec: TinySpec, vocab_size: int) -> dict[str, Any]:
    """The Hugging Face ``config.json`` content for ``spec`` (plain JSON types only)."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": spec.dtype,
        "torch_dtype": spec.dtype,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "norm_topk_prob": True,
        "num_experts_per_tok": 2,
    }
    if spec.family == "qwen3_moe":
        wide = WIDE_QWEN3_MOE if spec.width == "wide" else {}
        return {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_experts": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "sliding_window": None,
            "use_sliding_window": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            **wide,
        }
    if spec.family == "deepseek_v3":
        return {**_deepseek_v3_config(common), "num_nextn_predict_layers": spec.mtp_layers}
    # DeepSeek-V2 with MLA. The CPU MLA kernel needs kv_lora_rank + qk_rope_head_dim == 576.
    return {
        **common,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "head_dim": 64,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
    }


def _deepseek_v3_config(common: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3 routing at tiny size: ``noaux_tc`` grouped top-k (8 experts in 4 groups of 2,
    the best 2 groups kept) on sigmoid scores plus a non-zero correction bias, renormalised top-2,
    routed scaling 2.5, one shared expert, q_lora, layer 0 dense. MLA as the V2 tiny model
    (kv_lora_rank + qk_rope_head_dim == 576 for the CPU MLA kernel)."""
    return {
        **common,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "head_dim": 64,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
    }


def _moe_layer(config: dict[str, Any], layer: int) -> bool:
    """vLLM's rule for a sparse-MoE decoder layer of ``config`` (a draft layer is one too)."""
    if config["model_type"] == "qwen3_moe":
        step = int(config.get("decoder_sparse_step") or 1)
        mlp_only = config.get("mlp_only_layers") or []
        return layer not in mlp_only and int(config["num_experts"]) > 0 and (layer + 1) % step == 0
    freq = int(config.get("moe_layer_freq") or 1)
    return layer >= int(config["first_k_dense_replace"]) and layer % freq == 0


def _attention_shapes(config: dict[str, Any], p: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's attention tensors: MLA (DeepSeek: ``kv_lora_rank`` set) or grouped-
    query attention (Qwen3-MoE, GLM-4.5: biases with ``attention_bias``, q/k norms for Qwen3-MoE
    and with GLM's ``use_qk_norm``)."""
    h = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    shapes: dict[str, tuple[int, ...]] = {}
    if config.get("kv_lora_rank") is None:
        hd = int(config["head_dim"])
        n_kv = int(config["num_key_value_heads"])
        rows = {"q": n_heads * hd, "k": n_kv * hd, "v": n_kv * hd}
        for x, n in rows.items():
            shapes[p + f"self_attn.{x}_proj.weight"] = (n, h)
            if config.get("attention_bias"):
                shapes[p + f"self_attn.{x}_proj.bias"] = (n,)
        shapes[p + "self_attn.o_proj.weight"] = (h, n_heads * hd)
        if config["model_type"] == "qwen3_moe" or config.get("use_qk_norm"):
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        return shapes
    nope = int(config["qk_nope_head_dim"])
    rope = int(config["qk_rope_head_dim"])
    vh = int(config["v_head_dim"])
    kv_rank = int(config["kv_lora_rank"])
    q_rank = config.get("q_lora_rank")
    if q_rank:
        shapes[p + "self_attn.q_a_proj.weight"] = (int(q_rank), h)
        shapes[p + "self_attn.q_a_layernorm.weight"] = (int(q_rank),)
        shapes[p + "self_attn.q_b_proj.weight"] = (n_heads * (nope + rope), int(q_rank))
    else:
        shapes[p + "self_attn.q_proj.weight"] = (n_heads * (nope + rope), h)
    shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (kv_rank + rope, h)
    shapes[p + "self_attn.kv_a_layernorm.weight"] = (kv_rank,)
    shapes[p + "self_attn.kv_b_proj.weight"] = (n_heads * (nope + vh), kv_rank)
    shapes[p + "self_attn.o_proj.weight"] = (h, n_heads * vh)
    return shapes


def tensor_shapes(
    config: dict[str, Any], *, draft_weights: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its Hugging Face name, with its shape.

    ``draft_weights=False``: none of the draft (MTP) layers that ``num_nextn_predict_layers``
    declares, as transformers and many published derivatives save DeepSeek-V3 checkpoints.
    """
    h = int(config["hidden_size"])
    v = int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    family = config["model_type"]
    n_experts = int(config["num_experts"] if family == "qwen3_moe" else config["n_routed_experts"])
    moe_i = int(config["moe_intermediate_size"])
    dense_i = int(config["intermediate_size"])
    num_hidden = int(config["num_hidden_layers"])
    mtp = int(config.get("num_nextn_predict_layers", 0) or 0) if draft_weights else 0
    for layer in range(num_hidden, num_hidden + mtp):
        # DeepSeek's MTP layer: its own input norms, the projection of [embedding; hidden],
        # a shared head (norm + LM head), a copy of the token embedding (as DeepSeek-V3 and
        # GLM-4.5 ship it), then a decoder layer (added by the loop below).
        p = f"model.layers.{layer}."
        shapes[p + "enorm.weight"] = (h,)
        shapes[p + "hnorm.weight"] = (h,)
        shapes[p + "eh_proj.weight"] = (h, 2 * h)
        shapes[p + "shared_head.norm.weight"] = (h,)
        shapes[p + "shared_head.head.weight"] = (v, h)
        shapes[p + "embed_tokens.weight"] = (v, h)  # a copy of the model's (make_tensor)
    for layer in range(num_hidden + mtp):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(_attention_shapes(config, p))
        if not _moe_layer(config, layer):
            shapes[p + "mlp.gate_proj.weight"] = (dense_i, h)
            shapes[p + "mlp.up_proj.weight"] = (dense_i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, dense_i)
            continue
        shapes[p + "mlp.gate.weight"] = (n_experts, h)
        if config.get("topk_method") == "noaux_tc" or family == "glm4_moe":
            shapes[p + CORRECTION_BIAS_SUFFIX] = (n_experts,)
        for e in range(n_experts):
            q = f"{p}mlp.experts.{e}."
            shapes[q + "gate_proj.weight"] = (moe_i, h)
            shapes[q + "up_proj.weight"] = (moe_i, h)
            shapes[q + "down_proj.weight"] = (h, moe_i)
        si = moe_i * int(config.get("n_shared_experts") or 0)
        si = si or int(config.get("shared_expert_intermediate_size") or 0)
        if si:
            shapes[p + "mlp.shared_experts.gate_proj.weight"] = (si, h)
            shapes[p + "mlp.shared_experts.up_proj.weight"] = (si, h)
            shapes[p + "mlp.shared_experts.down_proj.weight"] = (h, si)
    return shapes


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_tensor(seed: int, name: str, shape: tuple[int, ...], dtype: TinyDType) -> torch.Tensor:
    """One deterministic tensor: norms are ones, embeddings N(0, 1), matrices N(0, 1/fan_in).

    The router (``mlp.gate``) is scaled up 4x so expert choices are decisive (no near-ties).
    DeepSeek-V3's ``e_score_correction_bias`` is float32 N(0, CORRECTION_BIAS_STD**2).
    """
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    if name.endswith(".embed_tokens.weight"):
        name = "model.embed_tokens.weight"  # an MTP layer's copy of the token embedding
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    if name.endswith(CORRECTION_BIAS_SUFFIX):
        # Float32 as in DeepSeek-V3's checkpoints; large enough against sigmoid scores in (0, 1)
        # to change which experts (and groups) are chosen, never added to the routing weights.
        return (CORRECTION_BIAS_STD * torch.randn(shape, generator=gen)).contiguous()
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch_dtype)
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    if name != "model.embed_tokens.weight":
        scale = 1.0 / math.sqrt(shape[-1])
        if name.endswith("mlp.gate.weight"):
            scale *= 4.0
        t = t * scale
    return t.to(torch_dtype).contiguous()


def accepting_draft_tensors(
    config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``tensors`` (a DeepSeek checkpoint with MTP layers) changed so the drafts are accepted.

    vLLM's ``deepseek_mtp`` drafts the token after ``t`` from ``eh_proj([enorm(embed(t));
    hnorm(h)])`` (``h``: the target's hidden state at the previous position) through the MTP
    decoder block and ``shared_head`` (norm, then the LM head). Here:

    * the target's decoder layers write their attention and MLP outputs scaled by
      :data:`ACCEPTING_TARGET_SCALE` (``self_attn.o_proj``, the dense, shared and routed experts'
      ``down_proj``): small but not zero, so the final hidden state is dominated by the current
      token's embedding and the target's next token is nearly ``f(t) = argmax lm_head(norm(
      embed(t)))``, a bigram, while every layer still changes the logits;
    * the MTP layer's ``eh_proj`` is the identity on the embedding half and the random matrix
      scaled by :data:`ACCEPTING_HIDDEN_SCALE` on the hidden half; its own block's output
      projections are scaled by :data:`ACCEPTING_DRAFT_BLOCK_SCALE`; ``shared_head.head`` is a
      copy of ``lm_head`` (the norms are all ones, as ``model.norm``): the draft predicts ``f(t)``
      too, up to both sides' small perturbations, so most drafts but not all are accepted.
    """
    h = int(config["hidden_size"])
    num_hidden = int(config["num_hidden_layers"])
    mtp = int(config.get("num_nextn_predict_layers") or 0)
    out = dict(tensors)

    def scaled(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (t.to(torch.float32) * scale).to(t.dtype).contiguous()

    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            layer = int(name.split(".")[2])
            out[name] = scaled(
                t, ACCEPTING_TARGET_SCALE if layer < num_hidden else ACCEPTING_DRAFT_BLOCK_SCALE
            )
    for layer in range(num_hidden, num_hidden + mtp):
        p = f"model.layers.{layer}."
        eh = tensors[p + "eh_proj.weight"]
        eye = torch.eye(h, dtype=torch.float32).to(eh.dtype)
        out[p + "eh_proj.weight"] = torch.cat(
            [eye, scaled(eh[:, h:], ACCEPTING_HIDDEN_SCALE)], dim=1
        ).contiguous()
        out[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out


def build_tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer on :data:`CORPUS`; returns ``tokenizer.json`` text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    text: str = tok.to_str(pretty=True)
    return text


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }


def _dump_json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _vocab_size(tokenizer_json: str) -> int:
    data = json.loads(tokenizer_json)
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data["added_tokens"]]
    return max(ids) + 1


def _special_ids(tokenizer_json: str) -> dict[str, int]:
    data = json.loads(tokenizer_json)
    return {t["content"]: int(t["id"]) for t in data["added_tokens"]}


def _iter_files(spec: TinySpec) -> Iterator[tuple[str, bytes]]:
    """Yield ``(file name, bytes)`` for every file of the checkpoint, deterministically."""
    tokenizer_json = build_tokenizer_json()
    config = model_config(spec, _vocab_size(tokenizer_json))
    yield from checkpoint_files(config, tokenizer_json, spec.seed, spec.dtype, draft=spec.draft)


def checkpoint_files(
    config: dict[str, Any],
    tokenizer_json: str,
    seed: int,
    dtype: TinyDType,
    *,
    draft_weights: bool = True,
    draft: TinyDraft = "random",
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(file name, bytes)`` of a checkpoint of ``config`` (the token ids it states set to
    the tokenizer's special tokens), the tokenizer and random weights of ``seed`` in ``dtype`` (see
    :func:`tensor_shapes` for ``draft_weights``; ``draft="accepting"``: changed by
    :func:`accepting_draft_tensors`), deterministically."""
    from safetensors.torch import save

    specials = _special_ids(tokenizer_json)
    token_ids = {"bos_token_id": BOS_TOKEN, "eos_token_id": EOS_TOKEN, "pad_token_id": PAD_TOKEN}
    config = dict(config)
    for key, token in token_ids.items():
        if key in config:
            config[key] = specials[token]
    shapes = tensor_shapes(config, draft_weights=draft_weights)
    tensors = {n: make_tensor(seed, n, shapes[n], dtype) for n in sorted(shapes)}
    if draft == "accepting":
        tensors = accepting_draft_tensors(config, tensors)
    yield "config.json", _dump_json(config).encode()
    generation = {key: config[key] for key in token_ids if key in config} | {"do_sample": False}
    yield "generation_config.json", _dump_json(generation).encode()
    yield "tokenizer.json", tokenizer_json.encode()
    yield "tokenizer_config.json", _dump_json(_tokenizer_config()).encode()
    yield (
        "special_tokens_map.json",
        _dump_json(
            {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        ).encode(),
    )
    yield "model.safetensors", save(tensors, metadata={"format": "pt"})


def spec_hash(spec: TinySpec) -> str:
    """Content hash of everything that shapes the files (hex, 16 chars)."""
    payload = {
        "generator_version": GENERATOR_VERSION,
        "spec": {"family": spec.family, "seed": spec.seed, "dtype": spec.dtype}
        | ({"width": spec.width} if spec.width != "tiny" else {})
        | ({"mtp_layers": spec.mtp_layers} if spec.mtp_layers else {})
        | ({"draft": spec.draft} if spec.draft != "random" else {}),
        "config": model_config(spec, 0),
        "corpus": list(CORPUS),
        "special_tokens": list(SPECIAL_TOKENS),
        "vocab_target": TOKENIZER_VOCAB_TARGET,
        "tokenizer": _tokenizer_config(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def write_tiny_checkpoint(spec: TinySpec, out_dir: Path) -> Path:
    """Write the checkpoint for ``spec`` into ``out_dir`` (created; must not hold a checkpoint).

    Raises ``FileExistsError`` naming ``out_dir`` if it already contains ``config.json``.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        raise FileExistsError(f"out_dir={str(out_dir)!r} already holds a checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in _iter_files(spec):
        (out_dir / name).write_bytes(data)
    return out_dir


def default_cache_dir() -> Path:
    """``$AFD_TINY_CACHE`` if set, else ``~/.cache/afd/tiny``."""
    env = os.environ.get(DEFAULT_CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "afd" / "tiny"


def ensure_tiny_checkpoint(spec: TinySpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the cached checkpoint directory for ``spec``, building it on first use.

    The directory is ``<cache_dir>/<family>-s<seed>-<dtype>-<hash>`` (see
    :func:`ensure_cached_checkpoint`).
    """
    spec = spec or TinySpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    width = "" if spec.width == "tiny" else f"-{spec.width}"
    width += f"-mtp{spec.mtp_layers}" if spec.mtp_layers else ""
    width += f"-{spec.draft}" if spec.draft != "random" else ""
    name = f"{spec.family}{width}-s{spec.seed}-{spec.dtype}-{spec_hash(spec)}"
    return ensure_cached_checkpoint(root / name, lambda: _iter_files(spec))


def ensure_cached_checkpoint(
    target: Path, files: Callable[[], Iterable[tuple[str, bytes]]]
) -> Path:
    """``target`` holding the checkpoint ``files()`` yields, written on first use.

    The files are written to a temporary sibling and renamed into place, so concurrent callers
    either see a complete checkpoint or build their own copy (the loser's copy is discarded).
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for name, data in files():
            (tmp / name).write_bytes(data)
        tmp.chmod(0o755)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def checkpoint_digest(path: Path) -> str:
    """SHA-256 over every file of a checkpoint directory (names and bytes, sorted)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()
