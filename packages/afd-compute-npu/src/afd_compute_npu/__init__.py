"""Layered and Mega FFN expert compute with reference (torch) and Ascend native backends.

Public API: :class:`LayeredCompute`, :class:`MegaCompute`, :class:`ComputeConfig`,
:class:`MegaCommParams`, :class:`ComputeWorkspace`, :class:`ComputeGraphSignature`, the backends
:class:`ReferenceBackend` and :class:`AscendBackend` (torch_npu loaded lazily), the fp32 yardstick
:func:`fp32_dequantized_moe`, Mega's exchange over a torch.distributed group
(:func:`combine_over_group`) and the error types.
"""

from importlib.metadata import version as _version

from afd_compute_npu.ascend import AscendBackend, AscendNativeOps, load_ascend_native_ops
from afd_compute_npu.backend import ComputeBackend, ComputeKind
from afd_compute_npu.config import ComputeConfig, MegaCommParams
from afd_compute_npu.errors import (
    BackendUnavailableError,
    ComputeConfigError,
    ComputeError,
    ComputeInputError,
    MegaNotBoundError,
)
from afd_compute_npu.fp32_moe import FP32_TOLERANCE, fp32_dequantized_moe
from afd_compute_npu.group_exchange import combine_over_group
from afd_compute_npu.layered import LayeredCompute
from afd_compute_npu.mega import MegaCompute
from afd_compute_npu.reference import reference_moe
from afd_compute_npu.reference_backend import ReferenceBackend
from afd_compute_npu.signature import ComputeGraphSignature
from afd_compute_npu.workspace import ComputeWorkspace

__version__ = _version("afd-compute-npu")

__all__ = [
    "FP32_TOLERANCE",
    "AscendBackend",
    "AscendNativeOps",
    "BackendUnavailableError",
    "ComputeBackend",
    "ComputeConfig",
    "ComputeConfigError",
    "ComputeError",
    "ComputeGraphSignature",
    "ComputeInputError",
    "ComputeKind",
    "ComputeWorkspace",
    "LayeredCompute",
    "MegaCommParams",
    "MegaCompute",
    "MegaNotBoundError",
    "ReferenceBackend",
    "__version__",
    "combine_over_group",
    "fp32_dequantized_moe",
    "load_ascend_native_ops",
    "reference_moe",
]
