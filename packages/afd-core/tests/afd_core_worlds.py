"""Rank functions for afd-core's multi-process tests (imported by spawned children by name).

Every function takes ``rank`` (the connector world rank) first and returns picklable results; the
test asserts on them. Data are generated from seeds both roles know, so each side can check
exactly what it received with ``torch.equal``.
"""

from __future__ import annotations

import math
import os
import random
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector.p2p import P2PConnector
from afd_core.errors import AFDError
from afd_core.metadata import AFDControlMessage, AFDPayload, AFDPayloadSpec, AFDTransferMetadata
from afd_core.topology import AFDTopology

NUM_LAYERS = 2
NUM_STAGES = 2
NUM_EXPERTS = 8
TOP_K = 2

VARIANTS: dict[str, dict[str, Any]] = {
    "hidden_f32": {"dtype": torch.float32},
    "hidden_bf16_logits": {
        "dtype": torch.bfloat16,
        "router_logits_width": NUM_EXPERTS,
        "router_logits_dtype": torch.float32,
    },
    "hidden_f16_topk": {"dtype": torch.float16, "top_k": TOP_K},
    "hidden_input_ids": {"dtype": torch.float32, "input_ids": True},
    "all_fields": {
        "dtype": torch.bfloat16,
        "router_logits_width": NUM_EXPERTS,
        "top_k": TOP_K,
        "input_ids": True,
    },
}


def _flag(port: int, name: str) -> str:
    """A file one rank of the world on ``port`` creates and another waits for."""
    return os.path.join(tempfile.gettempdir(), f"afd-worlds-{port}-{name}")


def _raise_flag(port: int, name: str) -> None:
    with open(_flag(port, name), "w"):
        pass


def _wait_flag(port: int, name: str, bound_s: float) -> bool:
    """Poll for the flag up to ``bound_s``; True once it is there (then removed)."""
    path = _flag(port, name)
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            os.unlink(path)
            return True
        time.sleep(0.05)
    return False


def spec_for(variant: str, hidden: int = 16) -> AFDPayloadSpec:
    return AFDPayloadSpec(hidden_size=hidden, **VARIANTS[variant])


def token_counts(seed: int, step: int, num_attention: int, allow_zero: bool) -> list[list[int]]:
    """counts[stage][attention_rank], uneven in 1..64 (one 0 when ``allow_zero``)."""
    rng = random.Random(seed * 1000 + step)
    counts = [[rng.randint(1, 64) for _ in range(num_attention)] for _ in range(NUM_STAGES)]
    if allow_zero and step == 1:
        counts[1][num_attention - 1] = 0
    return counts


def make_payload(
    spec: AFDPayloadSpec, seed: int, step: int, layer: int, stage: int, arank: int, n: int
) -> AFDPayload:
    gen = torch.Generator().manual_seed(hash((seed, step, layer, stage, arank)) % (2**31))
    fields: dict[str, torch.Tensor] = {}
    for f in spec.fields:
        shape = f.shape(n)
        if f.dtype.is_floating_point:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(f.dtype)
        else:
            t = torch.randint(0, 1000, shape, generator=gen, dtype=torch.int64).to(f.dtype)
        fields[f.name] = t
    return AFDPayload(**fields)


def ffn_reply(payload: AFDPayload, layer: int) -> torch.Tensor:
    # Exact in every float dtype (scaling by a power of two).
    return payload.hidden_states * (2.0 if layer % 2 == 0 else 0.5)


def _config(rank_role: AFDRole, port: int, a: int, f: int, **kw: Any) -> AFDConfig:
    timeout_s = kw.pop("timeout_s", 20.0)
    return AFDConfig(
        role=rank_role,
        port=port,
        num_attention_ranks=a,
        num_ffn_ranks=f,
        timeout_s=timeout_s,
        startup_timeout_s=kw.pop("startup_timeout_s", timeout_s),
        **kw,
    )


def roundtrip_rank(
    rank: int,
    port: int,
    a: int,
    f: int,
    variants: list[str],
    steps: int,
    seed: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every variant: init, ``steps`` steps of control + layers x stages, exact checks, close."""
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, a, f, connector_extra_config=extra or {})
    report: dict[str, Any] = {"role": str(role), "checked": 0, "mismatches": []}
    for variant in variants:
        spec = spec_for(variant)
        conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=NUM_LAYERS)
        conn.init()
        assert conn.is_initialized
        for step in range(steps):
            counts = token_counts(seed, step, a, allow_zero=a > 1)
            if role is AFDRole.ATTENTION:
                mine = tuple((c[role_rank],) for c in counts)
                # Alternate between announcing own counts and the full table.
                msg = AFDControlMessage(mine if step % 2 == 0 else tuple(tuple(c) for c in counts))
                conn.send_control(msg)
                ptrs: set[int] = set()
                for layer in range(NUM_LAYERS):
                    handles = []
                    sent = []
                    for stage in range(NUM_STAGES):
                        n = counts[stage][role_rank]
                        p = make_payload(spec, seed, step, layer, stage, role_rank, n)
                        meta = AFDTransferMetadata(layer, stage, (n,))
                        handles.append(conn.send_dispatch([p], meta))
                        sent.append(p)
                    for stage, (h, p) in enumerate(zip(handles, sent, strict=True)):
                        out = conn.recv_combine(h)[0]
                        if stage == 0:
                            ptrs.add(out.data_ptr())
                        expected = ffn_reply(p, layer)
                        report["checked"] += 1
                        if not torch.equal(out, expected):
                            report["mismatches"].append((variant, step, layer, stage, "reply"))
                # With reuse_buffers, every layer's stage-0 reply lands in the same buffer.
                report.setdefault("reply_buffers_per_step", []).append(len(ptrs))
            else:
                served = topo.attention_ranks_for(role_rank)
                ctl = conn.recv_control()
                want = tuple(tuple(c[r] for r in served) for c in counts)
                if ctl.stage_token_counts != want:
                    report["mismatches"].append((variant, step, "control", ctl.stage_token_counts))
                for layer in range(NUM_LAYERS):
                    for stage in range(NUM_STAGES):
                        meta, payloads = conn.recv_dispatch(layer, stage)
                        if meta != ctl.transfer_metadata(layer, stage):
                            report["mismatches"].append((variant, step, layer, "counts"))
                        for arank, got in zip(served, payloads, strict=True):
                            n = counts[stage][arank]
                            exp = make_payload(spec, seed, step, layer, stage, arank, n)
                            report["checked"] += 1
                            if got.present_fields != exp.present_fields:
                                report["mismatches"].append((variant, step, layer, "fields"))
                            for name, t in exp.tensors().items():
                                if not torch.equal(getattr(got, name), t):
                                    report["mismatches"].append((variant, step, layer, name))
                        replies = [ffn_reply(p, layer) for p in payloads]
                        if stage == 0:
                            conn.send_combine(replies, meta)
                        else:  # the concatenated form
                            conn.send_combine(torch.cat(replies), meta)
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage.shutdown_message())
        else:
            report["shutdown"] = conn.recv_control().shutdown
        conn.close()
        conn.close()  # idempotent
        assert not conn.is_initialized
    return report


def _err(err: BaseException) -> dict[str, Any]:
    return {
        "type": type(err).__name__,
        "field": getattr(err, "field", None),
        "rank": getattr(err, "rank", None),
        "peer_rank": getattr(err, "peer_rank", None),
        "stage": getattr(err, "stage", None),
        "msg": str(err),
    }


def handshake_and_validation_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world: three mismatching inits, then a good one with bad-payload checks, close,
    re-init and one clean round trip."""
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    out: dict[str, Any] = {}
    cfg = _config(role, port, 1, 1, timeout_s=15.0)

    # 1. hidden size differs.
    spec = AFDPayloadSpec(hidden_size=16 if rank == 0 else 32, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=2)
    try:
        conn.init()
        out["hidden"] = None
    except AFDError as err:
        out["hidden"] = _err(err)
    out["hidden_initialized"] = conn.is_initialized
    conn.close()

    # 2. gate placement (config agreement) differs.
    cfg2 = _config(role, port, 1, 1, timeout_s=15.0, compute_gate_on_attention=rank == 0)
    spec = AFDPayloadSpec(hidden_size=16, dtype=torch.float32)
    conn = P2PConnector(cfg2, topo, role_rank, payload_spec=spec, num_layers=2)
    try:
        conn.init()
        out["gate"] = None
    except AFDError as err:
        out["gate"] = _err(err)
    conn.close()

    # 2b. the number of stages (config agreement) differs.
    cfg_stages = _config(role, port, 1, 1, timeout_s=15.0, num_stages=2 if rank == 0 else 1)
    conn = P2PConnector(cfg_stages, topo, role_rank, payload_spec=spec, num_layers=2)
    try:
        conn.init()
        out["stages"] = None
    except AFDError as err:
        out["stages"] = _err(err)
    conn.close()

    # 3. payload spec (router logits width) and layer count differ on the FFN side.
    spec3 = AFDPayloadSpec(
        hidden_size=16, dtype=torch.float32, router_logits_width=8 if rank == 0 else 4
    )
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec3, num_layers=2)
    try:
        conn.init()
        out["spec"] = None
    except AFDError as err:
        out["spec"] = _err(err)
    conn.close()

    # 4. agreement; bad payloads are rejected before any byte moves.
    spec4 = AFDPayloadSpec(hidden_size=16, dtype=torch.float32, router_logits_width=8)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec4, num_layers=2)
    conn.init()
    bad: dict[str, Any] = {}
    h = torch.ones(5, 16)
    logits = torch.ones(5, 8)
    if role is AFDRole.ATTENTION:
        conn.send_control(AFDControlMessage(((5,),)))
        cases = {
            "hidden_width": (AFDPayload(torch.ones(5, 15), logits), (5,), 0),
            "hidden_dtype": (AFDPayload(h.half(), logits), (5,), 0),
            "rows": (AFDPayload(torch.ones(4, 16), logits), (5,), 0),
            "logits_missing": (AFDPayload(h), (5,), 0),
            "logits_dtype": (AFDPayload(h, logits.double()), (5,), 0),
            "extra_field": (
                AFDPayload(h, logits, input_ids=torch.ones(5, dtype=torch.long)),
                (5,),
                0,
            ),
            "not_announced": (AFDPayload(torch.ones(6, 16), torch.ones(6, 8)), (6,), 0),
            # One FFN rank gets every token: fewer than announced is refused too.
            "under_announced": (AFDPayload(torch.ones(4, 16), torch.ones(4, 8)), (4,), 0),
            "layer": (AFDPayload(h, logits), (5,), 2),
            "stage": (AFDPayload(h, logits), (5,), 0),
        }
        for name, (payload, counts, layer) in cases.items():
            stage = 1 if name == "stage" else 0
            try:
                conn.send_dispatch([payload], AFDTransferMetadata(layer, stage, counts))
                bad[name] = None
            except AFDError as err:
                bad[name] = _err(err)
        # The good transfer after all rejections: nothing stray reached the FFN rank.
        handle = conn.send_dispatch(
            [AFDPayload(h * 3, logits * 4)], AFDTransferMetadata(0, 0, (5,))
        )
        out["after_bad"] = torch.equal(conn.recv_combine(handle)[0], h * 3 + 1)
    else:
        ctl = conn.recv_control()
        meta = ctl.transfer_metadata(0, 0)
        for name, outputs in {
            "out_rows": [torch.ones(4, 16)],
            "out_dtype": [torch.ones(5, 16, dtype=torch.float64)],
            "out_count": [h, h],
        }.items():
            try:
                conn.send_combine(outputs, meta)
                bad[name] = None
            except AFDError as err:
                bad[name] = _err(err)
        got, (payload,) = conn.recv_dispatch(0, 0)
        out["after_bad"] = (
            got == meta
            and torch.equal(payload.hidden_states, h * 3)
            and torch.equal(payload.router_logits, logits * 4)
        )
        conn.send_combine([payload.hidden_states + 1], meta)
    out["bad"] = bad
    gen_before = conn.generation
    conn.close()
    conn.close()
    # 5. re-init the same object after close, one more round trip.
    conn.init()
    out["generation_advanced"] = conn.generation > gen_before
    if role is AFDRole.ATTENTION:
        conn.send_control(AFDControlMessage(((3,),)))
        handle = conn.send_dispatch(
            [AFDPayload(torch.full((3, 16), 7.0), torch.zeros(3, 8))],
            AFDTransferMetadata(1, 0, (3,)),
        )
        out["reinit_ok"] = torch.equal(conn.recv_combine(handle)[0], torch.full((3, 16), 8.0))
    else:
        conn.recv_control()
        meta, (payload,) = conn.recv_dispatch(1, 0)
        conn.send_combine(payload.hidden_states + 1, meta)
        out["reinit_ok"] = torch.equal(payload.hidden_states, torch.full((3, 16), 7.0))
    conn.close()

    # 6. sequence check: the Attention side sends layer 1 where the FFN expects layer 0.
    cfg6 = _config(
        role, port, 1, 1, timeout_s=15.0, connector_extra_config={"check_sequence": True}
    )
    conn = P2PConnector(cfg6, topo, role_rank, payload_spec=spec, num_layers=2)
    conn.init()
    try:
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage(((2,),)))
            handle = conn.send_dispatch(
                [AFDPayload(torch.ones(2, 16))], AFDTransferMetadata(1, 0, (2,))
            )
            conn.recv_combine(handle)
        else:
            conn.recv_control()
            conn.recv_dispatch(0, 0)
        out["sequence"] = None
    except AFDError as err:
        out["sequence"] = _err(err)
    out["sequence_initialized_after"] = conn.is_initialized
    conn.close()
    return out


def kill_pair_by_proc(proc: int, port_a: int, port_b: int, port_c: int) -> dict[int, Any]:
    """Two independent 2:1 worlds in four processes (survivors as threads, victims alone).

    World A (results keyed 0-2): the FFN rank (world 2, process 1) is killed while it holds
    the layer-2 payloads. World B (keyed 3-5): Attention rank 1 (world 1, process 3) is killed
    between layers.
    """
    if proc == 0:
        return run_threads(kill_rank, [0, 1], port_a, 2, "ffn_step1_layer2")
    if proc == 1:
        return {2: ("ok", kill_rank(2, port_a, 2, "ffn_step1_layer2"))}
    if proc == 2:
        got = run_threads(kill_rank, [0, 2], port_b, 1, "attn_step0_layer3")
        return {r + 3: v for r, v in got.items()}
    if proc == 3:
        return {4: ("ok", kill_rank(1, port_b, 1, "attn_step0_layer3"))}
    # World C (keyed 6-7, 1:1): the Attention rank (also the store server) dies between steps
    # while the FFN rank idles in recv_control(timeout_s=inf).
    if proc == 4:
        return {6: ("ok", idle_kill_rank(0, port_c))}
    return {7: ("ok", idle_kill_rank(1, port_c))}


def idle_kill_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world; after one step the Attention rank SIGKILLs itself; the FFN rank waits for the
    next step with an unbounded ``recv_control`` and must still raise."""
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=8.0, startup_timeout_s=60.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    conn.init()
    try:
        for _ in range(2):
            if role is AFDRole.ATTENTION:
                conn.send_control(AFDControlMessage(((2,),)))
                handle = conn.send_dispatch(
                    [AFDPayload(torch.ones(2, 8))], AFDTransferMetadata(0, 0, (2,))
                )
                conn.recv_combine(handle)
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                conn.recv_control(timeout_s=math.inf)
                meta, (payload,) = conn.recv_dispatch(0, 0)
                conn.send_combine([payload.hidden_states], meta)
    except AFDError as err:
        result = _err(err)
        result["initialized_after"] = conn.is_initialized
        conn.close()
        return result
    conn.close()
    return {"type": None}


def kill_rank(rank: int, port: int, victim: int, point: str) -> dict[str, Any]:
    """2:1 world; ``victim`` SIGKILLs itself at ``point``; survivors report what they raised."""
    topo = AFDTopology(2, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 2, 1, timeout_s=8.0, startup_timeout_s=60.0)
    spec = AFDPayloadSpec(hidden_size=64, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=4)
    conn.init()
    started = time.monotonic()

    def die_if(here: str) -> None:
        if rank == victim and point == here:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        for step in range(3):
            if role is AFDRole.ATTENTION:
                conn.send_control(AFDControlMessage(((10 + role_rank,),)))
                for layer in range(4):
                    die_if(f"attn_step{step}_layer{layer}")
                    handle = conn.send_dispatch(
                        [AFDPayload(torch.ones(10 + role_rank, 64))],
                        AFDTransferMetadata(layer, 0, (10 + role_rank,)),
                    )
                    conn.recv_combine(handle)
            else:
                conn.recv_control()
                for layer in range(4):
                    meta, payloads = conn.recv_dispatch(layer, 0)
                    die_if(f"ffn_step{step}_layer{layer}")
                    conn.send_combine([p.hidden_states for p in payloads], meta)
    except AFDError as err:
        result = _err(err)
        result["initialized_after"] = conn.is_initialized
        result["elapsed"] = time.monotonic() - started
        conn.close()
        return result
    conn.close()
    return {"type": None}


def run_threads(
    fn: Callable[..., Any], ranks: Iterable[int], *args: Any, timeout_s: float = 120.0
) -> dict[int, tuple[Any, ...]]:
    """Run ``fn(rank, *args)`` for several world ranks as threads of this process.

    Gloo waits release the GIL, so the ranks progress independently; each rank's outcome is
    reported like :func:`afd_core.testing.run_world` does.
    """
    results: dict[int, tuple[Any, ...]] = {}

    def target(rank: int) -> None:
        try:
            results[rank] = ("ok", fn(rank, *args))
        except BaseException as err:
            results[rank] = ("error", f"{type(err).__name__}: {err}", traceback.format_exc())

    threads = {r: threading.Thread(target=target, args=(r,), daemon=True) for r in ranks}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + timeout_s
    for r, t in threads.items():
        t.join(max(deadline - time.monotonic(), 0.0))
        if t.is_alive():
            results[r] = ("timeout", None)
    return results


def roundtrip_by_role(proc: int, port: int, a: int, f: int, *args: Any) -> dict[int, Any]:
    """Process 0 hosts the Attention ranks, process 1 the FFN ranks (one thread per rank)."""
    ranks = range(a) if proc == 0 else range(a, a + f)
    return run_threads(roundtrip_rank, ranks, port, a, f, *args)


def row_gather(rank: int, port: int, world_size: int) -> list[list[float]]:
    """All-gather rank-dependent rows of uneven content through ``torch_row_gather``."""
    import torch.distributed as dist
    from afd_core.collectives import torch_row_gather

    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        local = torch.arange(6, dtype=torch.float32).reshape(3, 2) + 100 * rank
        gathered = torch_row_gather(None)(local)
        empty = torch_row_gather(dist.group.WORLD)(torch.empty(0, 2))
        assert empty.shape == (0, 2)
        return gathered.tolist()
    finally:
        dist.destroy_process_group()


def recv_ahead_rank(rank: int, port: int, side_port: int) -> dict[str, Any]:
    """1:1 world, 3 layers: the FFN rank's early receives (``recv_ahead``).

    1. Step 0: the Attention rank's layer-0 send completes *before* the FFN rank calls
       ``recv_dispatch`` (the FFN rank waits for a side-channel key the Attention rank sets
       only after its send work finished): only a receive posted at ``recv_control`` allows it.
    2. Step 1 stops after layer 0 (a receive stays posted); step 2 announces the same count, so
       the posted receive is kept and every layer arrives exactly.
    3. Step 3 stops after layer 0; step 4 announces another count: the FFN rank raises
       :class:`AFDProtocolError` naming the stage, the Attention rank a peer error.
    """
    import torch.distributed as dist

    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=20.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=3)
    side = dist.TCPStore("127.0.0.1", side_port, 2, rank == 0, timedelta_s(30))
    conn.init()
    out: dict[str, Any] = {"exact": [], "posted_after": []}

    def data(step: int, layer: int, n: int) -> torch.Tensor:
        return torch.full((n, 8), float(step * 10 + layer))

    def attention_step(step: int, n: int, layers: int) -> None:
        conn.send_control(AFDControlMessage(((n,),)))
        for layer in range(layers):
            handle = conn.send_dispatch(
                [AFDPayload(data(step, layer, n))], AFDTransferMetadata(layer, 0, (n,))
            )
            if step == 0 and layer == 0:
                (state,) = handle.state  # one FFN rank: one pending transfer
                for work in state.send_works:
                    work.wait(timedelta_s(10))
                state.send_works = []  # a gloo work completes one wait only
                side.set("sent", "1")
            reply = conn.recv_combine(handle)[0]
            out["exact"].append(torch.equal(reply, data(step, layer, n) + 1))

    def ffn_step(step: int, layers: int) -> None:
        conn.recv_control()
        if step == 0:
            side.wait(["sent"], timedelta_s(20))
        for layer in range(layers):
            meta, (payload,) = conn.recv_dispatch(layer, 0)
            out["exact"].append(
                torch.equal(payload.hidden_states, data(step, layer, meta.num_tokens[0]))
            )
            conn.send_combine([payload.hidden_states + 1], meta)
            out["posted_after"].append((step, layer, sorted(s for s, _ in conn._posted)))

    try:
        for step, (n, layers) in enumerate([(4, 3), (4, 1), (4, 3), (4, 1), (5, 3)]):
            if role is AFDRole.ATTENTION:
                attention_step(step, n, layers)
            else:
                ffn_step(step, layers)
        out["error"] = None
    except AFDError as err:
        out["error"] = _err(err)
        out["error_step"] = step
    out["initialized_after"] = conn.is_initialized
    conn.close()
    return out


def timedelta_s(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def stream_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world, 4 layers, sequence check on: each step the Attention rank sends every layer
    before it waits for a reply and the FFN rank receives every layer before it replies (the
    receive-ahead stream mode); the second step's count differs (nothing left posted) and its
    replies are received out of order (2, 0, 3, 1)."""
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=20.0, connector_extra_config={"check_sequence": True})
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=4)
    conn.init()
    exact: list[bool] = []
    for step, n in enumerate((3, 6)):
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage(((n,),)))
            handles = [
                conn.send_dispatch(
                    [AFDPayload(torch.full((n, 8), float(step * 10 + layer)))],
                    AFDTransferMetadata(layer, 0, (n,)),
                )
                for layer in range(4)
            ]
            # Only the first reply's receive is posted ahead; the others wait their turn.
            queue = conn._reply_queue[(0, 1)]  # stage 0, FFN world rank 1
            exact.append([t.posted for t in queue] == [True, False, False, False])
            for layer in (0, 1, 2, 3) if step == 0 else (2, 0, 3, 1):
                reply = conn.recv_combine(handles[layer])[0]
                exact.append(torch.equal(reply, torch.full((n, 8), -float(step * 10 + layer))))
            exact.append(not conn._reply_queue.get((0, 1)))
        else:
            ctl = conn.recv_control()
            got = [conn.recv_dispatch(layer, 0) for layer in range(4)]
            for layer, (meta, (payload,)) in enumerate(got):
                want = torch.full((n, 8), float(step * 10 + layer))
                exact.append(torch.equal(payload.hidden_states, want))
                exact.append(meta == ctl.transfer_metadata(layer, 0))
                conn.send_combine([-payload.hidden_states], meta)
            exact.append(not conn._posted)  # nothing posted past the last layer
    if role is AFDRole.ATTENTION:
        conn.send_control(AFDControlMessage.shutdown_message())
    else:
        conn.recv_control()
    conn.close()
    return {"exact": exact}


def recv_window_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world, 4 layers, hidden 8 float32 (32 bytes a token), ``recv_ahead_bytes=256``.

    Per step (counts, layers sent, pattern), the FFN rank records how many receives it has
    posted ahead for stage 0 after ``recv_control`` and after each layer's reply:

    0. 4 tokens (128 B: a window of 2), request/reply over all 4 layers: one receive ahead;
    1. 16 tokens (512 B: no window), 1 layer only: nothing is left posted, so
    2. the next step may announce another count (5 tokens, 160 B: a window of 1), 4 layers;
    3. 2 tokens (64 B: a window of 4, capped by the layers left), a stream (every layer is
       received before any reply): the window opens once the stream shows (second receive);
    4. the same stream again: the whole window is posted at ``recv_control``.
    """
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(
        role, port, 1, 1, timeout_s=20.0, connector_extra_config={"recv_ahead_bytes": 256}
    )
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=4)
    conn.init()
    steps = [(4, 4, False), (16, 1, False), (5, 4, False), (2, 4, True), (2, 4, True)]
    out: dict[str, Any] = {"exact": [], "posted": []}

    def data(step: int, layer: int, n: int) -> torch.Tensor:
        return torch.full((n, 8), float(step * 10 + layer))

    def posted() -> int:
        return len(conn._posted.get((0, 0), ()))

    for step, (n, layers, stream) in enumerate(steps):
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage(((n,),)))
            metas = [AFDTransferMetadata(layer, 0, (n,)) for layer in range(layers)]
            if stream:
                handles = [
                    conn.send_dispatch([AFDPayload(data(step, m.layer_idx, n))], m) for m in metas
                ]
                replies = [conn.recv_combine(h)[0] for h in handles]
            else:
                replies = [
                    conn.recv_combine(
                        conn.send_dispatch([AFDPayload(data(step, m.layer_idx, n))], m)
                    )[0]
                    for m in metas
                ]
            for layer, reply in enumerate(replies):
                out["exact"].append(torch.equal(reply, -data(step, layer, n)))
        else:
            ctl = conn.recv_control()
            counts = [posted()]
            metas = [ctl.transfer_metadata(layer, 0) for layer in range(layers)]
            if stream:
                got = [
                    conn.recv_dispatch(m.layer_idx, m.stage_idx)[1][0].hidden_states for m in metas
                ]
                counts.append(posted())
                for m, hidden in zip(metas, got, strict=True):
                    conn.send_combine([-hidden], m)
            else:
                got = []
                for m in metas:
                    _, (payload,) = conn.recv_dispatch(m.layer_idx, m.stage_idx)
                    got.append(payload.hidden_states)
                    conn.send_combine([-payload.hidden_states], m)
                    counts.append(posted())
            for layer, hidden in enumerate(got):
                out["exact"].append(torch.equal(hidden, data(step, layer, n)))
            out["posted"].append(counts)
    if role is AFDRole.ATTENTION:
        conn.send_control(AFDControlMessage.shutdown_message())
    else:
        conn.recv_control()
    conn.close()
    return out


def dispatch_rows(n: int, layer: int, ffn_rank: int, num_ffn: int) -> list[int]:
    """Rows of an ``n``-token batch dispatched to ``ffn_rank``: overlapping between ranks (a
    token goes to one or two ranks), and none at all for the last rank at layer 1."""
    if layer == 1 and ffn_rank == num_ffn - 1:
        return []
    return [i for i in range(n) if (i + ffn_rank) % num_ffn == 0 or i % 3 == 0]


def _select(payload: AFDPayload, rows: list[int]) -> AFDPayload:
    index = torch.tensor(rows, dtype=torch.int64)
    return AFDPayload(**{k: t.index_select(0, index) for k, t in payload.tensors().items()})


def dispatch_rank(
    rank: int, port: int, a: int, f: int, variants: list[str], steps: int, seed: int
) -> dict[str, Any]:
    """Expert-parallel round trips: each Attention rank dispatches overlapping row subsets to
    every FFN rank (one rank gets none at layer 1); exact checks on both sides."""
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, a, f, compute_gate_on_attention=True, ffn_rank=0)
    if role is AFDRole.FFN:
        cfg = _config(role, port, a, f, compute_gate_on_attention=True, ffn_rank=role_rank)
    report: dict[str, Any] = {"role": str(role), "checked": 0, "mismatches": [], "empty": 0}
    for variant in variants:
        spec = spec_for(variant)
        conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=NUM_LAYERS)
        conn.init()
        for step in range(steps):
            counts = token_counts(seed, step, a, allow_zero=a > 1)
            if role is AFDRole.ATTENTION:
                conn.send_control(AFDControlMessage(tuple((c[role_rank],) for c in counts)))
                for layer in range(NUM_LAYERS):
                    pending = []
                    for stage in range(NUM_STAGES):
                        n = counts[stage][role_rank]
                        full = make_payload(spec, seed, step, layer, stage, role_rank, n)
                        parts = [_select(full, dispatch_rows(n, layer, r, f)) for r in range(f)]
                        meta = AFDTransferMetadata(layer, stage, tuple(p.num_tokens for p in parts))
                        pending.append((conn.send_dispatch(parts, meta), parts))
                    for stage, (handle, parts) in enumerate(pending):
                        outs = conn.recv_combine(handle)
                        for r, (out, part) in enumerate(zip(outs, parts, strict=True)):
                            report["checked"] += 1
                            if not torch.equal(out, ffn_reply(part, layer)):
                                report["mismatches"].append((variant, step, layer, stage, r))
            else:
                ctl = conn.recv_control()
                for layer in range(NUM_LAYERS):
                    for stage in range(NUM_STAGES):
                        meta, payloads = conn.recv_dispatch(layer, stage)
                        for arank, got in enumerate(payloads):
                            n = counts[stage][arank]
                            full = make_payload(spec, seed, step, layer, stage, arank, n)
                            exp = _select(full, dispatch_rows(n, layer, role_rank, f))
                            report["checked"] += 1
                            report["empty"] += got.num_tokens == 0
                            if meta.num_tokens[arank] != exp.num_tokens:
                                report["mismatches"].append((variant, step, layer, "count"))
                            for name, t in exp.tensors().items():
                                if not torch.equal(getattr(got, name), t):
                                    report["mismatches"].append((variant, step, layer, name))
                        conn.send_combine([ffn_reply(p, layer) for p in payloads], meta)
                assert ctl.num_stages == NUM_STAGES
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage.shutdown_message())
        else:
            report["shutdown"] = conn.recv_control().shutdown
        conn.close()
    return report


def dispatch_by_role(proc: int, port: int, a: int, f: int, *args: Any) -> dict[int, Any]:
    """Process 0 hosts the Attention ranks, process 1 the FFN ranks (one thread per rank)."""
    ranks = range(a) if proc == 0 else range(a, a + f)
    return run_threads(dispatch_rank, ranks, port, a, f, *args)


def agreement_rank(rank: int, port: int, case: str) -> dict[str, Any]:
    """1 Attention : 2 FFN ranks. ``case``:

    * ``geometry``: the FFN ranks publish different ``role_agreement`` (quantization geometry);
    * ``hook``: FFN rank 1's bind between ``open_groups`` and ``confirm_ready`` fails (it
      aborts in stage ``bind``, as afd-runtime does when a Mega bind fails);
    * ``ok``: equal agreement; every rank records its group info between the two steps;
    * ``mega``: as ``ok``, the FFN ranks computing with Mega (``expert_dispatch='ffn'``): they
      also get the group of the FFN ranks and sum a tensor over it.
    """
    topo = AFDTopology(1, 2)
    role, role_rank = topo.role_of(rank)
    mega: dict[str, Any] = {}
    if case == "mega":
        mega = {"expert_dispatch": "ffn"}
        if role is AFDRole.FFN:
            mega.update(ffn_compute="mega", expert_quant="w8a8")
    cfg = _config(
        role,
        port,
        1,
        2,
        compute_gate_on_attention=True,
        **mega,
        ffn_rank=role_rank if role is AFDRole.FFN else 0,
        timeout_s=15.0,
    )
    seen: list[Any] = []
    agreement = None
    if role is AFDRole.FFN:
        agreement = {"expert_quant": "w8a8", "hidden": 16}
        if case == "geometry" and role_rank == 1:
            agreement = {"expert_quant": "w4a8", "hidden": 16}
    conn = P2PConnector(
        cfg,
        topo,
        role_rank,
        payload_spec=spec_for("hidden_f16_topk"),
        num_layers=NUM_LAYERS,
        role_agreement=agreement,
    )
    try:
        conn.open_groups()
        seen.append(conn.group_info())
        group = conn.data_process_group()
        ffn_group: dict[str, Any] = {}
        if case == "mega" and role is AFDRole.FFN:
            t = torch.tensor([float(role_rank + 1)])
            conn.ffn_process_group().allreduce([t]).wait()
            ffn_group = {"info": conn.ffn_group_info(), "sum": float(t)}
        if case == "hook" and role is AFDRole.FFN and role_rank == 1:
            reason = "RuntimeError: planted bind failure on FFN rank 1"
            conn.abort("bind", reason)
            return {"error": "bind", "text": reason, "seen": len(seen)}
        conn.confirm_ready()
    except AFDError as err:
        return {"error": type(err).__name__, "text": str(err), "seen": len(seen)}
    info = conn.group_info()
    backend = str(group.name())
    conn.close()
    return {"error": None, "info": info, "seen": seen, "backend": backend, "ffn": ffn_group}


def replaced_ffn_proc(proc: int, port: int, liveness_s: float) -> dict[str, Any]:
    """1:1 world in three processes: the Attention rank (proc 0), an FFN rank that SIGKILLs
    itself while idle after one step (proc 1) and the FFN rank that replaces it (proc 2).

    The Attention rank must learn of the loss with no operation pending (the FFN heartbeat,
    ``peer_failure``), re-initialise (round 2) and serve a step with the replacement, which
    started while round 1 was still open (its rank claimed there) and so waited for round 2.
    A second process claiming the live FFN rank fails with AFDStartupError (stage 'claim').
    """
    import afd_core.session.liveness as liveness

    liveness.LIVENESS_TIMEOUT_S = liveness_s
    topo = AFDTopology(1, 1)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    role = AFDRole.ATTENTION if proc == 0 else AFDRole.FFN
    cfg = _config(role, port, 1, 1, timeout_s=10.0, startup_timeout_s=30.0)
    conn = P2PConnector(cfg, topo, 0, payload_spec=spec, num_layers=1)
    out: dict[str, Any] = {}

    def attention_step(value: float) -> bool:
        conn.send_control(AFDControlMessage(((2,),)))
        handle = conn.send_dispatch(
            [AFDPayload(torch.full((2, 8), value))], AFDTransferMetadata(0, 0, (2,))
        )
        return torch.equal(conn.recv_combine(handle)[0], torch.full((2, 8), value + proc_tag))

    def ffn_step(tag: float) -> None:
        conn.recv_control(timeout_s=math.inf)
        meta, (payload,) = conn.recv_dispatch(0, 0)
        conn.send_combine([payload.hidden_states + tag], meta)

    if proc == 0:
        conn.init()
        proc_tag = 1.0
        out["first_step_ok"] = attention_step(1.0)
        started = time.monotonic()
        failure = conn.wait_peer_failure(liveness_s + 20.0)
        out["failure"] = None if failure is None else _err(failure)
        out["noticed_after_s"] = time.monotonic() - started
        out["failure_cleared_on_close"] = conn.peer_failure() is not None
        conn.close()
        conn.init()
        out["generation"] = conn.generation
        out["peer_failure_after_init"] = conn.peer_failure()
        proc_tag = 2.0
        out["second_step_ok"] = attention_step(5.0)
        # A duplicate of the live FFN rank (proc 2 is serving) must not join: wait for it.
        while not os.path.exists(f"/tmp/afd-dup-{port}"):
            time.sleep(0.05)
        conn.send_control(AFDControlMessage.shutdown_message())
        conn.close()
        return out
    if proc == 1:
        conn.init()
        ffn_step(1.0)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.5)  # proc 2: start while round 1 (proc 1's) is the newest
    conn.init()
    out["generation"] = conn.generation
    ffn_step(2.0)
    dup = P2PConnector(
        _config(AFDRole.FFN, port, 1, 1, timeout_s=10.0, startup_timeout_s=1.0),
        topo,
        0,
        payload_spec=spec,
        num_layers=1,
    )
    try:
        dup.init()
        out["duplicate"] = None
    except AFDError as err:
        out["duplicate"] = _err(err)
    dup.close()
    open(f"/tmp/afd-dup-{port}", "w").close()
    ctl = conn.recv_control(timeout_s=math.inf)
    out["goodbye"] = ctl.shutdown
    conn.close()
    os.unlink(f"/tmp/afd-dup-{port}")
    return out


#: The model identity every rank of :func:`identity_rank` publishes unless its case changes it.
IDENTITY: dict[str, Any] = {
    "config": {"hidden_act": "silu", "num_experts": 8, "rope_scaling": None},
    "weights": {
        "model.safetensors": {"header": "h0", "samples": "s0", "size": 1024},
    },
}


def identity_rank(rank: int, port: int, a: int, f: int, case: str) -> dict[str, Any]:
    """``a`` Attention : ``f`` FFN ranks publishing :data:`IDENTITY`, except the last world
    rank (an FFN rank), by ``case``:

    * ``same``: equal identity (init succeeds);
    * ``weights``: another ``samples`` digest of ``model.safetensors``;
    * ``config``: another ``hidden_act``;
    * ``extra_key``: one more config key.
    """
    topo = AFDTopology(a, f)
    role, role_rank = topo.role_of(rank)
    cfg = _config(
        role,
        port,
        a,
        f,
        compute_gate_on_attention=f > 1,
        ffn_rank=role_rank if role is AFDRole.FFN else 0,
        timeout_s=15.0,
    )
    identity = {"config": dict(IDENTITY["config"]), "weights": dict(IDENTITY["weights"])}
    if rank == topo.world_size - 1:
        if case == "weights":
            identity["weights"] = {
                "model.safetensors": {"header": "h0", "samples": "s1", "size": 1024}
            }
        elif case == "config":
            identity["config"]["hidden_act"] = "gelu"
        elif case == "extra_key":
            identity["config"]["moe_renorm"] = True
    spec = spec_for("hidden_f16_topk") if f > 1 else spec_for("hidden_f32")
    conn = P2PConnector(
        cfg, topo, role_rank, payload_spec=spec, num_layers=NUM_LAYERS, model_identity=identity
    )
    try:
        conn.init()
    except AFDError as err:
        report: dict[str, Any] = {"error": type(err).__name__, "text": str(err)}
        for attr in ("field", "local", "remote", "peer_rank"):
            report[attr] = getattr(err, attr, None)
        return report
    conn.close()
    return {"error": None}


def cancel_startup_rank(rank: int, port: int, case: str) -> dict[str, Any]:
    """A startup wait cancelled with :func:`afd_core.session.startup.cancel_startup`.

    * ``connect`` (1 process, FFN rank 1 of a 1:1 world): no store server; cancelled from a
      timer thread while the client probes for it.
    * ``handshake`` (1 process, Attention rank 0): the store's master waits for the FFN rank's
      handshake; cancelled from a SIGUSR1 handler (what a SIGTERM handler does).
    * ``ready`` (2 processes): rank 0 takes long between ``open_groups`` and ``confirm_ready``
      (a long bind: until rank 1 has been cancelled, at most 20 s); rank 1 waits in the
      ``ready`` barrier and is cancelled 0.5 s after its ``open_groups``; rank 0 then sees rank
      1's published failure.
    """
    from afd_core.session.startup import cancel_startup

    topo = AFDTopology(1, 1)
    if case == "connect":
        rank = 1
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=60.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    if case == "handshake":
        signal.signal(signal.SIGUSR1, lambda *_: cancel_startup("SIGUSR1"))
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    elif case == "connect":
        threading.Timer(1.0, cancel_startup, ("test cancel",)).start()
    started = time.monotonic()
    saw_cancel = None
    try:
        conn.open_groups()
        if case == "ready" and rank == 1:
            threading.Timer(0.5, cancel_startup, ("test cancel",)).start()  # in the barrier
        if case == "ready" and rank == 0:
            saw_cancel = _wait_flag(port, "ready-cancelled", 20.0)  # a long bind
        conn.confirm_ready()
    except AFDError as err:
        if case == "ready" and rank == 1:
            _raise_flag(port, "ready-cancelled")
        result = _err(err)
        result["saw_cancel"] = saw_cancel
        result["stage"] = getattr(err, "stage", None)
        result["reason"] = getattr(err, "reason", None)
        result["elapsed"] = time.monotonic() - started
        result["initialized_after"] = conn.is_initialized
        return result
    finally:
        conn.close()
    return {"type": None}


def exit_in_init_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world; rank 0's ready barrier raises ``SystemExit(0)`` (as a process being stopped
    would): rank 0's start must let it through (not turn it into a peer error) and publish it,
    rank 1 must see rank 0's published failure."""
    from afd_core.session.session import AFDSession

    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=30.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    if rank == 0:

        def exit_in_ready(*_: Any, **__: Any) -> None:
            raise SystemExit(0)

        AFDSession.ready = exit_in_ready  # type: ignore[method-assign]  # this process only
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    try:
        conn.init()
    except SystemExit as exit_:
        return {"type": "SystemExit", "code": exit_.code, "initialized_after": conn.is_initialized}
    except AFDError as err:
        result = _err(err)
        result["stage"] = getattr(err, "stage", None)
        result["reason"] = getattr(err, "reason", None)
        return result
    finally:
        conn.close()
    return {"type": None}


def failure_before_init_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world; the FFN rank fails before its ``init`` (as if loading its model) and publishes
    that with ``P2PConnector.publish_startup_failure``; the Attention rank's ``init`` must fail
    at once naming the FFN rank, the stage and the reason (its startup timeout is 60 s)."""
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=60.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    started = time.monotonic()
    if role is AFDRole.FFN:
        time.sleep(0.5)  # the Attention rank (the store's server) may start later: it waits
        delivered = P2PConnector.publish_startup_failure(
            cfg, role_rank, "load", "OSError: weights file unreadable"
        )
        return {"delivered": delivered, "elapsed": time.monotonic() - started}
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=1)
    try:
        conn.init()
    except AFDError as err:
        result = _err(err)
        result["stage"] = getattr(err, "stage", None)
        result["reason"] = getattr(err, "reason", None)
        result["elapsed"] = time.monotonic() - started
        return result
    finally:
        conn.close()
    return {"type": None}


def draft_steps_rank(rank: int, port: int) -> dict[str, Any]:
    """1:1 world, 4 layer indices of which the last is a draft layer (``num_draft_layers=1``,
    as DeepSeek's MTP layer after 3 target layers), receive-ahead on (gloo, request/reply).

    Steps alternate target (layers 0-2) and draft (layer 3) with a new count each time, as
    speculative decoding does (target: 3 tokens a request, draft: 1): every step ends at its own
    last layer, so no receive is left posted for a count the next step does not announce."""
    topo = AFDTopology(1, 1)
    role, role_rank = topo.role_of(rank)
    cfg = _config(role, port, 1, 1, timeout_s=20.0)
    spec = AFDPayloadSpec(hidden_size=8, dtype=torch.float32)
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=4, num_draft_layers=1)
    conn.init()
    exact: list[bool] = []
    steps = ((6, False), (2, True), (2, True), (9, False), (3, True), (6, False))
    for step, (n, draft) in enumerate(steps):
        layers = (3,) if draft else (0, 1, 2)
        if role is AFDRole.ATTENTION:
            conn.send_control(AFDControlMessage(((n,),), is_draft=draft))
            for layer in layers:
                value = float(step * 10 + layer)
                handle = conn.send_dispatch(
                    [AFDPayload(torch.full((n, 8), value))], AFDTransferMetadata(layer, 0, (n,))
                )
                reply = conn.recv_combine(handle)[0]
                exact.append(torch.equal(reply, torch.full((n, 8), -value)))
        else:
            ctl = conn.recv_control()
            exact.append(ctl.is_draft is draft)
            for layer in layers:
                meta, (payload,) = conn.recv_dispatch(layer, 0)
                want = torch.full((n, 8), float(step * 10 + layer))
                exact.append(torch.equal(payload.hidden_states, want))
                conn.send_combine([-payload.hidden_states], meta)
            exact.append(not conn._posted)  # nothing posted past the step's last layer
    if role is AFDRole.ATTENTION:
        conn.send_control(AFDControlMessage.shutdown_message())
    else:
        conn.recv_control()
    conn.close()
    return {"exact": exact}


def survivor_rank(rank: int, port: int) -> dict[str, Any]:
    """1:2 expert-parallel world (timeout_s 60): FFN rank 0 SIGKILLs itself after the control
    message of step 1. The Attention rank's wait fails, it keeps the failure (as the Attention
    link does until it reconnects), closes and stays up. The surviving FFN rank, waiting for
    layer 1's dispatch, reports what it raised and after how long."""
    topo = AFDTopology(1, 2)
    role, role_rank = topo.role_of(rank)
    ffn_rank = role_rank if role is AFDRole.FFN else 0
    cfg = _config(
        role, port, 1, 2, timeout_s=60.0, compute_gate_on_attention=True, ffn_rank=ffn_rank
    )
    spec = spec_for("hidden_bf16_logits")
    conn = P2PConnector(cfg, topo, role_rank, payload_spec=spec, num_layers=NUM_LAYERS)
    conn.init()
    kept: list[BaseException] = []
    started = time.monotonic()
    try:
        for step in range(3):
            if role is AFDRole.ATTENTION:
                conn.send_control(AFDControlMessage(((4,),)))
                for layer in range(NUM_LAYERS):
                    parts = [make_payload(spec, 0, step, layer, 0, 0, 2) for _ in range(2)]
                    meta = AFDTransferMetadata(layer, 0, (2, 2))
                    conn.recv_combine(conn.send_dispatch(parts, meta))
            else:
                conn.recv_control()
                if step == 1 and role_rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
                for layer in range(NUM_LAYERS):
                    meta, payloads = conn.recv_dispatch(layer, 0)
                    conn.send_combine([ffn_reply(p, layer) for p in payloads], meta)
    except AFDError as err:
        result = _err(err)
        result["elapsed"] = time.monotonic() - started
        kept.append(err)
        conn.close()
        if role is AFDRole.ATTENTION:
            # Up, holding its failure, until the survivor has failed (at most 15 s): the
            # survivor's failure cannot come from this process exiting.
            result["survivor_failed_first"] = _wait_flag(port, "survivor-failed", 15.0)
        else:
            _raise_flag(port, "survivor-failed")
        return result
    conn.close()
    return {"type": None}
