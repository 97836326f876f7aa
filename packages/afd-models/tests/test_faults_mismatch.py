"""Faults E2E: roles started on different checkpoints refuse to pair and name what differs.

One FFN role on tiny checkpoint A (Qwen3-MoE, 1:1). An Attention role on a byte-identical copy
of A in another folder pairs and serves (the identity does not depend on where the files lie);
it is stopped (the FFN outlives it). A second Attention role on a copy of A with one weight
value changed (the first float of the data section, inside the first sampled window) then
fails: both roles' handshakes name ``model_identity.weights['model.safetensors'].samples``; the
Attention server exits non-zero within its engine start plus its AFD startup timeout, and the
FFN server's engine stops with the same error (the server exits).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from afd_models.demo.client import complete, served_model_id
from afd_models.demo.servers import (
    EngineOptions,
    ServerExitedError,
    VLLMServer,
    afd_servers,
    free_port,
    stop_all,
    wait_until_healthy,
)
from afd_models.demo.tiny import DEMO_PROMPTS, TinySpec, ensure_tiny_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.vllm_runtime, pytest.mark.slow]

STARTUP_TIMEOUT_S = 300.0  # AFDConfig.startup_timeout_s given to both roles
ENGINE_START_S = 300.0  # generous allowance for the engine start before the rendezvous
FFN_EXIT_S = 60.0  # after the Attention role refused, the FFN role exits within this
FIELD = "model_identity.weights['model.safetensors'].samples"


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _change_first_weight(folder: Path) -> None:
    """Add 1.0 to the first float32 of the data section of ``model.safetensors``."""
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack_from("<Q", data, 0)
    at = 8 + header_len
    (value,) = struct.unpack_from("<f", data, at)
    struct.pack_into("<f", data, at, value + 1.0)
    path.write_bytes(bytes(data))


def _attention_on(template: VLLMServer, model: Path, name: str) -> VLLMServer:
    """``template`` (an Attention server, same AFD port) serving ``model`` on a fresh HTTP port."""
    argv = list(template.config.argv)
    argv[argv.index("serve") + 1] = str(model)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    config = dataclasses.replace(
        template.config,
        name=name,
        argv=tuple(argv),
        port=port,
        log_path=template.config.log_path.with_name(f"{name}.log"),
    )
    return VLLMServer(config, template._progress)


def _wait_exit(server: VLLMServer, timeout_s: float) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = server.poll()
        if code is not None:
            return code
        time.sleep(0.5)
    return server.poll()


@pytest.mark.timeout(1500)
def test_roles_on_different_checkpoints_refuse_to_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache = os.environ.get("AFD_TINY_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    model_a = ensure_tiny_checkpoint(TinySpec("qwen3_moe"), root)
    copies = tmp_path_factory.mktemp("checkpoints")
    same = _copy_checkpoint(model_a, copies / "same")
    changed = _copy_checkpoint(model_a, copies / "changed")
    _change_first_weight(changed)
    log_env = os.environ.get("AFD_E2E_LOG_DIR")
    log_dir = Path(log_env) if log_env else tmp_path_factory.getbasetemp() / "engine-logs"
    template, (ffn,) = afd_servers(
        model_a,
        log_dir=log_dir,
        options=EngineOptions(dtype="float32", enforce_eager=True, max_model_len=512),
        num_attention_ranks=1,
        gate_on_attention=False,
        afd_extra={"startup_timeout_s": STARTUP_TIMEOUT_S},
        prefix="mismatch",
        progress=print,
    )
    paired = _attention_on(template, same, "mismatch-attention-same")
    refused = _attention_on(template, changed, "mismatch-attention-changed")
    ffn.start()
    paired.start()
    try:
        # A byte-identical copy elsewhere is the same model: the pair serves.
        wait_until_healthy([ffn, paired])
        out = complete(
            paired.base_url, DEMO_PROMPTS[0], model=served_model_id(paired.base_url), max_tokens=4
        )
        assert len(out.token_ids) == 4
        print(paired.stop())  # the FFN role outlives its Attention role

        # One weight value changed: both roles refuse, naming the weight file's samples.
        refused.start()
        began = time.monotonic()
        with pytest.raises(ServerExitedError) as exited:
            wait_until_healthy([refused])
        attention_s = time.monotonic() - began
        assert exited.value.exit_code != 0
        # Refused at the handshake, not by the rendezvous timing out (the text says which).
        assert attention_s < ENGINE_START_S + STARTUP_TIMEOUT_S, attention_s
        attention_log = refused.log_text()
        assert "AFDHandshakeError" in attention_log
        assert FIELD in attention_log and "the roles serve different models" in attention_log

        ffn_code = _wait_exit(ffn, FFN_EXIT_S)
        ffn_s = time.monotonic() - began
        # The FFN engine stops with the same error; vLLM's API server then exits on its own
        # (with code 0 in vLLM 0.32: an EngineDeadError ends its serve loop normally).
        assert ffn_code is not None, "FFN role still running"
        ffn_log = ffn.log_text()
        assert "AFD FFN service loop failed" in ffn_log and FIELD in ffn_log
        print(f"attention exited {exited.value.exit_code} after {attention_s:.1f}s")
        print(f"ffn exited {ffn_code} {ffn_s:.1f}s after the refused Attention started")
    finally:
        print(stop_all([refused, paired, ffn]))
