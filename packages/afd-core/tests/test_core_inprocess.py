"""The in-process connector: the shared session (handshake, rounds, liveness, failure
publication, goodbye) and the data plane, both roles as threads of this process."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig
from afd_core.connector import create_connector, get_connector_class
from afd_core.connector.inprocess import InProcessConnector
from afd_core.errors import (
    AFDConnectorError,
    AFDHandshakeError,
    AFDNotInitializedError,
    AFDPeerError,
    AFDProtocolError,
    AFDRankServedError,
    AFDStartupError,
    AFDTimeoutError,
)
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session import liveness, membership

SPEC = AFDPayloadSpec(hidden_size=4, dtype=torch.float32)
_ports = itertools.count(7100)  # never listened on: an in-process world is named by host:port


def cfg(role: str, port: int, **kw: Any) -> AFDConfig:
    raw = {"role": role, "connector": "inprocess", "port": port, "timeout_s": 5.0}
    raw.update({"startup_timeout_s": 10.0, **kw})
    return AFDConfig.from_mapping(raw)


def conn(role: str, port: int, rank: int = 0, spec: AFDPayloadSpec = SPEC, **kw: Any) -> Any:
    return create_connector(cfg(role, port, **kw), rank, payload_spec=spec, num_layers=2, **{})


def in_threads(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` on threads; each result is its return value or the exception it raised."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as err:
            out[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_registered_and_selected_by_the_config() -> None:
    assert get_connector_class("inprocess") is InProcessConnector
    assert isinstance(conn("ffn", next(_ports)), InProcessConnector)


def test_config_mismatch_is_refused_on_both_sides_naming_the_field() -> None:
    port = next(_ports)
    a, f = conn("attention", port, num_stages=2), conn("ffn", port, num_stages=1)
    ra, rf = in_threads(a.init, f.init)
    # The session's handshake: the same AFDHandshakeError (and text) as over P2P.
    assert isinstance(ra, AFDHandshakeError) and ra.field == "config.num_stages", ra
    assert str(ra) == str(AFDHandshakeError("config.num_stages", 2, 1, 1))
    assert isinstance(rf, AFDHandshakeError | AFDStartupError), rf
    assert "num_stages" in str(rf)
    assert not a.is_initialized and not f.is_initialized


def test_model_identity_mismatch_names_the_leaf() -> None:
    port = next(_ports)
    a = create_connector(
        cfg("attention", port), 0, payload_spec=SPEC, num_layers=2, model_identity={"w": 1}
    )
    f = create_connector(
        cfg("ffn", port), 0, payload_spec=SPEC, num_layers=2, model_identity={"w": 2}
    )
    ra, _ = in_threads(a.init, f.init)
    assert isinstance(ra, AFDHandshakeError) and ra.field == "model_identity.w", ra


def _ffn_serve(f: Any, scale: float) -> Callable[[], int]:
    def serve() -> int:
        f.init()
        steps = 0
        while True:
            ctl = f.recv_control(timeout_s=math.inf)
            if ctl.shutdown:
                f.close()
                return steps
            for layer in range(2):
                for stage in range(ctl.num_stages):
                    meta, payloads = f.recv_dispatch(layer, stage)
                    assert meta == ctl.transfer_metadata(layer, stage)
                    f.send_combine([p.hidden_states * scale for p in payloads], meta)
            steps += 1

    return serve


def test_two_attention_ranks_round_trip_with_an_empty_stage() -> None:
    port = next(_ports)
    f = conn("ffn", port, num_attention_ranks=2)

    def attention(rank: int) -> list[float]:
        a = conn("attention", port, rank, num_attention_ranks=2)
        a.init()
        sums = []
        counts = (rank + 1, 0)
        a.send_control(AFDControlMessage(((counts[0],), (counts[1],))))
        for layer in range(2):
            handles = [
                a.send_dispatch(
                    [AFDPayload(torch.full((n, 4), float(layer + 1)))],
                    AFDTransferMetadata(layer, s, (n,)),
                )
                for s, n in enumerate(counts)
            ]
            sums += [float(a.recv_combine(h)[0].sum()) for h in handles]
        a.send_control(AFDControlMessage.shutdown_message())
        a.close()
        return sums

    steps, s0, s1 = in_threads(_ffn_serve(f, 3.0), lambda: attention(0), lambda: attention(1))
    assert steps == 1
    assert s0 == [12.0, 0.0, 24.0, 0.0]  # 1 row x 4 x layer+1 x 3; the empty stage travels
    assert s1 == [24.0, 0.0, 48.0, 0.0]


def test_expert_parallel_dispatch_and_combine() -> None:
    port = next(_ports)
    kw = {"num_ffn_ranks": 2, "compute_gate_on_attention": True}
    spec = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=1)
    a = conn("attention", port, spec=spec, **kw)
    fs = [conn("ffn", port, r, spec=spec, ffn_rank=r, **kw) for r in range(2)]

    def ffn(r: int) -> tuple[int, ...]:
        f = fs[r]
        f.init()
        f.recv_control()
        meta, payloads = f.recv_dispatch(1, 0)
        f.send_combine([p.hidden_states + 10 * (r + 1) for p in payloads], meta)
        return meta.num_tokens

    def attention() -> list[torch.Tensor]:
        a.init()
        a.send_control(AFDControlMessage(((3,),)))
        payloads = [
            AFDPayload(
                torch.ones(n, 4),
                topk_ids=torch.zeros(n, 1, dtype=torch.int32),
                topk_weights=torch.ones(n, 1),
            )
            for n in (3, 0)
        ]
        return a.recv_combine(a.send_dispatch(payloads, AFDTransferMetadata(1, 0, (3, 0))))

    got, n0, n1 = in_threads(attention, lambda: ffn(0), lambda: ffn(1))
    assert (n0, n1) == ((3,), (0,))  # rank 1 got the empty dispatch (its header travelled)
    assert torch.equal(got[0], torch.full((3, 4), 11.0)) and got[1].shape == (0, 4)
    for c in (a, *fs):
        c.close()


def test_header_mismatch_is_a_protocol_error() -> None:
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)
    in_threads(a.init, f.init)
    a.send_control(AFDControlMessage(((1,),)))
    a.send_dispatch([AFDPayload(torch.ones(1, 4))], AFDTransferMetadata(1, 0, (1,)))
    f.recv_control()
    with pytest.raises(AFDProtocolError, match="expected layer 0"):
        f.recv_dispatch(0, 0)
    assert not f.is_initialized  # a failure closes the rank and is published
    with pytest.raises(AFDPeerError, match="world rank 1"):
        a.recv_combine(
            a.send_dispatch([AFDPayload(torch.ones(1, 4))], AFDTransferMetadata(0, 0, (1,)))
        )
    a.close()


def test_rounds_reinit_and_duplicate_claim() -> None:
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)
    in_threads(a.init, f.init)
    assert (a.generation, f.generation) == (1, 1)
    # A second FFN server for a live FFN rank is refused at once, naming the field, and the
    # running pair is untouched (nothing was published into its round).
    dup = conn("ffn", port, startup_timeout_s=30.0)
    began = time.monotonic()
    with pytest.raises(AFDRankServedError) as served:
        dup.init()
    assert time.monotonic() - began < 10.0
    assert (served.value.field, served.value.value) == ("ffn_rank", 0)
    assert "world rank 1 (ffn 0) is served by another live process in round 1" in str(served.value)
    assert a.peer_failure() is None and f.peer_failure() is None
    a.send_control(AFDControlMessage(((2,),)))
    meta = AFDTransferMetadata(0, 0, (2,))
    handle = a.send_dispatch([AFDPayload(torch.ones(2, 4))], meta)
    f.recv_control()
    got, (payload,) = f.recv_dispatch(0, 0)
    assert got == meta
    f.send_combine(payload.hidden_states * 2, got)
    assert torch.equal(a.recv_combine(handle)[0], torch.full((2, 4), 2.0))
    a.close()
    f.close()
    in_threads(a.init, f.init)  # round 2: the attention rank opens it, the FFN rank joins
    assert (a.generation, f.generation) == (2, 2)
    # A holder whose heartbeat stopped (gone without a goodbye) is not a live one: the second
    # claimant waits for a newer round, then fails naming the claim.
    f.session.close(goodbye=False)
    dup = conn("ffn", port, startup_timeout_s=4.0)
    with pytest.raises(AFDStartupError) as info:
        dup.init()
    assert info.value.stage == "claim" and "already claimed in round 2" in str(info.value)
    a.close()
    f.close()
    in_threads(a.init, f.init)  # round 3
    assert (a.generation, f.generation) == (3, 3)
    a.close()
    f.close()


def test_goodbye_ends_a_pending_wait_and_is_seen_by_the_watcher() -> None:
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)
    in_threads(a.init, f.init)
    a.send_control(AFDControlMessage(((2,),)))
    handle = a.send_dispatch([AFDPayload(torch.ones(2, 4))], AFDTransferMetadata(0, 0, (2,)))
    f.close()  # a clean leave, never replying
    with pytest.raises(AFDPeerError) as info:
        a.recv_combine(handle)
    assert info.value.rank == 1 and info.value.stage == "goodbye"
    assert isinstance(a.peer_failure(), AFDPeerError)


def test_liveness_notices_a_silent_ffn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(liveness, "LIVENESS_TIMEOUT_S", 0.3)
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)
    in_threads(a.init, f.init)
    assert a.wait_peer_failure(0.5) is None  # beating: healthy
    f.session.close(goodbye=False)  # the FFN rank stalls: its heartbeat stops, no goodbye
    failure = a.wait_peer_failure(5.0)
    assert isinstance(failure, AFDPeerError) and failure.stage == "liveness", failure
    assert failure.rank == 1 and "no heartbeat" in str(failure)
    a.close()
    f.close()
    in_threads(a.init, f.init)
    assert a.peer_failure() is None  # the next init clears it
    a.close()
    f.close()


def test_startup_failure_publication_fails_the_peer_at_once() -> None:
    port = next(_ports)
    a = conn("attention", port, startup_timeout_s=30.0)

    def publish() -> bool:
        return InProcessConnector.publish_startup_failure(
            cfg("ffn", port), 0, "load_model", "planted: no weights", timeout_s=10.0
        )

    ra, delivered = in_threads(a.init, publish)
    assert delivered is True
    assert isinstance(ra, AFDStartupError), ra
    assert (ra.rank, ra.stage) == (1, "load_model") and "planted: no weights" in str(ra)


def test_abort_and_timeout_reach_the_waiting_peer() -> None:
    port = next(_ports)
    a, f = conn("attention", port, timeout_s=0.5), conn("ffn", port, timeout_s=0.5)
    in_threads(a.init, f.init)
    a.send_control(AFDControlMessage(((1,),)))
    handle = a.send_dispatch([AFDPayload(torch.ones(1, 4))], AFDTransferMetadata(0, 0, (1,)))
    with pytest.raises(AFDTimeoutError, match=r"did not complete within 0\.5s"):
        a.recv_combine(handle)  # the FFN rank never replies
    f.abort("compute", "planted compute error")
    in_threads(a.init, f.init)
    a.send_control(AFDControlMessage(((1,),)))
    handle = a.send_dispatch([AFDPayload(torch.ones(1, 4))], AFDTransferMetadata(0, 0, (1,)))
    f.abort("compute", "planted compute error")
    with pytest.raises(AFDPeerError) as info:
        a.recv_combine(handle)
    assert (info.value.rank, info.value.stage) == (1, "compute")
    assert "planted compute error" in str(info.value)


def test_a_bind_failure_between_open_and_ready_reaches_the_peer() -> None:
    """What afd-runtime does when a Mega bind fails: the FFN rank opened its groups, aborts in
    stage ``bind``; the Attention rank's start fails naming that rank, stage and reason."""
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)

    def ffn_start() -> None:
        f.open_groups()
        f.abort("bind", "RuntimeError: planted bind failure")
        f.confirm_ready()  # the aborted connector is closed: not started

    ra, rf = in_threads(a.init, ffn_start)
    assert isinstance(rf, AFDNotInitializedError), rf
    assert isinstance(ra, AFDStartupError) and (ra.rank, ra.stage) == (1, "bind"), ra
    assert "planted bind failure" in str(ra)


def test_open_groups_then_confirm_ready_is_a_whole_start() -> None:
    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)

    def ffn_start() -> None:
        f.open_groups()
        f.open_groups()  # idempotent
        assert not f.is_initialized
        f.confirm_ready()

    assert in_threads(a.init, ffn_start) == [None, None]
    assert a.is_initialized and f.is_initialized
    with pytest.raises(AFDConnectorError, match="no process group"):
        f.data_process_group()  # the in-process transport moves no data on one
    a.close()
    f.close()


def test_ffn_ranks_of_a_collective_compute_get_a_group_of_their_own() -> None:
    """``needs_ffn_group`` (Mega on the FFN ranks): the connector opens a gloo group of the FFN
    ranks only, ranked in FFN order, on which they can run a collective."""
    port = next(_ports)
    ep = {"num_ffn_ranks": 2, "compute_gate_on_attention": True, "expert_dispatch": "ffn"}
    mega = {"ffn_compute": "mega", "expert_quant": "w8a8", **ep}
    a = conn("attention", port, **ep)
    ffns = [conn("ffn", port, r, ffn_rank=r, **mega) for r in range(2)]
    sums: dict[int, float] = {}

    def ffn_start(r: int) -> None:
        f = ffns[r]
        f.open_groups()
        info = f.ffn_group_info()
        assert (info.world_size, info.rank, info.peer_ranks) == (2, r, (1 - r,))
        assert info.name.endswith("/ffn")
        t = torch.tensor([float(r + 1)])
        f.ffn_process_group().allreduce([t]).wait()
        sums[r] = float(t)
        f.confirm_ready()

    assert in_threads(a.init, lambda: ffn_start(0), lambda: ffn_start(1)) == [None] * 3
    assert sums == {0: 3.0, 1: 3.0}
    with pytest.raises(AFDConnectorError):  # the Attention rank is in no such group
        a.ffn_process_group()
    for c in (a, *ffns):
        c.close()
    with pytest.raises(AFDConnectorError):  # closed: released
        ffns[0].ffn_process_group()
    plain = conn("ffn", next(_ports))
    with pytest.raises(AFDConnectorError):  # a native compute: no group opened
        plain.ffn_group_info()


def test_served_ranks_disagreeing_on_stages_is_a_protocol_error() -> None:
    port = next(_ports)
    f = conn("ffn", port, num_attention_ranks=2)
    atts = [conn("attention", port, r, num_attention_ranks=2) for r in range(2)]
    in_threads(f.init, *(a.init for a in atts))
    atts[0].send_control(AFDControlMessage(((1,),)))
    atts[1].send_control(AFDControlMessage(((1,), (2,))))
    with pytest.raises(AFDProtocolError, match="disagree on num_stages"):
        f.recv_control()
    assert not f.is_initialized
    for a in atts:
        a.close()


def _exchange(a: Any, ffns: list[Any], ids: list[int]) -> list[torch.Tensor]:
    """One step of one layer: token ``i`` (top-1 expert ``ids[i]``) dispatched by the round's
    expert map; each FFN rank answers ``hidden + 10 * (its slot + 1)``."""
    emap = a.topology.expert_map(4)
    topk = torch.tensor(ids).view(-1, 1)
    owners = emap.owner_table()[topk].flatten()
    counts = tuple(int((owners == r).sum()) for r in range(emap.num_ffn_ranks))

    def ffn(f: Any) -> None:
        f.recv_control()
        meta, payloads = f.recv_dispatch(0, 0)
        f.send_combine([p.hidden_states + 10 * (f.role_rank + 1) for p in payloads], meta)

    def attention() -> list[torch.Tensor]:
        a.send_control(AFDControlMessage(((len(ids),),)))
        payloads = [
            AFDPayload(
                torch.ones(n, 4),
                topk_ids=torch.zeros(n, 1, dtype=torch.int32),
                topk_weights=torch.ones(n, 1),
            )
            for n in counts
        ]
        return a.recv_combine(a.send_dispatch(payloads, AFDTransferMetadata(0, 0, counts)))

    got, *_ = in_threads(attention, *[lambda f=f: ffn(f) for f in ffns])
    return got


def test_elastic_ffn_slots_join_and_leave_through_rounds() -> None:
    port = next(_ports)
    kw = {"num_ffn_ranks": 2, "compute_gate_on_attention": True, "expert_replicas": 2}
    spec = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=1)
    a = conn("attention", port, spec=spec, **kw)
    f0, f1 = (conn("ffn", port, r, spec=spec, ffn_rank=r, **kw) for r in range(2))
    # Only slot 0 is up: it holds every expert (2 replicas of 2 slots), so the round forms with
    # it alone once no other slot claimed within the settle time.
    began = time.monotonic()
    assert in_threads(a.init, f0.init) == [None, None]
    assert time.monotonic() - began >= 2.0
    assert a.topology.members == (0,) and a.topology.world_size == 2 and f0.world_rank == 1
    assert a.topology.expert_map(4).owners == (0, 0, 0, 0)
    (out,) = _exchange(a, [f0], [0, 3])
    assert torch.equal(out, torch.full((2, 4), 11.0))
    assert not a.membership_pending()
    # Slot 1 starts: it finds round 1 formed without it, asks to join, and waits for a newer
    # round; the round's owner (Attention world rank 0) sees the request.
    joiner = threading.Thread(target=lambda: f1.init(), daemon=True)
    joiner.start()
    deadline = time.monotonic() + 10.0
    while not a.membership_pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.membership_pending() and not f1.is_initialized
    # The owner forms the round again (at a step boundary): both slots serve round 2.
    a.close()
    f0.close()
    assert in_threads(a.init, f0.init) == [None, None]
    joiner.join(10.0)
    assert f1.is_initialized
    assert a.topology.members == (0, 1) and (f0.world_rank, f1.world_rank) == (1, 2)
    assert a.generation == f0.generation == f1.generation
    # With both live the routing is the contiguous one: experts 0, 1 on slot 0, 2, 3 on slot 1.
    out0, out1 = _exchange(a, [f0, f1], [0, 3, 2])
    assert torch.equal(out0, torch.full((1, 4), 11.0))
    assert torch.equal(out1, torch.full((2, 4), 21.0))
    # Slot 0 is lost (no goodbye) and the Attention rank's next operation fails naming it: the
    # next round forms with slot 1 alone at once (not after SETTLE_S: the failure named the
    # lost slot), and slot 1 now computes slot 0's experts too.
    f0.abort("test", "slot 0 lost")
    a.send_control(AFDControlMessage(((2,),)))
    rows = [
        AFDPayload(
            torch.ones(1, 4),
            topk_ids=torch.zeros(1, 1, dtype=torch.int32),
            topk_weights=torch.ones(1, 1),
        )
    ] * 2
    with pytest.raises(AFDPeerError) as lost:
        a.recv_combine(a.send_dispatch(rows, AFDTransferMetadata(0, 0, (1, 1))))
    assert lost.value.rank == 1  # slot 0's world rank in round 2
    f1.close()
    began = time.monotonic()
    assert in_threads(a.init, f1.init) == [None, None]
    assert time.monotonic() - began < membership.SETTLE_S
    assert a.topology.members == (1,) and f1.world_rank == 1
    (out,) = _exchange(a, [f1], [0, 3])
    assert torch.equal(out, torch.full((2, 4), 21.0))
    a.close()
    f1.close()


def test_an_elastic_round_without_every_expert_times_out_naming_the_missing_slots() -> None:
    port = next(_ports)
    kw = {"num_ffn_ranks": 3, "compute_gate_on_attention": True, "expert_replicas": 2}
    spec = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=1)
    a = conn("attention", port, spec=spec, startup_timeout_s=3.0, **kw)
    f0 = conn("ffn", port, 0, spec=spec, ffn_rank=0, startup_timeout_s=3.0, **kw)
    ra, rf = in_threads(a.init, f0.init)
    assert isinstance(ra, AFDTimeoutError), ra
    assert "'members'" in str(ra) and "[0] of 3" in str(ra) and "every routed expert" in str(ra)
    assert isinstance(rf, AFDTimeoutError | AFDStartupError), rf


def test_a_rank_reconnecting_after_its_goodbye_does_not_watch_its_own_old_claim() -> None:
    from afd_core.session.rounds import LIVE_HOLDER_WATCH_S

    port = next(_ports)
    a, f = conn("attention", port), conn("ffn", port)
    in_threads(a.init, f.init)
    f.close()  # a clean leave: its goodbye is in round 1
    began = time.monotonic()
    reconnect = threading.Thread(target=f.init)
    reconnect.start()
    time.sleep(0.3)  # it finds round 1 (its own claim) before the Attention opens round 2
    a.close()
    a.init()
    reconnect.join(10.0)
    assert f.is_initialized and (a.generation, f.generation) == (2, 2)
    # Before: it watched its own stopped heartbeat for LIVE_HOLDER_WATCH_S first.
    assert time.monotonic() - began < LIVE_HOLDER_WATCH_S - 0.5
    # The same after a failure (published in round 2, no goodbye: e.g. its step broke).
    f.abort("recv_dispatch", "a peer was lost mid-step")
    began = time.monotonic()
    reconnect = threading.Thread(target=f.init)
    reconnect.start()
    time.sleep(0.3)
    a.close()
    a.init()
    reconnect.join(10.0)
    assert f.is_initialized and (a.generation, f.generation) == (3, 3)
    assert time.monotonic() - began < LIVE_HOLDER_WATCH_S - 0.5
    a.close()
    f.close()


def test_an_elastic_slot_failing_before_it_joins_fails_no_round() -> None:
    # Slot 1 fails to load; slot 0 holds every expert: the round forms with slot 0 and serves.
    # (Published under slot 1's configured world rank, 2, the failure would have been taken
    # for whichever slot a round numbers 2.)
    port = next(_ports)
    kw = {"num_ffn_ranks": 2, "compute_gate_on_attention": True, "expert_replicas": 2}
    spec = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=1)
    a = conn("attention", port, spec=spec, **kw)
    f0 = conn("ffn", port, 0, spec=spec, ffn_rank=0, **kw)

    def publish() -> bool:
        return InProcessConnector.publish_startup_failure(
            cfg("ffn", port, ffn_rank=1, **kw), 1, "load_model", "planted", timeout_s=5.0
        )

    ra, rf, delivered = in_threads(a.init, f0.init, publish)
    assert delivered is False
    assert (ra, rf) == (None, None) and a.topology.members == (0,)
    a.close()
    f0.close()
