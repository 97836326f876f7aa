"""Binding a compute to the connector's communicator (Mega's ``group_name``).

A compute that moves rows itself (afd-compute-npu's Mega: ``dispatch_ffn_combine``) is handed the
name of the communicator behind the connector's group of the FFN ranks
(``ffn_process_group()``: the rows Mega dispatches and combines move among the FFN ranks), as
the platform's collective library knows it:

* HCCL (torch-npu): ``get_hccl_comm_name(rank)`` of the group's HCCL backend: the P2P connector
  builds its groups as that backend (``ProcessGroupHCCL``) and it is asked directly; a
  registered torch.distributed group is asked through ``_get_backend(npu)``, the way
  vllm-ascend derives it for its MC2 and MegaMoe groups;
* a group registered with torch.distributed on any other backend: torch.distributed's name;
* a standalone gloo or NCCL group (the P2P connector's on CPU and CUDA) has no named
  communicator: the connector's own label of the group stands in (``ffn_group_info().name``).

The bind happens between the connector's ``open_groups()`` and ``confirm_ready()`` (the order the
upstream refactor gives it: the groups exist, the peers are not yet told this rank is ready); a
failure is published to every peer in stage ``bind`` before this rank's start fails with
:class:`AFDCommBindError` (see :mod:`afd_runtime.ffn_service`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from afd_core.errors import AFDFieldError

__all__ = ["AFDCommBindError", "communicator_name"]


class AFDCommBindError(AFDFieldError):
    """A compute could not be bound to the connector's communicator (published to the peers in
    stage ``bind``; retrying the same start fails the same way)."""

    subject = "AFD communication binding"


def _npu_device() -> Any:
    """``torch.device("npu")`` (torch-npu registers the type; a real HCCL group implies it is
    loaded), else the bare type name (a process without torch-npu: contract tests' stand-ins)."""
    try:
        return torch.device("npu")
    except RuntimeError:
        return "npu"


def communicator_name(group: Any, rank: int, label: str) -> str:
    """The name of the communicator behind ``group`` for world rank ``rank`` (see the module);
    ``label``: the connector's label of the group, for groups without a named communicator.

    Raises:
        AFDCommBindError: ``group`` is not a torch.distributed group or backend, or its HCCL
            backend gives no name.
    """
    backend_name = getattr(group, "name", None)
    if not callable(backend_name):
        raise AFDCommBindError(
            "ffn_process_group", type(group).__name__, "a torch.distributed group or backend"
        )
    backend = str(backend_name()).lower()
    name: Any
    if hasattr(group, "get_hccl_comm_name"):  # torch-npu's ProcessGroupHCCL backend itself
        name = group.get_hccl_comm_name(rank)
    elif backend == "hccl" and hasattr(group, "_get_backend"):  # a registered HCCL group
        name = group._get_backend(_npu_device()).get_hccl_comm_name(rank)
    elif isinstance(group, dist.ProcessGroup):
        name = dist.distributed_c10d._get_process_group_name(group)
    else:
        return label
    if not isinstance(name, str) or not name:
        raise AFDCommBindError(
            "group_name", name, f"a non-empty communicator name from the {backend} backend"
        )
    return name
