"""Quantized expert-weight contract (W8A8/W4A8), quantizers and packers, layout validation,
geometry, graph signatures and weight accounting.

Public API (all importable from ``afd_weights``): :class:`QuantScheme`,
:class:`ExpertLayerTensors`, :class:`QuantizedExpertWeights`, :class:`ExpertGeometry`,
:class:`GraphSignature`, :class:`TensorLayout`, the packers in :mod:`afd_weights.packing`, the
quantizers in :mod:`afd_weights.quantize`, the exporters in :mod:`afd_weights.export`, the
decoders in :mod:`afd_weights.codes` and :func:`param_bytes` (:mod:`afd_weights.accounting`: bytes
of a module's parameters, shared tensors counted once).
"""

from importlib.metadata import version as _version

from afd_weights.accounting import param_bytes
from afd_weights.codes import LayerCodes, dequantize_layer, layer_codes
from afd_weights.contract import QuantizedExpertWeights, expected_layer_spec
from afd_weights.errors import QuantizationError, WeightLayoutError, WeightsError
from afd_weights.export import (
    export_fused_moe_layer,
    export_fused_moe_tensors,
    export_quantized_expert_weights,
)
from afd_weights.geometry import ExpertGeometry
from afd_weights.layer import TENSOR_NAMES, ExpertLayerTensors
from afd_weights.layout import TensorLayout, layout_of
from afd_weights.packing import (
    decode_scale_int64,
    encode_scale_int64,
    pack_int4,
    pack_int4_to_int32,
    unpack_int4,
    unpack_int4_from_int32,
)
from afd_weights.quantize import (
    int4_scale_bias,
    quantize_int4_per_channel,
    quantize_int4_per_group,
    quantize_int8_per_channel,
)
from afd_weights.scheme import QuantScheme
from afd_weights.signature import GraphSignature

__version__ = _version("afd-weights")

__all__ = [
    "TENSOR_NAMES",
    "ExpertGeometry",
    "ExpertLayerTensors",
    "GraphSignature",
    "LayerCodes",
    "QuantScheme",
    "QuantizationError",
    "QuantizedExpertWeights",
    "TensorLayout",
    "WeightLayoutError",
    "WeightsError",
    "__version__",
    "decode_scale_int64",
    "dequantize_layer",
    "encode_scale_int64",
    "expected_layer_spec",
    "export_fused_moe_layer",
    "export_fused_moe_tensors",
    "export_quantized_expert_weights",
    "int4_scale_bias",
    "layer_codes",
    "layout_of",
    "pack_int4",
    "pack_int4_to_int32",
    "param_bytes",
    "quantize_int4_per_channel",
    "quantize_int4_per_group",
    "quantize_int8_per_channel",
    "unpack_int4",
    "unpack_int4_from_int32",
]
