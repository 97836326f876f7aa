"""Process groups of the P2P connector: the backend a device needs and standalone groups.

The connector never uses torch's default group nor vLLM's: :func:`make_process_group` builds a
group on the connector's own store (one Gloo *control* group, one *data* group whose backend
:func:`backend_for_device` picks from the device type).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from afd_core.errors import AFDConfigError

__all__ = ["backend_for_device", "make_process_group"]

_BACKENDS: Mapping[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_LONG_WAIT = timedelta(days=30)  # the control group's timeout; recv_control(timeout_s=math.inf)


def backend_for_device(device: torch.device | str) -> str:
    """The torch.distributed backend for tensors on ``device`` (cpu: gloo, cuda: nccl, npu: hccl)."""
    # Parse strings by hand: "npu" is only a torch device type once torch_npu is imported.
    kind = device.split(":", 1)[0].strip() if isinstance(device, str) else device.type
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise AFDConfigError(
            "device", str(device), f"a device of type {sorted(_BACKENDS)}"
        ) from None


def make_process_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    *,
    bind_address: str | None = None,
) -> Any:
    """A standalone process group (not registered as torch's default group).

    gloo: with ``bind_address`` its device (and so its listening socket) is created on that
    address only (see :func:`afd_core.session.access.local_address`)."""
    if backend == "gloo":
        if bind_address is None:
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        gopts._timeout = timeout
        gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_address)]
        return dist.ProcessGroupGloo(store, rank, world_size, gopts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if backend == "hccl":  # pragma: no cover - needs torch_npu
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        hopts = ProcessGroupHCCL.Options()
        hopts._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, hopts)
    raise AFDConfigError("backend", backend, f"one of {sorted(set(_BACKENDS.values()))}")
