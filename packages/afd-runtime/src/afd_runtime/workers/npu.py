"""AFD workers for vllm-ascend's NPU platform (needs vllm-ascend; not exercised in CI)."""

from __future__ import annotations

from vllm_ascend.worker.worker import NPUWorker

from afd_runtime.workers.base import AFDAttentionWorkerMixin, AFDFFNWorkerMixin


class AFDNPUAttentionWorker(AFDAttentionWorkerMixin, NPUWorker):
    """Ascend attention role worker."""


class AFDNPUFFNWorker(AFDFFNWorkerMixin, NPUWorker):
    """Ascend FFN role worker."""
