"""E2E: the README's quick start, run with bash from the README's own text.

It runs in a copy of the repository (as a user's fresh clone) inside a fresh virtual environment
whose ``pip install uv`` really installs uv (pinned by ``PIP_CONSTRAINT`` to the uv running these
tests, so CI does not drift with uv's releases). One substitution: PyTorch's CPU index URL is
replaced by a stand-in serving the same wheel (the build machine reaches only PyPI), so
``export UV_INDEX=pytorch-cpu=...`` and ``uv run`` re-resolve the lock exactly as they do for a
user. Asserted: the block exits 0, ``afd demo`` printed its PASS line, and the copy's lock took
torch 2.13.0+cpu from the stand-in.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_readme import PYTORCH_CPU_INDEX, copy_checkout, marked_block, stand_in_torch_index

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_runtime, pytest.mark.slow]

#: Installing the environment (uv's cache is warm in CI) and three engines, one pair at a time.
QUICKSTART_BOUND_S = 1500


def _uv_version() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.fail("uv is not on PATH (and $UV is unset)")
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.match(r"uv (\S+)", out)
    assert match, out
    return match.group(1)


@pytest.mark.timeout(QUICKSTART_BOUND_S + 120)
def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    block = marked_block("quickstart")
    assert block.count(PYTORCH_CPU_INDEX) == 1, block
    try:
        index = stand_in_torch_index(tmp_path / "simple")
    except FileNotFoundError as missing:
        pytest.skip(f"the committed lock's torch wheel is not on this machine: {missing}")
    script = block.replace(PYTORCH_CPU_INDEX, index)

    checkout = tmp_path / "afd"
    copy_checkout(checkout)
    env_dir = tmp_path / "user-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"uv=={_uv_version()}\n")
    # A user's shell, not this machine's: no uv settings, no venv, and Python writes its bytecode
    # (with PYTHONDONTWRITEBYTECODE every engine process would compile vLLM from source again).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("UV_", "VIRTUAL_ENV", "PYTHONPATH", "CONDA", "PYTHONDONTWRITEBYTECODE")
        )
    }
    env.pop("UV", None)
    env.update(
        PATH=f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(env_dir),
        PIP_CONSTRAINT=str(constraints),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=checkout,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=QUICKSTART_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the quick start ran past {QUICKSTART_BOUND_S} s:\n{out[-6000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind (its own session)
    print(out[-4000:])
    assert proc.returncode == 0, f"quick start exited {proc.returncode}:\n{out[-6000:]}"
    assert "PASS: all prompts identical" in out, out[-6000:]
    # `pip install uv` put uv into the fresh venv, and the lock was re-resolved against the
    # index the README's override names (here: its stand-in).
    assert (env_dir / "bin" / "uv").is_file()
    lock = tomllib.loads((checkout / "uv.lock").read_text())
    (torch,) = [p for p in lock["package"] if p["name"] == "torch"]
    assert torch["version"] == "2.13.0+cpu"
    assert torch["source"] == {"registry": str(tmp_path / "simple")}, torch["source"]
