"""The workload and the numeric options a prediction takes: lengths, KV and weight formats,
routing statistics.

Quantization schemes (:data:`QUANT_SCHEMES`): weight bytes per parameter and the GEMM dtype.

========  =========================  ==============
scheme    bytes per weight           GEMM dtype
========  =========================  ==============
``none``  the model's dtype (bf16:2)  bf16 (fp32 for fp32 models)
``w8a8``  1                          int8
``w4a8``  0.5                        int8
========  =========================  ==============

Scales (one FP32 per output channel, or per group) are left out: under 0.2 % of the bytes at
``hidden >= 2048`` (afd-compute-npu measures W8A8 at 0.500x and W4A8 per channel at 0.252x bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from afd_plan.errors import AFDPlanError
from afd_plan.shape import DTYPE_BYTES, ModelShape

__all__ = ["KV_DTYPES", "QUANT_SCHEMES", "ROUTINGS", "Workload"]

QUANT_SCHEMES: Final[tuple[str, ...]] = ("none", "w8a8", "w4a8")
#: KV-cache element formats: bytes per element.
KV_DTYPES: Final[dict[str, float]] = {
    "model": 0.0,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int8": 1,
}
#: ``uniform``: each token picks ``top_k`` of ``E`` experts independently at random;
#: ``balanced``: forced balance, every expert gets exactly ``tokens * top_k / E`` tokens.
ROUTINGS: Final[tuple[str, ...]] = ("uniform", "balanced")


@dataclass(frozen=True)
class Workload:
    """Decode workload and formats.

    * ``input_len`` / ``output_len``: tokens per request. Decode cost is taken at the mean cached
      context ``input_len + output_len / 2``; memory at the full ``input_len + output_len``.
    * ``kv_dtype``: a key of :data:`KV_DTYPES` (``model``: the model's dtype).
    * ``dense_quant``: the scheme of every non-expert linear weight (attention projections,
      dense MLPs, shared experts); embeddings and the LM head stay in the model's dtype.
    * ``routing``: a key of :data:`ROUTINGS`; ``expert_skew >= 1``: the hottest FFN rank's load
      over the mean (1 = none; a measured skew enters here).
    """

    input_len: int = 1024
    output_len: int = 256
    kv_dtype: str = "model"
    dense_quant: str = "none"
    routing: str = "uniform"
    expert_skew: float = 1.0

    def __post_init__(self) -> None:
        if (
            isinstance(self.input_len, bool)
            or not isinstance(self.input_len, int)
            or self.input_len < 1
        ):
            raise AFDPlanError("input_len", self.input_len, "an integer >= 1")
        if (
            isinstance(self.output_len, bool)
            or not isinstance(self.output_len, int)
            or self.output_len < 1
        ):
            raise AFDPlanError("output_len", self.output_len, "an integer >= 1")
        if self.kv_dtype not in KV_DTYPES:
            raise AFDPlanError("kv_dtype", self.kv_dtype, f"one of {', '.join(KV_DTYPES)}")
        if self.dense_quant not in QUANT_SCHEMES:
            raise AFDPlanError(
                "dense_quant", self.dense_quant, f"one of {', '.join(QUANT_SCHEMES)}"
            )
        if self.routing not in ROUTINGS:
            raise AFDPlanError("routing", self.routing, f"one of {', '.join(ROUTINGS)}")
        if not self.expert_skew >= 1.0:
            raise AFDPlanError("expert_skew", self.expert_skew, "a number >= 1 (1 = balanced)")

    @property
    def mean_context(self) -> float:
        return self.input_len + self.output_len / 2

    @property
    def max_context(self) -> int:
        return self.input_len + self.output_len

    def kv_bytes(self, shape: ModelShape) -> float:
        """Bytes per KV-cache element."""
        return shape.dtype_bytes if self.kv_dtype == "model" else KV_DTYPES[self.kv_dtype]


def weight_bytes(scheme: str, shape: ModelShape) -> float:
    """Bytes per weight parameter under ``scheme`` (table in the module docstring)."""
    if scheme not in QUANT_SCHEMES:
        raise AFDPlanError("expert_quant", scheme, f"one of {', '.join(QUANT_SCHEMES)}")
    return {"none": float(DTYPE_BYTES[shape.dtype]), "w8a8": 1.0, "w4a8": 0.5}[scheme]


def gemm_dtype(scheme: str, shape: ModelShape) -> str:
    """The compute dtype of GEMMs on weights in ``scheme``."""
    if scheme != "none":
        return "int8"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[shape.dtype]
