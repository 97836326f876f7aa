"""AFD workers for vLLM's CUDA platform (same role logic as CPU; not exercised in CI)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from afd_runtime.workers.base import AFDAttentionWorkerMixin, AFDFFNWorkerMixin


class AFDGPUAttentionWorker(AFDAttentionWorkerMixin, Worker):
    """CUDA attention role worker."""


class AFDGPUFFNWorker(AFDFFNWorkerMixin, Worker):
    """CUDA FFN role worker."""
