"""The registered P2P connector class and its ``connector_extra_config`` keys.

:class:`P2PConnector` puts the two roles' operations together (:mod:`afd_core.connector.p2p.attention`,
:mod:`afd_core.connector.p2p.ffn`) on the shared state and lifecycle of
:mod:`afd_core.connector.p2p.lifecycle`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from afd_core.connector.p2p.attention import _AttentionSide
from afd_core.connector.p2p.ffn import _FFNSide
from afd_core.errors import AFDConfigError

__all__ = ["P2PConnector"]

_BOOL_KEYS = frozenset({"check_sequence", "recv_ahead", "reuse_buffers"})
_INT_KEYS = frozenset({"recv_ahead_bytes"})
_EXTRA_KEYS = _BOOL_KEYS | _INT_KEYS


class P2PConnector(_AttentionSide, _FFNSide):
    """Point-to-point AFD connector on torch.distributed (see :mod:`afd_core.connector.p2p`)."""

    name = "p2p"
    has_control_plane = True

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        """Accepted keys (all bool):

        * ``check_sequence`` (default false): send the 3-word header (layer, stage, tokens) before
          every transfer with one FFN rank too (with several it always travels) and verify it on
          the FFN side (catches out-of-order calls).
        * ``recv_ahead`` (default true): the FFN side posts each stage's next receives early (see
          :mod:`afd_core.connector.p2p`). Set false for call patterns where a step ends before layer
          ``num_layers - 1`` and the next step changes that stage's token counts.
        * ``recv_ahead_bytes`` (int >= 0, default :data:`~afd_core.connector.p2p.RECV_AHEAD_BYTES`,
          2 MiB): how many of a stage's receives per served Attention rank the FFN side keeps
          posted ahead: as many transfers as fit in these bytes (at most the layers left in the
          step), none for a transfer larger than this (it is received into the buffer its caller
          just released, which is still in cache, and the notice round trip is small beside its
          transfer).
        * ``reuse_buffers`` (default false): receive into buffers kept by the connector (three
          per stage, peer and field, used in turn: stable addresses) instead of recycled ones
          (see :mod:`afd_core.buffers`). A returned tensor is then only valid until the next
          receive call of the same stage returns (Attention side: until the next
          ``recv_combine`` of that stage returns): consume or copy it before.
        """
        out: dict[str, Any] = {}
        for key, value in extra.items():
            if key in _BOOL_KEYS:
                if not isinstance(value, bool):
                    raise AFDConfigError(f"connector_extra_config.{key}", value, "a bool")
                out[key] = value
            elif key in _INT_KEYS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise AFDConfigError(
                        f"connector_extra_config.{key}", value, "an int >= 0 (bytes)"
                    )
                out[key] = value
            else:
                raise AFDConfigError(
                    f"connector_extra_config.{key}",
                    value,
                    f"keys among {sorted(_EXTRA_KEYS)} for connector 'p2p'",
                )
        return out
