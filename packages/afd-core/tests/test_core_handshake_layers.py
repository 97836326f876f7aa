"""The handshake's layer rule: the target model's layers match on every rank; draft (speculative,
e.g. DeepSeek MTP) layers match within a role, and across roles an Attention rank may draft only
through draft layers its FFN ranks serve. An FFN serving a checkpoint's draft layers beside an
Attention role that does not draft is a valid deployment (the layers go unused); an FFN whose
checkpoint shipped no draft-layer weights, beside an Attention role that drafts, is refused on
both sides, naming ``num_draft_layers`` and the checkpoint field ``num_nextn_predict_layers``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDHandshakeError
from afd_core.metadata import AFDPayloadSpec
from afd_core.session.handshake import _compare_handshake

SPEC = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
TARGET_LAYERS = 4


def fields(role: AFDRole, draft: int, target: int = TARGET_LAYERS) -> dict[str, Any]:
    conn = P2PConnector(
        AFDConfig(role=role),
        payload_spec=SPEC,
        num_layers=target + draft,
        num_draft_layers=draft,
    )
    return conn.handshake_fields()


def refusal(mine: dict[str, Any], theirs: dict[str, Any]) -> AFDHandshakeError:
    with pytest.raises(AFDHandshakeError) as info:
        _compare_handshake(mine, theirs, 1)
    return info.value


@pytest.mark.parametrize(("attention_draft", "ffn_draft"), [(0, 0), (0, 1), (1, 1)])
def test_an_attention_role_drafting_only_through_served_layers_is_accepted_both_ways(
    attention_draft: int, ffn_draft: int
) -> None:
    attention = fields(AFDRole.ATTENTION, attention_draft)
    ffn = fields(AFDRole.FFN, ffn_draft)
    _compare_handshake(attention, ffn, 1)
    _compare_handshake(ffn, attention, 0)


def test_drafting_through_layers_the_ffn_does_not_serve_is_refused_on_both_sides() -> None:
    attention = fields(AFDRole.ATTENTION, 1)
    ffn = fields(AFDRole.FFN, 0)
    for mine, theirs in ((attention, ffn), (ffn, attention)):
        err = refusal(mine, theirs)
        assert err.field == "num_draft_layers"
        assert (err.local, err.remote) == (mine["num_draft_layers"], theirs["num_draft_layers"])
        assert "num_nextn_predict_layers" in str(err) and "--speculative-config" in str(err)


@pytest.mark.parametrize("role", [AFDRole.ATTENTION, AFDRole.FFN])
def test_ranks_of_one_role_must_serve_the_same_draft_layers(role: AFDRole) -> None:
    err = refusal(fields(role, 1), fields(role, 0))
    assert err.field == "num_draft_layers" and (err.local, err.remote) == (1, 0)
    assert "num_nextn_predict_layers" not in str(err)


def test_the_target_layers_must_match_whatever_the_draft_layers() -> None:
    # Same total layer count, different split: the target models differ.
    err = refusal(fields(AFDRole.ATTENTION, 0, target=5), fields(AFDRole.FFN, 1))
    assert err.field == "num_layers" and (err.local, err.remote) == (5, TARGET_LAYERS)
