"""AttentionLink: steps fail at once while the FFN role is gone, the link reconnects by itself.

An in-process fake connector stands in for the transport: ``lose()`` records a peer failure
(what the P2P connector's heartbeat watch or a failed operation does), ``init`` succeeds once
``available`` is set.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from afd_core.config import AFDConfig
from afd_core.connector import AFDConnectorBase, AFDTransferHandle
from afd_core.errors import AFDPeerError, AFDTimeoutError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_runtime import attention_link
from afd_runtime.attention_link import AFDFFNUnavailableError, AttentionLink

SPEC = AFDPayloadSpec(hidden_size=4, dtype=torch.float32)


class FakeConnector(AFDConnectorBase):
    name = "fake-link"
    has_control_plane = True

    def __init__(self) -> None:
        super().__init__(
            AFDConfig.from_mapping({"role": "attention"}), payload_spec=SPEC, num_layers=1
        )
        self.available = threading.Event()
        self.available.set()
        self.ready = False
        self.inits = 0
        self.calls: list[str] = []
        self.joining = threading.Event()  # an FFN slot asked to join (elastic FFN ranks)

    def init(self) -> None:
        if not self.available.is_set():
            time.sleep(0.01)
            raise AFDTimeoutError("AFD P2P init timed out in stage 'handshake'")
        self._clear_failure()
        self.inits += 1
        self.ready = True

    def close(self) -> None:
        self.calls.append("close")
        self.ready = False

    @property
    def is_initialized(self) -> bool:
        return self.ready

    def membership_pending(self) -> bool:
        return self.ready and self.joining.is_set()

    def lose(self) -> None:
        self.available.clear()
        self._record_failure(AFDPeerError(1, "liveness", "no heartbeat for 10.0s"))

    def send_control(self, message: AFDControlMessage) -> None:
        self.calls.append("goodbye" if message.shutdown else "control")

    def send_dispatch(self, payloads: Any, metadata: AFDTransferMetadata) -> Any:
        return AFDTransferHandle(metadata, [p.hidden_states for p in payloads], id(self))

    def recv_combine(self, handle: AFDTransferHandle) -> list[torch.Tensor]:
        return list(handle.state)

    def recv_dispatch(
        self, layer_idx: int, stage_idx: int
    ) -> tuple[AFDTransferMetadata, list[AFDPayload]]:
        raise NotImplementedError  # FFN side: unused here

    def send_combine(self, outputs: Any, metadata: AFDTransferMetadata) -> None:
        raise NotImplementedError  # FFN side: unused here


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_link, "RECONNECT_RETRY_S", 0.02)
    monkeypatch.setattr(attention_link, "SUPERVISE_POLL_S", 0.02)


def _wait(cond: Any, bound_s: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < bound_s, "condition not reached"
        time.sleep(0.01)


def test_loss_between_steps_fails_steps_at_once_then_reconnects() -> None:
    conn = FakeConnector()
    link = AttentionLink(conn, name="rank 0")
    link.connect()
    with link.step() as c:
        assert c is conn
    assert link.health() is None and link.is_up

    conn.lose()
    reason = link.health()
    assert reason is not None and "FFN world rank 1" in reason and "liveness" in reason
    _wait(lambda: "close" in conn.calls)  # the supervisor closed the connector
    t0 = time.monotonic()
    with pytest.raises(AFDFFNUnavailableError) as err, link.step():
        pytest.fail("a step ran while the FFN role was unavailable")
    assert time.monotonic() - t0 < 0.5
    assert err.value.rank == 1 and err.value.stage == "liveness"
    assert str(err.value).startswith("AFD FFN role unavailable: FFN world rank 1")

    conn.available.set()  # the FFN role is back
    _wait(lambda: link.is_up)
    assert conn.inits == 2 and link.reconnects == 1 and link.health() is None
    with link.step() as c:
        assert c is conn
    link.close()
    assert conn.calls[-2:] == ["goodbye", "close"]
    link.close()  # idempotent
    assert conn.calls.count("goodbye") == 1


def test_failure_inside_a_step_is_the_ffn_role_s_only_when_the_connector_says_so() -> None:
    conn = FakeConnector()
    link = AttentionLink(conn)
    link.connect()
    # A bug inside a step (no connector failure) passes through unchanged; the link stays up.
    with pytest.raises(ValueError, match="model bug"), link.step():
        raise ValueError("model bug")
    assert link.is_up
    # An operation failing because the FFN is gone: the connector recorded it.
    with pytest.raises(AFDFFNUnavailableError) as err, link.step():
        conn.lose()
        raise RuntimeError("Connection closed by peer")
    assert isinstance(err.value.__cause__, RuntimeError)
    assert err.value.rank == 1
    conn.available.set()
    _wait(lambda: link.is_up)
    link.close()


def test_a_joining_ffn_slot_reforms_the_round_between_steps_with_a_goodbye() -> None:
    conn = FakeConnector()
    link = AttentionLink(conn, name="rank 0")
    link.connect()
    conn.available.clear()  # the re-formed round is not ready yet
    with link.step():
        conn.joining.set()  # a slot asks while a step runs: the step is not interrupted
        time.sleep(0.1)
        assert "goodbye" not in conn.calls and link.is_up
    _wait(lambda: "close" in conn.calls)
    # Between steps: a goodbye (the FFN ranks come to the next round at once), then a close.
    assert conn.calls[-2:] == ["goodbye", "close"]
    with pytest.raises(AFDFFNUnavailableError, match="asked to join"), link.step():
        pytest.fail("a step ran while the round was re-formed")
    conn.joining.clear()
    conn.available.set()
    _wait(lambda: link.is_up)
    assert conn.inits == 2 and link.reconnects == 1
    link.close()


def test_close_while_down_sends_no_goodbye() -> None:
    conn = FakeConnector()
    link = AttentionLink(conn)
    link.connect()
    conn.lose()
    _wait(lambda: "close" in conn.calls)
    link.close()
    assert "goodbye" not in conn.calls
    conn.available.set()
    time.sleep(0.1)
    assert conn.inits == 1  # a closed link does not reconnect
