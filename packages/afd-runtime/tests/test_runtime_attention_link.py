"""AttentionLink: steps fail at once while the FFN role is gone, the link reconnects by itself.

Both roles are afd-core's in-process connector (:class:`afd_core.connector.inprocess.
InProcessConnector`): the real session's liveness (the FFN rank's heartbeat, watched by the
Attention rank), goodbye, failure publication, rounds and elastic joins. The FFN rank is driven
from the test thread (its replies are computed between the Attention side's ``send_dispatch``
and ``recv_combine``); only pairings, which need both sides at once, run on threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig
from afd_core.connector import create_connector
from afd_core.errors import AFDPeerError, AFDStartupError, AFDTimeoutError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.session import liveness
from afd_core.testing import free_port
from afd_runtime import attention_link
from afd_runtime.attention_link import AFDFFNUnavailableError, AttentionLink

SPEC = AFDPayloadSpec(hidden_size=4, dtype=torch.float32)
ELASTIC = {"num_ffn_ranks": 2, "compute_gate_on_attention": True, "expert_replicas": 2}
ELASTIC_SPEC = AFDPayloadSpec(hidden_size=4, dtype=torch.float32, top_k=1)


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_link, "RECONNECT_RETRY_S", 0.02)
    monkeypatch.setattr(attention_link, "SUPERVISE_POLL_S", 0.02)
    monkeypatch.setattr(liveness, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(liveness, "LIVENESS_TIMEOUT_S", 1.0)


def _connector(role: str, port: int, rank: int = 0, spec: AFDPayloadSpec = SPEC, **kw: Any) -> Any:
    raw = {"role": role, "connector": "inprocess", "port": port, "timeout_s": 10.0}
    raw.update({"startup_timeout_s": 20.0, **kw})
    return create_connector(AFDConfig.from_mapping(raw), rank, payload_spec=spec, num_layers=1)


def _pair(*calls: Callable[[], Any]) -> None:
    """Run ``calls`` (inits that pair with each other) on threads; re-raise the first error."""
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a pairing did not end within 60s"
    if errors:
        raise errors[0]


def _wait(cond: Callable[[], Any], bound_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound_s, "condition not reached"
        time.sleep(0.01)


def _round_trip(link: AttentionLink, ffn: Any, scale: float = 3.0) -> None:
    """One real step through the link: the FFN rank replies ``hidden * scale``."""
    with link.step() as c:
        c.send_control(AFDControlMessage(((2,),)))
        handle = c.send_dispatch([AFDPayload(torch.ones(2, 4))], AFDTransferMetadata(0, 0, (2,)))
        ctl = ffn.recv_control(timeout_s=10.0)
        assert not ctl.shutdown
        meta, payloads = ffn.recv_dispatch(0, 0)
        ffn.send_combine([p.hidden_states * scale for p in payloads], meta)
        (out,) = c.recv_combine(handle)
    assert torch.equal(out, torch.full((2, 4), scale))


def _said_goodbye(ffn: Any) -> bool:
    """The FFN rank's next control message is the Attention rank's goodbye."""
    return bool(ffn.recv_control(timeout_s=10.0).shutdown)


def test_loss_between_steps_fails_steps_at_once_then_reconnects() -> None:
    port = free_port()
    conn, ffn = _connector("attention", port), _connector("ffn", port)
    link = AttentionLink(conn, name="rank 0")
    _pair(link.connect, ffn.init)
    _round_trip(link, ffn)
    assert link.health() is None and link.is_up

    ffn.session.close(goodbye=False)  # the FFN rank stalls: its heartbeat stops, no goodbye
    _wait(lambda: link.is_reconnecting)  # the watcher saw it; the supervisor closed and re-inits
    assert not conn.is_initialized
    reason = link.health()
    assert reason is not None and "FFN world rank 1" in reason and "liveness" in reason
    t0 = time.monotonic()
    with pytest.raises(AFDFFNUnavailableError) as err, link.step():
        pytest.fail("a step ran while the FFN role was unavailable")
    assert time.monotonic() - t0 < 0.5
    assert err.value.rank == 1 and err.value.stage == "liveness"
    assert str(err.value).startswith("AFD FFN role unavailable: FFN world rank 1")

    ffn.close()
    ffn.init()  # the FFN role is back: it pairs with the supervisor's reconnection
    _wait(lambda: link.is_up)
    assert link.reconnects == 1 and link.health() is None and not link.is_reconnecting
    assert conn.generation == ffn.generation == 2
    _round_trip(link, ffn, scale=5.0)  # the next step runs on the new connection
    link.close()
    assert _said_goodbye(ffn)
    link.close()  # idempotent: no second goodbye; the FFN rank sees the Attention rank gone
    with pytest.raises(AFDPeerError) as gone:
        ffn.recv_control(timeout_s=10.0)
    assert gone.value.stage == "goodbye"
    ffn.close()


def test_failure_inside_a_step_is_the_ffn_role_s_only_when_the_connector_says_so() -> None:
    port = free_port()
    conn, ffn = _connector("attention", port), _connector("ffn", port)
    link = AttentionLink(conn)
    _pair(link.connect, ffn.init)
    # A bug inside a step (no connector failure) passes through unchanged; the link stays up.
    with pytest.raises(ValueError, match="model bug"), link.step():
        raise ValueError("model bug")
    assert link.is_up
    _round_trip(link, ffn)
    # An operation failing because the FFN rank failed: it published why, the wait ends.
    with pytest.raises(AFDFFNUnavailableError) as err, link.step() as c:
        c.send_control(AFDControlMessage(((1,),)))
        handle = c.send_dispatch([AFDPayload(torch.ones(1, 4))], AFDTransferMetadata(0, 0, (1,)))
        ffn.recv_control(timeout_s=10.0)
        ffn.recv_dispatch(0, 0)
        ffn.abort("ffn compute (layer 0)", "ValueError: planted compute failure")
        c.recv_combine(handle)
    assert isinstance(err.value.__cause__, AFDPeerError)
    assert err.value.rank == 1 and err.value.stage == "ffn compute (layer 0)"
    assert "planted compute failure" in str(err.value)
    assert not link.is_up
    ffn.init()  # the FFN rank restarts
    _wait(lambda: link.is_up)
    assert link.reconnects == 1
    _round_trip(link, ffn)
    link.close()
    assert _said_goodbye(ffn)
    ffn.close()


def test_a_joining_ffn_slot_reforms_the_round_between_steps_with_a_goodbye() -> None:
    port = free_port()
    conn = _connector("attention", port, spec=ELASTIC_SPEC, **ELASTIC)
    f0, f1 = (
        _connector("ffn", port, r, spec=ELASTIC_SPEC, ffn_rank=r, **ELASTIC) for r in range(2)
    )
    link = AttentionLink(conn, name="rank 0")
    # Slot 0 alone holds every expert (2 replicas of 2 slots): the round forms with it.
    _pair(link.connect, f0.init)
    assert conn.topology.members == (0,)
    joiner = threading.Thread(target=f1.init, daemon=True)
    with link.step() as c:
        joiner.start()  # slot 1 asks to join while a step runs
        _wait(conn.membership_pending)  # the round's owner sees the request ...
        # ... and the step still runs to its end on the current round.
        c.send_control(AFDControlMessage(((1,),)))
        payload = AFDPayload(
            torch.ones(1, 4),
            topk_ids=torch.zeros(1, 1, dtype=torch.int32),
            topk_weights=torch.ones(1, 1),
        )
        handle = c.send_dispatch([payload], AFDTransferMetadata(0, 0, (1,)))
        f0.recv_control(timeout_s=10.0)
        meta, payloads = f0.recv_dispatch(0, 0)
        f0.send_combine([p.hidden_states + 10 for p in payloads], meta)
        (out,) = c.recv_combine(handle)
        assert torch.equal(out, torch.full((1, 4), 11.0)) and link.is_up
    # Between steps: a goodbye to the serving slot (it comes to the next round at once).
    assert _said_goodbye(f0)
    with pytest.raises(AFDFFNUnavailableError, match="asked to join"), link.step():
        pytest.fail("a step ran while the round was re-formed")
    f0.close()
    f0.init()
    joiner.join(30)
    assert not joiner.is_alive() and f1.is_initialized
    _wait(lambda: link.is_up)
    assert link.reconnects == 1 and conn.topology.members == (0, 1)
    assert conn.generation == f0.generation == f1.generation
    link.close()
    assert _said_goodbye(f0) and _said_goodbye(f1)
    f0.close()
    f1.close()


def test_close_while_down_sends_no_goodbye_and_ends_the_reconnection() -> None:
    port = free_port()
    conn, ffn = _connector("attention", port), _connector("ffn", port)
    link = AttentionLink(conn)
    _pair(link.connect, ffn.init)
    ffn.session.close(goodbye=False)  # the FFN rank stalls
    _wait(lambda: link.is_reconnecting)  # the link is down and its supervisor re-initialises
    link.close()
    # No goodbye: the stalled rank's control queue holds nothing (a goodbye sent by close()
    # would be there already), and the Attention rank never said it left.
    with pytest.raises(AFDTimeoutError):
        ffn.recv_control(timeout_s=0.5)
    # The reconnection ended with close(): the supervisor thread is gone, so nothing can
    # answer an FFN rank that comes back. Its start fails: it finds the cancelled attempt's
    # published reason, or (had none been published) waits its whole window alone.
    assert not link.is_supervising and not conn.is_initialized
    back = _connector("ffn", port, startup_timeout_s=1.0)
    with pytest.raises((AFDStartupError, AFDTimeoutError)) as refused:
        back.init()
    if isinstance(refused.value, AFDStartupError):
        assert refused.value.rank == 0 and "the Attention link closed" in str(refused.value)
    assert not back.is_initialized
    assert link.reconnects == 0 and not conn.is_initialized
