"""The torch.distributed point-to-point connector (registered as ``"p2p"``).

Its session steps (1, 2, 4 and the failure publication below) are the shared session of
:mod:`afd_core.session`; this package moves bytes on the process groups it builds in step 3.

World: its own ``A + F`` ranks (Attention first, see :mod:`afd_core.topology`) on a TCPStore at
``config.host:config.port`` served by world rank 0; vLLM's process groups are never used.

Per initialisation (round ``g``: world rank 0 opens a new round at each of its ``init`` calls; the
other ranks join the newest; so any rank can close and initialise again):

1. connect to the store; namespace ``afd/g<g>``; claim the world rank there (a rank already
   claimed in that round waits for a newer one, then fails: a duplicate process, stage
   ``claim``);
2. handshake: every rank publishes protocol version, config agreement fields and hash, hidden
   size, dtype, layer count, topology, payload spec and device type, reads everyone else's, and
   raises :class:`AFDHandshakeError` naming the first differing field (so a mismatch fails on
   both sides); a failing rank publishes its failure so no peer waits for it;
3. a barrier, then two process groups: a Gloo *control* group (CPU ``int64`` control messages)
   and a *data* group whose backend follows the device (``cpu``: gloo, ``cuda``: nccl,
   ``npu``: hccl), with ``config.timeout_s`` as its timeout. Steps 1-3 wait at most
   ``config.startup_timeout_s`` in all (a peer role may still be loading its model);
4. liveness: each FFN rank adds to ``alive/<rank>`` on the store every second; each Attention
   rank reads its FFN peers' counters and, when one has not moved for ``LIVENESS_TIMEOUT_S``
   (10 s), records an :class:`AFDPeerError` (stage ``liveness``) as its
   :meth:`~afd_core.connector.AFDConnectorBase.peer_failure`: an FFN rank that died while no
   operation was pending is noticed without one. (An operation pending on a vanished peer fails
   at once: its connections drop.)

Per step (see :mod:`afd_core.connector` for the call order): every Attention rank sends its
per-stage token counts to each of its FFN ranks (fixed-size control message, tag per direction);
per layer and stage, for each FFN rank, the Attention rank posts the receive of the reply (gloo;
see below), then the ``(layer, stage, tokens)`` header when the transfer has one (``F > 1``, where
each FFN rank gets only the tokens routed to its experts, so the count is news; or
``check_sequence``), then a send per payload field (tag per stage and field), and returns
(``recv_combine`` only waits), so two stages can be in flight (DBO). With one FFN rank the count is
the announced one and no header travels. At most one reply receive per stage and FFN rank is
posted ahead: when a caller sends
several layers of a stage before it receives any reply (a stream), the later receives are posted in
send order, the next one as each reply comes in (or all up to the one asked for, when replies are
received out of order), so the FFN rank is not handed a receive notice per layer while it is busy
receiving. The FFN rank receives from each served Attention rank and sends back
``[tokens_i, hidden]``. Zero-token peers move no bytes.

Receives are posted ahead on gloo. A gloo receive notifies the sender, which writes the data at once
if the receive was posted first and otherwise waits for that notice: posting late costs a network
round trip (and a wake-up of the sender's I/O thread) per transfer. Besides the Attention side's
early reply receive, the FFN side (``recv_ahead``, on by default) uses what the control message
tells it (every stage's token counts for the whole step; with one FFN rank, where they are the
transfers' counts) to keep a *window* of receives posted per
stage and served Attention rank: as many transfers as fit in ``recv_ahead_bytes`` (2 MiB by default;
at most the layers left in the step, at most one with ``reuse_buffers``, none for a transfer larger
than the budget). The whole window serves streams (the caller receives several layers of a stage
before replying): it opens once a stream shows, and a stage that streamed has it posted when the
next control message arrives (small transfers: every layer of the step, so a stream moves with no
notice round trip at all). Request/reply keeps one receive ahead (the Attention rank cannot send the
next layer before it has the reply, so more would only cycle more buffers through the cache): posted
with the reply of layer ``l`` (its buffers and payload are taken earlier, when the caller asks for
layer ``l``, so only the posting sits between the data's arrival and the reply). The next step's
control receive is likewise posted when a control message arrives (after that step's first data
receives), and ``send_control`` does not wait for its message (except shutdown); the control wire
buffers are allocated once. Matching on the wire is unchanged (the first message on a (peer, tag)
goes to the first receive); only the moment a receive is posted moves. A step that stops before its
last layer leaves receives posted when its window was not empty: the next step may keep that stage's
count (the receives are then used); another count is refused with :class:`AFDProtocolError` by
``send_control`` before anything is sent (and checked again on the FFN side), because a posted gloo
receive cannot be withdrawn and a size mismatch aborts the receiving process. The Attention side
mirrors the window rule (both sides compute it from the handshaked payload spec and
``connector_extra_config``).

nccl and hccl post nothing ahead: they run a rank's sends and receives in call order on one device
stream, where a receive posted before a send its peer waits for would block that send (a
deadlock). There every receive is posted when it is asked for (the Attention side's reply receive
in ``recv_combine``, after the transfer's sends), and the call order on both roles must match
(these backends ignore tags).

Receive buffers come from :class:`afd_core.buffers.RecvBufferPool` (recycled on CPU, kept with
``reuse_buffers``, fresh elsewhere).

Invariants:
* Shapes, dtypes, devices, token counts (against the announced control counts) and layer index
  are validated before any byte is sent.
* Every wait is bounded by ``config.timeout_s`` (``recv_control`` may wait longer when asked, for
  idle service loops). Any transport error publishes this rank's failure on the store and tears
  the groups down (closing its connections so peers fail fast), then raises
  :class:`AFDPeerError` (naming the failed rank when one published a failure) or
  :class:`AFDTimeoutError`.
* ``close()`` is idempotent and safe after a partial init; ``init()`` after ``close()`` works.

Modules:

* :mod:`~afd_core.connector.p2p.connector`: :class:`P2PConnector`, the registered class, and its
  ``connector_extra_config`` keys;
* :mod:`~afd_core.connector.p2p.lifecycle`: a rank's state, the transport's part of the lifecycle
  (rendezvous TCPStore, process groups, teardown) and what both sides share (metadata checks,
  stage tags, the window); the session (rounds, handshake, liveness, failure publication,
  goodbye) is :mod:`afd_core.session`, shared with every transport;
* :mod:`~afd_core.connector.p2p.attention` / :mod:`~afd_core.connector.p2p.ffn`: each role's control and data plane;
* :mod:`~afd_core.connector.p2p.recv_ahead`: the receive-ahead window rule and the posted-receive records;
* :mod:`~afd_core.connector.p2p.wire`: protocol version, control-message layout and codec, tags;
* :mod:`~afd_core.connector.p2p.groups`: backend per device type and standalone process groups.
"""

from afd_core.connector.p2p.connector import P2PConnector
from afd_core.connector.p2p.groups import backend_for_device, make_process_group
from afd_core.connector.p2p.recv_ahead import RECV_AHEAD_BYTES
from afd_core.connector.p2p.wire import CONTROL_WORDS, PROTOCOL_VERSION

__all__ = [
    "CONTROL_WORDS",
    "PROTOCOL_VERSION",
    "RECV_AHEAD_BYTES",
    "P2PConnector",
    "backend_for_device",
    "make_process_group",
]
