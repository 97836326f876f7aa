"""torch's index resolves both ways: the committed lock (the build machine's local copy of
PyTorch's CPU index) and, overridden by name as the README tells users, PyTorch's own index.

PyTorch's index cannot be reached from the build machine, so a stand-in plays it: a PEP 503
simple index in a temporary folder serving the same wheel. uv re-resolves a scratch copy of the
workspace against it with exactly the README's override (``UV_INDEX=pytorch-cpu=<url>``); the
test checks that torch 2.13.0+cpu then comes from the stand-in, that nothing else in the lock
moves, and that ``uv sync --locked`` accepts the result.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX_NAME = "pytorch-cpu"
TORCH_VERSION = "2.13.0+cpu"
#: What the README tells users to export (the stand-in's URL replaces the URL only).
README_OVERRIDE = f"UV_INDEX={INDEX_NAME}=https://download.pytorch.org/whl/cpu"


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        pytest.fail("the uv binary is not on PATH (and $UV is unset): these checks need it")
    return found


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment without uv settings that would change what is resolved."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("UV_") and k not in {"VIRTUAL_ENV", "CONDA_PREFIX"}
    }
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        [_uv(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"uv {' '.join(args)} failed ({proc.returncode}):\n{out}"
    return out


def _lock(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text())


def _packages(lock: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [p for p in lock["package"] if p["name"] == name]


def _committed_torch() -> dict[str, Any]:
    (torch,) = _packages(_lock(ROOT / "uv.lock"), "torch")
    return torch


def _committed_wheel() -> Path:
    torch = _committed_torch()
    (wheel,) = torch["wheels"]
    path = Path(wheel["path"])
    if not path.is_file():
        pytest.skip(f"the committed lock's torch wheel {path} is not on this machine")
    return path


def test_pyproject_routes_torch_to_the_named_index_the_readme_overrides() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    uv = pyproject["tool"]["uv"]
    assert uv["sources"]["torch"] == {"index": INDEX_NAME}
    (index,) = [i for i in uv["index"] if i["name"] == INDEX_NAME]
    assert index["explicit"] is True  # nothing but torch comes from it
    readme = (ROOT / "README.md").read_text()
    assert f"export {README_OVERRIDE}" in readme, "the README's quick start lost the override"


def test_committed_lock_resolves_torch_from_the_local_wheelhouse() -> None:
    wheel = _committed_wheel()
    torch = _committed_torch()
    assert torch["version"] == TORCH_VERSION
    assert torch["source"] == {"registry": str(wheel.parent)}
    # The lock as committed is what pyproject.toml asks for, without any override.
    _run(["lock", "--check", "--offline"], ROOT, _env())


def _stand_in_index(root: Path, wheel: Path) -> tuple[str, str]:
    """A PEP 503 simple index under ``root`` serving ``wheel`` (as PyTorch's does); its URL
    and the wheel's SHA-256."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    project = root / "torch"
    project.mkdir(parents=True)
    os.symlink(wheel, project / wheel.name)
    href = wheel.name.replace("+", "%2B")
    (root / "index.html").write_text('<html><body><a href="torch/">torch</a></body></html>\n')
    (project / "index.html").write_text(
        f'<html><body><a href="{href}#sha256={digest}">{wheel.name}</a></body></html>\n'
    )
    return root.as_uri(), digest


def _scratch_workspace(dest: Path) -> None:
    """The files uv reads to lock the workspace: the root project and every member."""
    dest.mkdir()
    for name in ("pyproject.toml", "uv.lock", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "results", "*.egg-info", ".pytest_cache")
    for member in sorted((ROOT / "packages").iterdir()):
        if (member / "pyproject.toml").is_file():
            shutil.copytree(member, dest / "packages" / member.name, ignore=ignore)


@pytest.mark.slow
def test_lock_resolves_torch_from_a_stand_in_of_pytorchs_cpu_index(tmp_path: Path) -> None:
    wheel = _committed_wheel()
    url, digest = _stand_in_index(tmp_path / "simple", wheel)
    work = tmp_path / "workspace"
    _scratch_workspace(work)
    override = _env(
        UV_INDEX=README_OVERRIDE.split("=", 1)[1].replace(
            "https://download.pytorch.org/whl/cpu", url
        )
    )
    # The committed lock names the local folder, so the override makes it stale ...
    stale = subprocess.run(
        [_uv(), "lock", "--check", "--offline"], cwd=work, env=override, capture_output=True
    )
    assert stale.returncode != 0, "the override did not change what torch resolves from"
    # ... and uv re-resolves it against the overriding index (what `uv run` does for a user).
    _run(["lock"], work, override)
    relocked = _lock(work / "uv.lock")
    (torch,) = _packages(relocked, "torch")
    assert torch["version"] == TORCH_VERSION
    assert torch["source"] == {"registry": str(tmp_path / "simple")}
    (entry,) = torch["wheels"]
    assert entry["hash"] == f"sha256:{digest}"

    # Nothing but torch's origin moved: every other package keeps its locked versions.
    def versions(lock: dict[str, Any]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for p in lock["package"]:
            if p["name"] != "torch":
                out.setdefault(p["name"], []).append(p["version"])
        return {k: sorted(v) for k, v in out.items()}

    assert versions(relocked) == versions(_lock(ROOT / "uv.lock"))
    # The re-resolved lock satisfies the override, and a locked sync would install that torch.
    _run(["lock", "--check", "--offline"], work, override)
    plan = _run(
        ["sync", "--locked", "--offline", "--dry-run", "--all-packages", "--extra", "cpu"],
        work,
        {**override, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")},
    )
    assert f"torch=={TORCH_VERSION}" in plan, plan
