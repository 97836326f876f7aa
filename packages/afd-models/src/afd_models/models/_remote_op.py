"""The ``afd::remote_ffn`` custom ops: an AFD Attention block's call into the FFN role.

``afd::remote_ffn`` sends hidden states (+ router logits) to the one FFN rank;
``afd::remote_ffn_ids`` also sends the tokens' ids (token-id routing, DeepSeek-V4's hash layers);
``afd::remote_ffn_routed`` (expert parallelism) dispatches tokens by their top-k to the FFN ranks
holding those experts and combines the partial outputs.

The op wraps afd-remote's :class:`afd_remote.fused_moe.AFDAttentionFusedMoE` (the connector comes
from the AFD forward metadata the runtime installs around every forward). Being a
``torch.library`` custom op keeps the exchange opaque to Dynamo/Inductor, so a compiled model
traces as upstream everywhere else; the fake implementation returns ``empty_like(hidden)``.

Every op is one dispatch, then :meth:`afd_remote.proxy.RemoteFFNProxy.complete`: it yields
(:func:`afd_core.forward_context.dbo_yield`: with two stages the other stage computes its
attention while this round trip is in flight) and receives; a yield that fails (the other stage
of the step failed) drops the transfer unreceived.

Tensor-parallel Attention (``--tensor-parallel-size`` T > 1): every TP worker holds the same
tokens, so each proxy gets afd-remote's routed TP padding bound to vLLM's TP group (worker ``r``
sends rows ``[r * ceil(N/T), (r + 1) * ceil(N/T))`` clipped to ``N``, the outputs are
all-gathered in TP rank order) and every real token reaches the FFN role exactly once.

Invariants: never mutates or aliases its inputs; one parameter-free proxy per (layer, gate side).
"""

from __future__ import annotations

import threading

import torch
from afd_remote.fused_moe import AFDAttentionFusedMoE
from afd_remote.routed_padding import RoutedTPPadding

_PROXIES: dict[tuple[int, bool], AFDAttentionFusedMoE] = {}
_LOCK = threading.Lock()


def proxy_for(layer_idx: int, gate_on_attention: bool) -> AFDAttentionFusedMoE:
    """The (cached) afd-remote proxy of one MoE layer."""
    key = (layer_idx, gate_on_attention)
    with _LOCK:
        proxy = _PROXIES.get(key)
        if proxy is None:
            proxy = _PROXIES[key] = AFDAttentionFusedMoE(
                layer_idx, gate_on_attention=gate_on_attention, tp_padding=tp_padding()
            )
    return proxy


def tp_world_size() -> int:
    """vLLM's tensor-parallel size in this worker (1 when vLLM's groups are not set up)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return int(parallel_state.get_tensor_model_parallel_world_size())


def tp_padding() -> RoutedTPPadding | None:
    """Routed TP padding over vLLM's TP group when this worker is one of several TP workers."""
    if tp_world_size() == 1:
        return None
    from vllm.distributed import parallel_state

    return RoutedTPPadding(parallel_state.get_tp_group().device_group)


@torch.library.custom_op("afd::remote_ffn", mutates_args=())
def remote_ffn(
    hidden_states: torch.Tensor, router_logits: torch.Tensor | None, layer_idx: int
) -> torch.Tensor:
    """Send one MoE layer's inputs to the FFN role and return its routed-expert output."""
    proxy = proxy_for(layer_idx, router_logits is not None)
    return proxy.complete(proxy.dispatch_experts(hidden_states, router_logits))


@remote_ffn.register_fake
def _remote_ffn_fake(
    hidden_states: torch.Tensor, router_logits: torch.Tensor | None, layer_idx: int
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


@torch.library.custom_op("afd::remote_ffn_ids", mutates_args=())
def remote_ffn_ids(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    input_ids: torch.Tensor,
    layer_idx: int,
) -> torch.Tensor:
    """Token-id routed layers (DeepSeek-V4 hash MoE): as ``afd::remote_ffn``, the tokens' ids
    sent with the rows (the connector's payload spec carries ``input_ids``)."""
    proxy = proxy_for(layer_idx, router_logits is not None)
    return proxy.complete(proxy.dispatch_experts(hidden_states, router_logits, input_ids))


@remote_ffn_ids.register_fake
def _remote_ffn_ids_fake(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    input_ids: torch.Tensor,
    layer_idx: int,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


@torch.library.custom_op("afd::remote_ffn_routed", mutates_args=())
def remote_ffn_routed(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    num_experts: int,
) -> torch.Tensor:
    """Expert parallel: dispatch one MoE layer's tokens to the FFN ranks holding their top-k
    experts (routed on this role by the model's router) and return the combined output."""
    proxy = proxy_for(layer_idx, True)
    transfer = proxy.dispatch_routed(hidden_states, topk_weights, topk_ids, num_experts)
    return proxy.complete(transfer)


@remote_ffn_routed.register_fake
def _remote_ffn_routed_fake(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer_idx: int,
    num_experts: int,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)
