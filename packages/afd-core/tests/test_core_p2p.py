"""P2PConnector: multi-process round trips (gloo, CPU), handshake, validation, failures, re-init."""

from __future__ import annotations

import collections
import errno
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig, AFDConfigError, AFDRole
from afd_core.connector.p2p import (
    PROTOCOL_VERSION,
    RECV_AHEAD_BYTES,
    P2PConnector,
    backend_for_device,
)
from afd_core.errors import (
    AFDConnectorError,
    AFDHandshakeError,
    AFDNotInitializedError,
    AFDPayloadError,
    AFDPeerError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session.handshake import _compare_handshake
from afd_core.testing import free_port, run_world

sys.path.insert(0, str(Path(__file__).parent))
import afd_core_worlds as worlds


def ok(results: dict[int, tuple[Any, ...]]) -> dict[int, Any]:
    """Every rank's returned value; fails with the rank's traceback otherwise."""
    values = {}
    for rank, outcome in sorted(results.items()):
        assert outcome[0] == "ok", f"rank {rank}: {outcome}"
        values[rank] = outcome[1]
    return values


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("a", "f", "extra"),
    [
        (1, 1, None),
        (2, 1, {"check_sequence": True}),
        (3, 1, {"reuse_buffers": True}),
        (2, 1, {"recv_ahead": False, "reuse_buffers": True}),
    ],
    ids=["1to1", "2to1", "3to1-reuse", "2to1-no-recv-ahead"],
)
def test_roundtrip_every_variant_exact(a: int, f: int, extra: dict[str, Any] | None) -> None:
    variants = list(worlds.VARIANTS)
    steps = 2
    # Two processes (Attention ranks, FFN ranks), one thread per connector rank.
    by_proc = ok(
        run_world(
            worlds.roundtrip_by_role,
            2,
            free_port(),
            a,
            f,
            variants,
            steps,
            a * 10 + f,
            extra,
            timeout_s=140,
        )
    )
    results = ok({r: o for proc in by_proc.values() for r, o in proc.items()})
    assert sorted(results) == list(range(a + f))
    per_transfer = len(variants) * steps * worlds.NUM_LAYERS * worlds.NUM_STAGES
    for rank, report in results.items():
        assert report["mismatches"] == [], (rank, report["mismatches"])
        if rank < a:
            assert report["role"] == "attention"
            assert report["checked"] == per_transfer
            if extra and extra.get("reuse_buffers"):
                # Three kept reply buffers per stage, used in turn.
                assert set(report["reply_buffers_per_step"]) == {min(3, worlds.NUM_LAYERS)}
        else:
            served = len(range((rank - a) * a // f, (rank - a + 1) * a // f))
            assert report["role"] == "ffn"
            assert report["checked"] == per_transfer * served
            assert report["shutdown"] is True


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("a", "f"), [(1, 2), (2, 2), (3, 2), (2, 3)], ids=lambda v: str(v))
def test_expert_parallel_dispatch_every_variant_exact(a: int, f: int) -> None:
    """A:F expert parallel: overlapping row subsets to every FFN rank, zero rows to one rank at
    one layer (it still answers: no wait on an empty dispatch), exact on both sides."""
    variants = ["hidden_f32", "hidden_f16_topk", "all_fields"]
    steps = 2
    by_proc = ok(
        run_world(
            worlds.dispatch_by_role,
            2,
            free_port(),
            a,
            f,
            variants,
            steps,
            a * 10 + f,
            timeout_s=140,
        )
    )
    results = ok({r: o for proc in by_proc.values() for r, o in proc.items()})
    assert sorted(results) == list(range(a + f))
    per_peer = len(variants) * steps * worlds.NUM_LAYERS * worlds.NUM_STAGES
    for rank, report in results.items():
        assert report["mismatches"] == [], (rank, report["mismatches"])
        if rank < a:
            assert report["role"] == "attention"
            assert report["checked"] == per_peer * f
        else:
            assert report["role"] == "ffn"
            assert report["checked"] == per_peer * a
            assert report["shutdown"] is True
            if rank == a + f - 1:  # layer 1 dispatches nothing to the last FFN rank
                assert report["empty"] >= len(variants) * steps * worlds.NUM_STAGES * a


@pytest.mark.timeout(120)
def test_handshake_mismatch_validation_and_reinit() -> None:
    results = ok(run_world(worlds.handshake_and_validation_rank, 2, free_port(), timeout_s=110))
    for rank, out in results.items():
        peer = 1 - rank
        # Mismatches fail on both sides, naming the field and the peer.
        for key, field in (
            ("hidden", "hidden_size"),
            ("gate", "config.compute_gate_on_attention"),
            ("stages", "config.num_stages"),
            ("spec", "payload_spec.router_logits"),
        ):
            assert out[key]["type"] == "AFDHandshakeError", (rank, key, out[key])
            assert out[key]["field"] == field
            assert out[key]["peer_rank"] == peer
        assert out["hidden_initialized"] is False
        # Bad payloads rejected before any byte moved: the next good transfer is intact.
        assert out["after_bad"] is True
        for name, err in out["bad"].items():
            assert err is not None and err["type"] == "AFDPayloadError", (rank, name, err)
        assert out["generation_advanced"] is True
        assert out["reinit_ok"] is True
    attn_bad = results[0]["bad"]
    assert {k: v["field"] for k, v in attn_bad.items()} == {
        "hidden_width": "hidden_states",
        "hidden_dtype": "hidden_states",
        "rows": "hidden_states",
        "logits_missing": "router_logits",
        "logits_dtype": "router_logits",
        "extra_field": "input_ids",
        "not_announced": "num_tokens",
        "under_announced": "num_tokens",
        "layer": "layer_idx",
        "stage": "stage_idx",
    }
    assert {k: v["field"] for k, v in results[1]["bad"].items()} == {
        "out_rows": "outputs",
        "out_dtype": "outputs",
        "out_count": "outputs",
    }
    # Sequence check: the FFN side detects the out-of-order layer; the Attention side is
    # released with a peer error naming the FFN rank; both connectors are torn down.
    assert results[1]["sequence"]["type"] == "AFDProtocolError"
    assert (
        "world rank 0 sent header (layer, stage, tokens)=(1, 0, 2); expected layer 0, stage 0"
        in results[1]["sequence"]["msg"]
    )
    assert results[0]["sequence"]["type"] == "AFDPeerError"
    assert results[0]["sequence"]["rank"] == 1
    assert results[0]["sequence_initialized_after"] is False
    assert results[1]["sequence_initialized_after"] is False


@pytest.mark.timeout(120)
def test_peer_killed_mid_transfer_every_survivor_raises() -> None:
    by_proc = run_world(
        worlds.kill_pair_by_proc, 6, free_port(), free_port(), free_port(), timeout_s=110
    )
    # Victims: process 1 (world A's FFN rank, key 2) and process 3 (world B's Attention rank 1,
    # key 4) SIGKILL themselves mid-step; process 4 (world C's Attention rank) between steps.
    assert by_proc[1] == ("exit", -9), by_proc[1]
    assert by_proc[3] == ("exit", -9), by_proc[3]
    survivors = {}
    for proc in (0, 2):
        assert by_proc[proc][0] == "ok", by_proc[proc]
        survivors.update(by_proc[proc][1])
    assert sorted(survivors) == [0, 1, 3, 5]
    for key, outcome in survivors.items():
        assert outcome[0] == "ok", (key, outcome)
        err = outcome[1]
        assert err["type"] in ("AFDPeerError", "AFDTimeoutError"), (key, err)
        assert err["initialized_after"] is False
    # Direct peers of the dead rank name it (world ranks within each world).
    assert survivors[0][1]["rank"] == 2 and survivors[1][1]["rank"] == 2
    assert survivors[5][1]["rank"] == 1  # world B's FFN rank lost Attention world rank 1
    # World C: the unbounded recv_control of the idle FFN rank fails when its peer dies.
    assert by_proc[4] == ("exit", -9), by_proc[4]
    assert by_proc[5][0] == "ok", by_proc[5]
    idle = by_proc[5][1][7]
    assert idle[0] == "ok", idle
    assert idle[1]["type"] == "AFDPeerError" and idle[1]["rank"] == 0, idle
    assert idle[1]["initialized_after"] is False


@pytest.mark.timeout(120)
def test_a_survivor_fails_at_once_when_the_attention_rank_closes_after_a_loss() -> None:
    """1:2: FFN rank 0 dies mid-step; the Attention rank fails, keeps its failure and closes
    (its connections close with it: the failed operation's frames no longer hold them); the
    other FFN rank, waiting for the next layer, fails naming the Attention rank's failure at
    once, not after timeout_s (60 s; it waited that long before)."""
    results = run_world(worlds.survivor_rank, 3, free_port(), timeout_s=100)
    assert results[1] == ("exit", -9), results[1]
    attention, survivor = ok({0: results[0], 2: results[2]}).values()
    assert attention["type"] == "AFDPeerError" and attention["rank"] == 1, attention
    assert survivor["type"] == "AFDPeerError" and survivor["rank"] == 0, survivor
    assert survivor["elapsed"] < 10.0, survivor
    # The Attention rank was still up when the survivor failed (it waits for that, <= 15 s).
    assert attention["survivor_failed_first"] is True, attention


def spec() -> AFDPayloadSpec:
    return AFDPayloadSpec(hidden_size=4, dtype=torch.float32)


def test_backend_for_device() -> None:
    assert backend_for_device("cpu") == "gloo"
    assert backend_for_device(torch.device("cuda", 1)) == "nccl"
    assert backend_for_device("npu:0") == "hccl"
    with pytest.raises(AFDConfigError) as info:
        backend_for_device("meta")
    assert info.value.field == "device"


def test_uninitialized_and_wrong_role_raise_before_io() -> None:
    attn = P2PConnector(AFDConfig(role=AFDRole.ATTENTION), payload_spec=spec(), num_layers=1)
    assert not attn.is_initialized
    meta = AFDTransferMetadata(0, 0, (1,))
    with pytest.raises(AFDNotInitializedError):
        attn.send_dispatch([AFDPayload(torch.zeros(1, 4))], meta)
    with pytest.raises(AFDNotInitializedError):
        attn.send_control(AFDControlMessage(((1,),)))
    ffn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=1)
    with pytest.raises(AFDNotInitializedError):
        ffn.recv_dispatch(0, 0)
    with pytest.raises(AFDNotInitializedError):
        ffn.recv_control()
    assert ffn.served_world_ranks == (0,)
    assert ffn.world_rank == 1 and attn.world_rank == 0
    assert not ffn.announce_leave()  # nobody to tell before init (no store touched)
    attn.close()  # never initialised: still fine
    assert not attn.is_initialized


@pytest.mark.timeout(60)
def test_init_times_out_without_peers_and_close_is_safe() -> None:
    port = free_port()
    cfg = AFDConfig(role=AFDRole.ATTENTION, port=port, timeout_s=0.5, startup_timeout_s=0.5)
    conn = P2PConnector(cfg, payload_spec=spec(), num_layers=1)
    with pytest.raises(AFDTimeoutError, match="handshake"):
        conn.init()
    assert not conn.is_initialized
    conn.close()
    conn.close()
    # A second init (new generation) fails the same way: nothing stale blocks or leaks.
    with pytest.raises(AFDTimeoutError):
        conn.init()
    assert conn.generation == 2


@pytest.mark.timeout(60)
def test_client_without_store_server_times_out_in_connect() -> None:
    cfg = AFDConfig(role=AFDRole.FFN, port=free_port(), timeout_s=30.0, startup_timeout_s=0.5)
    conn = P2PConnector(cfg, payload_spec=spec(), num_layers=1)
    with pytest.raises(AFDTimeoutError, match="'connect'"):
        conn.init()
    assert not conn.is_initialized
    conn.close()


@pytest.mark.timeout(60)
def test_store_port_in_use_is_a_config_error_naming_port() -> None:
    """World rank 0 cannot serve the rendezvous store on a port another process listens on: a
    config error naming ``port`` and its value at once, not a peer failure or a startup wait."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        cfg = AFDConfig(role=AFDRole.ATTENTION, port=port, timeout_s=30.0, startup_timeout_s=60.0)
        conn = P2PConnector(cfg, payload_spec=spec(), num_layers=1)
        began = time.monotonic()
        with pytest.raises(AFDConfigError) as info:
            conn.init()
        elapsed = time.monotonic() - began
        assert (info.value.field, info.value.value) == ("port", port)
        assert f"127.0.0.1:{port} is already in use by another process" in str(info.value)
        assert elapsed < 30.0, f"took {elapsed:.1f}s: waited instead of failing"
        assert not conn.is_initialized
        conn.close()


def test_address_in_use_recognises_both_bind_failures() -> None:
    from afd_core.connector.p2p.lifecycle import _address_in_use

    assert _address_in_use(OSError(errno.EADDRINUSE, "Address already in use"))
    assert _address_in_use(
        RuntimeError("The server socket has failed to listen ... name: EADDRINUSE, message: x")
    )
    assert not _address_in_use(OSError(errno.ECONNREFUSED, "Connection refused"))
    assert not _address_in_use(TimeoutError("timed out"))


def test_p2p_extra_config() -> None:
    c = AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": {"check_sequence": True}})
    conn = P2PConnector(c, payload_spec=spec(), num_layers=2)
    assert conn.check_sequence is True
    assert conn.reuse_buffers is False
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": {"check_seq": True}})
    assert info.value.field == "connector_extra_config.check_seq"
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": {"reuse_buffers": "y"}})
    assert info.value.field == "connector_extra_config.reuse_buffers"


def test_handshake_fields_cover_contract() -> None:
    conn = P2PConnector(
        AFDConfig(
            role=AFDRole.FFN,
            num_attention_ranks=3,
            num_ffn_ranks=2,
            ffn_rank=1,
            compute_gate_on_attention=True,
        ),
        role_rank=1,
        payload_spec=AFDPayloadSpec(hidden_size=8, dtype=torch.bfloat16, top_k=2),
        num_layers=5,
    )
    fields = conn.handshake_fields()
    assert fields["hidden_size"] == 8 and fields["dtype"] == "bfloat16"
    assert fields["num_layers"] == 5 and fields["topology"] == [3, 2, 1]
    # The P2P wire protocol's version (not the session base's default), compared first: a peer
    # on another version is refused naming it even when other fields differ too.
    assert fields["protocol_version"] == PROTOCOL_VERSION
    _compare_handshake(fields, dict(fields), 0)
    with pytest.raises(AFDHandshakeError) as info:
        _compare_handshake(
            fields, {**fields, "protocol_version": PROTOCOL_VERSION + 1, "hidden_size": 16}, 0
        )
    assert (info.value.field, info.value.local, info.value.remote) == (
        "protocol_version",
        PROTOCOL_VERSION,
        PROTOCOL_VERSION + 1,
    )
    assert fields["role"] == "ffn" and fields["role_agreement"] == {}
    assert fields["model_identity"] == {}
    assert fields["config_hash"] == conn.config.agreement_hash()
    assert set(fields["payload_spec"]) == {"hidden_states", "topk_ids", "topk_weights"}
    assert conn.served_world_ranks == (0, 1, 2)  # expert parallel: every Attention rank
    assert conn.world_rank == 4 and conn.topology.world_size == 5


def test_recv_control_rejects_bad_timeout() -> None:
    conn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=1)
    conn._initialized = True  # only the argument check runs before any I/O
    try:
        for bad in (0, -1.0, True, "1"):
            with pytest.raises((AFDConfigError, AFDConnectorError)):
                conn.recv_control(timeout_s=bad)  # type: ignore[arg-type]
    finally:
        conn._initialized = False


def test_send_control_validates_before_io() -> None:
    conn = P2PConnector(
        AFDConfig(role=AFDRole.ATTENTION, num_attention_ranks=3), payload_spec=spec(), num_layers=1
    )
    conn._initialized = True  # validation happens before the (absent) group is touched
    try:
        with pytest.raises(AFDPayloadError) as info:
            conn.send_control(AFDControlMessage(((1, 2),)))
        assert info.value.field == "stage_token_counts"
        with pytest.raises(AFDPayloadError) as info:
            conn.send_control(AFDControlMessage(tuple((1,) for _ in range(60))))
        assert info.value.field == "stage_token_counts"
        with pytest.raises(AFDPayloadError) as info:
            conn.send_control("go")  # type: ignore[arg-type]
        assert info.value.field == "message"
    finally:
        conn._initialized = False


@pytest.mark.timeout(90)
def test_recv_ahead_posts_early_keeps_or_rejects_leftovers() -> None:
    results = ok(run_world(worlds.recv_ahead_rank, 2, free_port(), free_port(), timeout_s=80))
    attn, ffn = results[0], results[1]
    # Steps 0-3 arrive exactly, on both sides.
    assert attn["exact"] == [True] * 8 and ffn["exact"] == [True] * 8
    # The next layer's receive is posted after each layer but the last; a step that stops
    # early leaves it posted (step 1), and the next step with the same count consumes it.
    assert ffn["posted_after"] == [
        (0, 0, [0]),
        (0, 1, [0]),
        (0, 2, []),
        (1, 0, [0]),
        (2, 0, [0]),
        (2, 1, [0]),
        (2, 2, []),
        (3, 0, [0]),
    ]
    # Step 4 changes the count of a stage the FFN rank still has a receive posted for: the
    # Attention rank refuses before sending anything (gloo would abort the FFN process on a
    # size mismatch), the FFN rank is released with a peer error naming it.
    assert attn["error_step"] == 4 and attn["error"]["type"] == "AFDProtocolError"
    assert "stage 0: the FFN rank still has a receive posted for 4 tokens" in attn["error"]["msg"]
    assert "this step announces 5" in attn["error"]["msg"]
    assert ffn["error_step"] == 4 and ffn["error"]["type"] == "AFDPeerError"
    assert ffn["error"]["rank"] == 0
    assert attn["initialized_after"] is False and ffn["initialized_after"] is False


def test_recv_ahead_extra_config() -> None:
    conn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=2)
    assert conn.recv_ahead is True
    c = AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": {"recv_ahead": False}})
    assert P2PConnector(c, payload_spec=spec(), num_layers=2).recv_ahead is False
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": {"recv_ahead": 0}})
    assert info.value.field == "connector_extra_config.recv_ahead"


def test_ffn_rejects_a_step_that_conflicts_with_a_posted_receive() -> None:
    from afd_core.connector.p2p.recv_ahead import _PostedRecv
    from afd_core.errors import AFDProtocolError

    conn = P2PConnector(
        AFDConfig(role=AFDRole.FFN, num_attention_ranks=2), payload_spec=spec(), num_layers=3
    )
    conn._initialized = True  # the check runs before the (absent) group is touched
    buf = torch.empty(4, 16)
    posted = _PostedRecv(4, [buf], AFDPayload(buf))
    conn._posted[(0, 1)] = collections.deque([posted])  # stage 0, world rank 1 (Attention rank 1)
    # Same count for that rank (the other rank's count is free): kept, nothing new posted
    # because recv_ahead posting needs a group; disable it to test the check alone.
    conn.recv_ahead = False
    conn._post_step_recvs(AFDControlMessage(((9, 4),)), 1)
    assert list(conn._posted) == [(0, 1)]
    with pytest.raises(
        AFDProtocolError,
        match=r"receive posted for 4 tokens from world rank 1 \(its previous step ended before "
        r"layer 1\)",
    ):
        conn._post_step_recvs(AFDControlMessage(((4, 5),)), 1)
    assert not conn.is_initialized and conn._posted == {}


@pytest.mark.timeout(60)
def test_stream_of_layers_before_replies_is_exact() -> None:
    results = ok(run_world(worlds.stream_rank, 2, free_port(), timeout_s=50))
    assert results[0]["exact"] == [True] * 12
    assert results[1]["exact"] == [True] * 18  # per step: 4 payloads, 4 metadata, none posted


@pytest.mark.timeout(60)
def test_recv_ahead_window_follows_recv_ahead_bytes() -> None:
    results = ok(run_world(worlds.recv_window_rank, 2, free_port(), timeout_s=50))
    assert results[0]["exact"] == [True] * 17 and results[1]["exact"] == [True] * 17
    # Receives posted ahead for stage 0: after recv_control, then after each layer's reply
    # (steps 3 and 4: after the whole stream of receives).
    assert results[1]["posted"] == [
        [1, 1, 1, 1, 0],  # request/reply: one ahead (the window, 2, is for streams)
        [0, 0],  # 512 B > recv_ahead_bytes: nothing ahead, so step 2 may change the count
        [1, 1, 1, 1, 0],  # 160 B: a window of 1
        [1, 0],  # a stream: one at recv_control, the window (4) once the stream shows
        [4, 0],  # the stage streamed last step: every layer posted at recv_control
    ]


def test_recv_ahead_bytes_extra_config() -> None:
    conn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=8)
    assert conn.recv_ahead_bytes == RECV_AHEAD_BYTES  # the default applies
    # spec(): hidden 4 float32, 16 bytes a token: as many transfers as fit in the budget, none
    # for a transfer larger than the budget or of no tokens.
    assert conn._window(1024) == RECV_AHEAD_BYTES // (1024 * 16) > 1
    assert conn._window(RECV_AHEAD_BYTES // 16) == 1
    assert conn._window(RECV_AHEAD_BYTES // 16 + 1) == 0
    assert conn._window(0) == 0
    for extra, window in (
        ({"recv_ahead_bytes": 0}, 0),
        ({"recv_ahead_bytes": 64}, 4),
        ({"recv_ahead_bytes": 64, "reuse_buffers": True}, 1),
        ({"recv_ahead_bytes": 64, "recv_ahead": False}, 0),
    ):
        c = AFDConfig.from_mapping({"role": "ffn", "connector_extra_config": extra})
        assert P2PConnector(c, payload_spec=spec(), num_layers=8)._window(1) == window, extra
    for bad in (-1, True, 1.5, "4096"):
        with pytest.raises(AFDConfigError) as info:
            AFDConfig.from_mapping(
                {"role": "ffn", "connector_extra_config": {"recv_ahead_bytes": bad}}
            )
        assert info.value.field == "connector_extra_config.recv_ahead_bytes"
        assert info.value.value == bad


class _RecordingGroup:
    """A process group whose sends and receives complete at once; it records their order."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, int]] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self.ops.append(("send", tag))
        return self

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self.ops.append(("recv", tag))
        return self

    def wait(self, *args: Any) -> bool:
        return True


def _bypass_init(conn: P2PConnector) -> _RecordingGroup:
    group = _RecordingGroup()
    conn._initialized = True  # only the call order is under test, no I/O happens
    conn._data_pg = conn._ctl_pg = group
    return group


def test_stream_ordered_backends_post_no_receive_ahead() -> None:
    """nccl/hccl run a rank's sends and receives in call order on one stream: a receive posted
    before a send its peer waits for would deadlock, so none is posted before it is asked for.
    (An "npu" device needs torch_npu; early posting is keyed on the backend being gloo.)"""
    cfg = AFDConfig(role=AFDRole.ATTENTION)
    cuda = P2PConnector(cfg, payload_spec=spec(), num_layers=4, device="cuda")
    assert cuda.backend == "nccl" and cuda._post_early is False and cuda._window(1) == 0
    reply_tag, data_tag = 64 + 1, 64  # stage 0: the reply and the hidden_states field
    # The same connector logic on CPU tensors, with the gloo-only early posting switched off.
    attn = P2PConnector(cfg, payload_spec=spec(), num_layers=4)
    attn._post_early = False
    group = _bypass_init(attn)
    attn.send_control(AFDControlMessage(((2,),)))
    x = torch.ones(2, 4)
    handles = [attn.send_dispatch([AFDPayload(x)], AFDTransferMetadata(i, 0, (2,))) for i in (0, 1)]
    for handle in handles:
        attn.recv_combine(handle)
    assert (
        group.ops
        == [("send", 1), ("send", data_tag), ("send", data_tag)] + [("recv", reply_tag)] * 2
    )
    assert attn._peer_posted == {}  # the mirror: the FFN rank posts nothing ahead either
    ffn = P2PConnector(AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=4)
    ffn._post_early = False
    group = _bypass_init(ffn)
    control = AFDControlMessage(((2,),))
    ffn._control = control
    ffn._post_step_recvs(control)
    for layer in range(2):
        meta, (payload,) = ffn.recv_dispatch(layer, 0)
        assert meta == control.transfer_metadata(layer, 0)
        ffn.send_combine([payload.hidden_states], meta)
    assert group.ops == [("recv", data_tag), ("send", reply_tag)] * 2 and ffn._posted == {}
    # On gloo the same calls post the receives ahead (the reply's before the data's send).
    gloo = P2PConnector(cfg, payload_spec=spec(), num_layers=4)
    group = _bypass_init(gloo)
    gloo.send_control(AFDControlMessage(((2,),)))
    gloo.recv_combine(gloo.send_dispatch([AFDPayload(x)], AFDTransferMetadata(0, 0, (2,))))
    assert group.ops == [("send", 1), ("recv", reply_tag), ("send", data_tag)]


def test_ffn_posts_ahead_only_on_stages_with_a_window() -> None:
    """The FFN side computes once per control message which stages have a receive window
    (``recv_ahead_bytes``); the others post every receive when it is asked for, and a shutdown
    message leaves no stage scheduling ahead."""
    cfg = AFDConfig(role=AFDRole.FFN, connector_extra_config={"recv_ahead_bytes": 64})
    ffn = P2PConnector(cfg, payload_spec=spec(), num_layers=4)  # 16 bytes per token
    assert (ffn._window(2), ffn._window(8)) == (2, 0)
    group = _bypass_init(ffn)
    control = AFDControlMessage(((2,), (8,)))  # stage 0: 32 B, in the budget; stage 1: 128 B
    ffn._control = control
    ffn._post_step_recvs(control)
    assert ffn._ahead_stages == frozenset({0})
    stage0, stage1 = 64, 64 + 16  # the hidden_states tags of stages 0 and 1 (to the FFN rank)
    assert group.ops == [("recv", stage0)]  # request/reply so far: one receive ahead
    # A stream on stage 1 (two layers received before any reply): posted when asked, only.
    for layer in (0, 1):
        _, (payload,) = ffn.recv_dispatch(layer, 1)
        assert payload.hidden_states.shape == (8, 4)
    assert group.ops == [("recv", stage0), ("recv", stage1), ("recv", stage1)]
    assert (0, ffn.served_world_ranks[0]) in ffn._posted and len(ffn._posted) == 1
    # The shutdown message: nothing is scheduled ahead any more.
    words = AFDControlMessage.shutdown_message().words()
    ffn._control_bufs[0][: len(words)] = torch.tensor(words)
    assert ffn.recv_control().shutdown
    assert ffn._ahead_stages == frozenset() and ffn._control is None


@pytest.mark.parametrize("check_sequence", [False, True])
def test_ffn_receive_that_cannot_be_posted_fails_naming_the_peer(check_sequence: bool) -> None:
    """A transport error while posting a receive (either posting path) closes the connector
    and raises AFDPeerError naming the Attention rank and the operation."""
    extra = {"recv_ahead": False, "check_sequence": check_sequence}
    ffn = P2PConnector(
        AFDConfig(role=AFDRole.FFN, connector_extra_config=extra),
        payload_spec=spec(),
        num_layers=4,
    )
    group = _bypass_init(ffn)

    def broken_recv(tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        raise RuntimeError("Connection closed by peer")

    group.recv = broken_recv  # type: ignore[method-assign]
    control = AFDControlMessage(((2,),))
    ffn._control = control
    with pytest.raises(AFDPeerError) as info:
        ffn.recv_dispatch(0, 0)
    assert info.value.rank == ffn.served_world_ranks[0]
    assert info.value.stage == "recv_dispatch"
    assert "Connection closed by peer" in str(info.value)
    assert not ffn.is_initialized


@pytest.mark.timeout(120)
def test_ffn_ranks_refuse_different_role_agreement() -> None:
    results = ok(run_world(worlds.agreement_rank, 3, free_port(), "geometry", timeout_s=100))
    # The FFN ranks compare their geometry and name it; the Attention rank (which compares no
    # FFN-role fields) fails at startup naming the FFN rank that failed.
    for rank in (1, 2):
        assert results[rank]["error"] in ("AFDHandshakeError", "AFDStartupError"), results[rank]
    ffn_texts = results[1]["text"] + results[2]["text"]
    assert "role_agreement.expert_quant" in ffn_texts
    assert results[0]["error"] == "AFDStartupError"
    assert "role_agreement.expert_quant" in results[0]["text"]


@pytest.mark.timeout(120)
def test_a_bind_failure_between_open_and_ready_fails_every_rank_with_its_message() -> None:
    results = ok(run_world(worlds.agreement_rank, 3, free_port(), "hook", timeout_s=100))
    assert results[0]["error"] == "AFDStartupError"
    assert "world rank 2" in results[0]["text"] and "'bind'" in results[0]["text"]
    assert "planted bind failure on FFN rank 1" in results[0]["text"]
    assert results[2]["error"] == "bind" and results[2]["seen"] == 1
    # FFN rank 0 (world rank 1) waited in the ready barrier and fails naming world rank 2 too.
    assert results[1]["error"] == "AFDStartupError" and "world rank 2" in results[1]["text"]


@pytest.mark.timeout(120)
def test_open_groups_exposes_the_data_group_before_ready() -> None:
    results = ok(run_world(worlds.agreement_rank, 3, free_port(), "ok", timeout_s=100))
    port_tag = results[0]["info"].name.split("/")[1]
    for rank, peers in ((0, (1, 2)), (1, (0,)), (2, (0,))):
        info = results[rank]["info"]
        assert results[rank]["error"] is None
        assert (info.world_size, info.rank, info.peer_ranks) == (3, rank, peers)
        assert info.name == f"afd-p2p/{port_tag}/g1/data"
        assert results[rank]["seen"] == [info]  # the same group before confirm_ready
        assert results[rank]["backend"] == "gloo"  # the data plane's process group


@pytest.mark.timeout(120)
def test_mega_ffn_ranks_get_a_group_of_the_ffn_ranks_only() -> None:
    """With Mega on the FFN ranks (``needs_ffn_group``) each FFN rank also gets a group of the
    FFN ranks (FFN-rank order), on which a collective runs; the Attention rank is in none."""
    results = ok(run_world(worlds.agreement_rank, 3, free_port(), "mega", timeout_s=100))
    port_tag = results[0]["info"].name.split("/")[1]
    assert results[0]["error"] is None and results[0]["ffn"] == {}
    for world_rank, ffn_rank in ((1, 0), (2, 1)):
        out = results[world_rank]
        assert out["error"] is None, out
        info = out["ffn"]["info"]
        assert (info.world_size, info.rank, info.peer_ranks) == (2, ffn_rank, (1 - ffn_rank,))
        assert info.name == f"afd-p2p/{port_tag}/g1/ffn"
        assert out["ffn"]["sum"] == 3.0  # 1 + 2 over the two FFN ranks


@pytest.mark.timeout(120)
def test_attention_notices_idle_ffn_loss_and_pairs_with_its_replacement() -> None:
    out = run_world(worlds.replaced_ffn_proc, 3, free_port(), 2.0, timeout_s=110)
    assert out[1] == ("exit", -9), out[1]
    assert out[0][0] == "ok", out[0]
    assert out[2][0] == "ok", out[2]
    attn, repl = out[0][1], out[2][1]
    assert attn["first_step_ok"] is True
    # Noticed with nothing pending, by the heartbeat: FFN world rank 1, stage 'liveness'.
    assert attn["failure"]["type"] == "AFDPeerError", attn
    assert attn["failure"]["rank"] == 1 and attn["failure"]["stage"] == "liveness", attn
    assert "no heartbeat" in attn["failure"]["msg"], attn
    assert attn["noticed_after_s"] < 2.0 + 10.0, attn
    assert attn["failure_cleared_on_close"] is True  # close keeps it; the next init clears it
    assert attn["peer_failure_after_init"] is None
    # Round 2 on both sides: the replacement waited out the stale round 1.
    assert attn["generation"] == 2 and repl["generation"] == 2, (attn, repl)
    assert attn["second_step_ok"] is True
    # A duplicate of the live FFN rank is refused at once, naming ffn_rank (its heartbeat moves).
    dup = repl["duplicate"]
    assert dup["type"] == "AFDRankServedError" and dup["field"] == "ffn_rank", dup
    assert "is served by another live process in round 2" in dup["msg"], dup
    assert repl["goodbye"] is True


@pytest.mark.parametrize("case", ["connect", "handshake"])
def test_cancel_ends_a_waiting_init_at_once(case: str) -> None:
    (result,) = ok(
        run_world(worlds.cancel_startup_rank, 1, free_port(), case, timeout_s=60)
    ).values()
    assert result["type"] == "AFDCancelledError", result
    assert result["stage"] == case
    assert result["reason"] == ("test cancel" if case == "connect" else "SIGUSR1")
    # Cancelled after 1 s of a 60 s startup timeout: ends within one poll, not the timeout.
    assert 0.9 < result["elapsed"] < 10.0, result
    assert result["initialized_after"] is False


@pytest.mark.timeout(120)
def test_cancel_in_the_ready_barrier_is_published_to_the_peer() -> None:
    results = ok(run_world(worlds.cancel_startup_rank, 2, free_port(), "ready", timeout_s=60))
    assert results[1]["type"] == "AFDCancelledError", results
    assert results[1]["stage"] == "ready"
    # Rank 0 finishes its long bind (until rank 1 was cancelled), then fails at once naming
    # rank 1's cancellation.
    assert results[0]["saw_cancel"] is True, results
    assert results[0]["type"] == "AFDStartupError", results
    assert (results[0]["rank"], results[0]["stage"]) == (1, "ready")
    assert "AFDCancelledError" in results[0]["reason"] and "test cancel" in results[0]["reason"]
    assert results[0]["elapsed"] < 20.0, results


@pytest.mark.timeout(120)
def test_system_exit_in_init_is_not_a_peer_error() -> None:
    results = ok(run_world(worlds.exit_in_init_rank, 2, free_port(), timeout_s=60))
    assert results[0] == {"type": "SystemExit", "code": 0, "initialized_after": False}
    assert results[1]["type"] == "AFDStartupError", results
    assert (results[1]["rank"], results[1]["stage"]) == (0, "ready")
    assert results[1]["reason"].startswith("SystemExit")


@pytest.mark.timeout(120)
def test_failure_published_before_init_fails_the_peer_init_at_once() -> None:
    results = ok(run_world(worlds.failure_before_init_rank, 2, free_port(), timeout_s=60))
    assert results[1]["delivered"] is True, results
    err = results[0]
    assert err["type"] == "AFDStartupError", results
    assert (err["rank"], err["stage"], err["reason"]) == (
        1,
        "load",
        "OSError: weights file unreadable",
    )
    assert "world rank 1 failed during 'load': OSError: weights file unreadable" in err["msg"]
    assert err["elapsed"] < 20.0, err  # its startup timeout is 60 s


def test_publish_startup_failure_without_a_server_is_bounded_and_reports_false() -> None:
    cfg = AFDConfig(role=AFDRole.FFN, port=free_port(), num_attention_ranks=1, num_ffn_ranks=1)
    t0 = time.monotonic()
    assert P2PConnector.publish_startup_failure(cfg, 0, "load", "x", timeout_s=1.5) is False
    assert time.monotonic() - t0 < 10.0


@pytest.mark.timeout(60)
def test_draft_steps_run_only_the_draft_layers_with_receive_ahead() -> None:
    results = ok(run_world(worlds.draft_steps_rank, 2, free_port(), timeout_s=50))
    assert results[0]["exact"] == [True] * 12  # 3 target steps x 3 layers + 3 draft steps
    assert results[1]["exact"] == [True] * 24  # + the flag and "nothing left posted" per step


def test_num_draft_layers_is_checked_and_shapes_the_step() -> None:
    conn = P2PConnector(
        AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=5, num_draft_layers=1
    )
    assert (conn.step_last_layer(False), conn.step_last_layer(True)) == (3, 4)
    assert conn.handshake_fields()["num_draft_layers"] == 1
    for bad in (-1, 5, True):
        with pytest.raises(AFDConfigError) as info:
            P2PConnector(
                AFDConfig(role=AFDRole.FFN), payload_spec=spec(), num_layers=5, num_draft_layers=bad
            )
        assert info.value.field == "num_draft_layers"
