"""AFD workers for vLLM's CPU platform."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from afd_runtime.workers.base import AFDAttentionWorkerMixin, AFDFFNWorkerMixin


class AFDCPUAttentionWorker(AFDAttentionWorkerMixin, CPUWorker):
    """CPU attention role worker."""


class AFDCPUFFNWorker(AFDFFNWorkerMixin, CPUWorker):
    """CPU FFN role worker."""
