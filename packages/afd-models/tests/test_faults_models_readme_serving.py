"""Faults suite: the README's serving block, run with bash exactly as written.

The one substitution: the README's ports (HTTP 8000 and 8001, AFD port 29700) become free ports
the OS gives (each pattern must be found, so the README cannot drift from this test). ``afd
tiny`` gives the tiny Qwen3-MoE checkpoint (``$AFD_TINY_CACHE`` when set, as for every engine
test), both ``afd serve`` start in the background with no KV cache setting (the Attention role's
own default budget), the block waits for ``/health`` with its own bound, sends its ``curl`` and
stops both roles with SIGTERM. Asserted: the block exits 0 within the bound, the completion carries 16
tokens, each role's log shows it ran, and no process of the block is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_readme import marked_block

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

#: The block's own readiness wait is 900 s; add the checkpoint build and both stops.
SERVING_BOUND_S = 1100


def _with_free_ports(script: str) -> str:
    """``script`` with the README's ports replaced by free ones (every pattern must occur)."""
    from afd_models.demo.servers import free_ports

    attention, ffn, afd = free_ports(3)
    for old, new in (
        ('"port": 29700', f'"port": {afd}'),
        ("--port 8001", f"--port {ffn}"),
        ("--port 8000", f"--port {attention}"),
        ("localhost:8000", f"localhost:{attention}"),
    ):
        assert old in script, f"the README's serving block no longer holds {old!r}"
        script = script.replace(old, new)
    return script


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(SERVING_BOUND_S + 120)
def test_readme_serving_block_runs_as_written(tmp_path: Path) -> None:
    script = _with_free_ports(marked_block("serving"))
    bin_dir = Path(sys.executable).parent  # where `afd` is installed beside this interpreter
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # as a user's shell: the README sets none
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=SERVING_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the serving block ran past {SERVING_BOUND_S} s:\n{out[-4000:]}")
    elapsed = time.monotonic() - t0
    # The block's `kill` + `wait` stop both servers; their process groups end with them.
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _group_alive(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    logs = {name: (tmp_path / name).read_text() for name in ("attention.log", "ffn.log")}
    tails = "\n".join(f"--- {n} ---\n{t[-3000:]}" for n, t in logs.items())
    assert proc.returncode == 0, f"the block exited {proc.returncode}:\n{out[-3000:]}\n{tails}"
    assert not left, "processes of the serving block outlived its `kill`/`wait`"
    start = out.index("{")
    reply = json.loads(out[start : out.rindex("}") + 1])
    assert "usage" in reply, f"the curl got no completion: {reply}\n{tails}"
    assert reply["usage"]["completion_tokens"] == 16, reply
    assert reply["choices"][0]["text"], reply
    # The KV budget the README describes: the Attention role's own default, logged.
    assert "AFD Attention role on CPU: KV cache" in logs["attention.log"], tails
    print(f"README serving block: {elapsed:.0f} s")
