"""Faults E2E: roles started on different checkpoints refuse to pair and name what differs.

One FFN role on tiny checkpoint A (Qwen3-MoE, 1:1). An Attention role on a byte-identical copy
of A in another folder pairs and serves (the identity does not depend on where the files lie);
it is stopped (the FFN outlives it). A second Attention role on a copy of A with one weight
value changed (the first float of the data section, inside the first sampled window) then
fails: both roles' handshakes name ``model_identity.weights['model.safetensors'].samples``; the
Attention server exits non-zero within its engine start plus its AFD startup timeout. The FFN
refuses that deployment without stopping (issue #31 item 6: a mismatched Attention cannot take a
running FFN down): its log names the same field, it stays healthy, and a matching Attention
started next pairs with it and serves.
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
REFUSAL_LOGGED_S = 60.0  # after the Attention role exited, the FFN has logged its refusal
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
    again = _attention_on(template, same, "mismatch-attention-again")
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

        # The FFN refused that deployment and did not stop: it logs the field and keeps
        # waiting; a matching Attention then pairs with it and serves.
        deadline = time.monotonic() + REFUSAL_LOGGED_S
        while "refused an Attention deployment" not in ffn.log_text():
            assert time.monotonic() < deadline, ffn.log_text()[-3000:]
            time.sleep(0.5)
        ffn_log = ffn.log_text()
        assert FIELD in ffn_log
        assert "AFD FFN service loop failed" not in ffn_log
        assert ffn.poll() is None, "the FFN role stopped after refusing a mismatched Attention"
        again.start()
        wait_until_healthy([ffn, again])
        out2 = complete(
            again.base_url, DEMO_PROMPTS[0], model=served_model_id(again.base_url), max_tokens=4
        )
        assert out2.token_ids == out.token_ids
        print(f"attention exited {exited.value.exit_code} after {attention_s:.1f}s")
    finally:
        print(stop_all([refused, paired, again, ffn]))
