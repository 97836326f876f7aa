"""AFD workers per platform and the platform -> worker selection table.

Worker modules import vLLM (and, for Ascend, vllm-ascend) at import time; this package's
``__init__`` does not, so :func:`afd_worker_qualname` works anywhere.
"""

from __future__ import annotations

from typing import Final

from afd_core.errors import AFDConfigError

#: vLLM platform default worker -> (attention worker, ffn worker) qualnames.
AFD_WORKERS: Final[dict[str, tuple[str, str]]] = {
    "vllm.v1.worker.cpu_worker.CPUWorker": (
        "afd_runtime.workers.cpu.AFDCPUAttentionWorker",
        "afd_runtime.workers.cpu.AFDCPUFFNWorker",
    ),
    "vllm.v1.worker.gpu_worker.Worker": (
        "afd_runtime.workers.gpu.AFDGPUAttentionWorker",
        "afd_runtime.workers.gpu.AFDGPUFFNWorker",
    ),
    "vllm_ascend.worker.worker.NPUWorker": (
        "afd_runtime.workers.npu.AFDNPUAttentionWorker",
        "afd_runtime.workers.npu.AFDNPUFFNWorker",
    ),
}


def afd_worker_qualname(role: str, platform_worker: str) -> str:
    """The AFD worker for ``role`` on the platform whose default worker is ``platform_worker``.

    An AFD worker passed back in (already selected) is returned unchanged. Raises ``AFDConfigError``
    naming ``parallel_config.worker_cls`` for a platform without AFD workers.
    """
    if role not in ("attention", "ffn"):
        raise AFDConfigError("role", role, "'attention', 'ffn'")
    normalized = platform_worker.replace(":", ".")
    idx = 0 if role == "attention" else 1
    for pair in AFD_WORKERS.values():
        if normalized == pair[idx]:
            return normalized
    if normalized not in AFD_WORKERS:
        raise AFDConfigError(
            "parallel_config.worker_cls",
            platform_worker,
            f"platform workers: {sorted(AFD_WORKERS)} (leave --worker-cls unset)",
            detail=f"no AFD {role} worker for it",
        )
    return AFD_WORKERS[normalized][idx]
