"""Attention-side remote FFN proxy, AFDAttentionFusedMoE and routed TP padding.

Importing this package imports none of vLLM; connectors are taken from the AFD forward metadata
(``afd_core.forward_context``), never imported.

* :class:`RemoteFFNProxy` -- parameter-free FFN stand-in: send -> DBO yield -> receive, plus the
  :meth:`~RemoteFFNProxy.dispatch` / :meth:`~RemoteFFNProxy.receive` split.
* :class:`AFDAttentionFusedMoE` -- MoE experts stand-in for both gate placements.
* :mod:`afd_remote.expert_dispatch` -- expert parallelism: which tokens go to which FFN rank
  and how the partial outputs combine (fixed FFN-rank order).
* :class:`RoutedTPPadding` and the pure functions of :mod:`afd_remote.routed_padding` -- each
  replicated token is dispatched by exactly one TP rank and the output is all-gathered back.
"""

from importlib.metadata import version as _version

from afd_remote.errors import AFDRemoteError, UnsupportedPayloadFieldError
from afd_remote.expert_dispatch import (
    ExpertDispatchPlan,
    combine_expert_outputs,
    plan_expert_dispatch,
    plan_home_dispatch,
    split_for_dispatch,
)
from afd_remote.fused_moe import AFDAttentionFusedMoE
from afd_remote.proxy import RemoteFFNProxy, RemoteFFNTransfer
from afd_remote.routed_padding import (
    RoutedDispatchLayout,
    RoutedTPPadding,
    plan_routed_dispatch,
    restore_dispatched_output,
    slice_for_dispatch,
)
from afd_remote.routing import RoutingFunction, softmax_topk

__version__ = _version("afd-remote")

__all__ = [
    "AFDAttentionFusedMoE",
    "AFDRemoteError",
    "ExpertDispatchPlan",
    "RemoteFFNProxy",
    "RemoteFFNTransfer",
    "RoutedDispatchLayout",
    "RoutedTPPadding",
    "RoutingFunction",
    "UnsupportedPayloadFieldError",
    "__version__",
    "combine_expert_outputs",
    "plan_expert_dispatch",
    "plan_home_dispatch",
    "plan_routed_dispatch",
    "restore_dispatched_output",
    "slice_for_dispatch",
    "softmax_topk",
    "split_for_dispatch",
]
