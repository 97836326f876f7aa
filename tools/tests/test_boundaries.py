"""Plant each kind of package-map violation in a scratch copy and check the report names it.

Each report line must name the file, the line and the broken rule.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "check_boundaries.py"
#: The afd-core requirement the lower packages declare today (read, so a version bump of
#: afd-core does not break these tests).
CORE_REQ = next(
    line.strip().rstrip(",")
    for line in (ROOT / "packages/afd-cam/pyproject.toml").read_text().splitlines()
    if line.strip().startswith('"afd-core>=')
)
_remote = tomllib.loads((ROOT / "packages/afd-remote/pyproject.toml").read_text())
_major, _minor = (int(x) for x in _remote["project"]["version"].split(".")[:2])
#: A range that admits the workspace's afd-remote (for planting an edge that only breaks a rule).
REMOTE_REQ = f'"afd-remote>={_major}.{_minor},<{_major}.{_minor + 1}"'

_spec = importlib.util.spec_from_file_location("check_boundaries", SCRIPT)
assert _spec and _spec.loader
cb = importlib.util.module_from_spec(_spec)
sys.modules["check_boundaries"] = cb
_spec.loader.exec_module(cb)


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A copy of the workspace's pyprojects and sources (no tests, no venv)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for pkg in (ROOT / "packages").iterdir():
        if not (pkg / "pyproject.toml").exists():
            continue
        dst = tmp_path / "packages" / pkg.name
        dst.mkdir(parents=True)
        shutil.copy(pkg / "pyproject.toml", dst / "pyproject.toml")
        shutil.copytree(pkg / "src", dst / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def plant(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def edit_pyproject(root: Path, dist: str, old: str, new: str) -> Path:
    path = root / "packages" / dist / "pyproject.toml"
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))
    return path


def report(root: Path) -> list[str]:
    return [v.render(root) for v in cb.check(root)]


def test_real_workspace_is_clean() -> None:
    assert report(ROOT) == []


def test_cli_exit_codes(scratch: Path) -> None:
    ok = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(scratch)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    plant(scratch, "packages/afd-core/src/afd_core/bad.py", "import vllm\n")
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(scratch)], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "packages/afd-core/src/afd_core/bad.py:1: [vllm-reach]" in bad.stdout


def test_undeclared_sibling(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-weights/src/afd_weights/planted.py",
        '"""doc"""\n\nfrom afd_cam import layout\n',
    )
    assert report(scratch) == [
        "packages/afd-weights/src/afd_weights/planted.py:3: [undeclared-sibling] "
        "afd_weights imports afd_cam, but afd-weights does not declare afd-cam"
    ]


def test_relative_import_resolves_to_own_package(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-cam/src/afd_cam/sub/__init__.py",
        "from .. import py_typed_marker\nfrom . import x\n",
    )
    assert report(scratch) == []


def test_declared_edge_not_in_map(scratch: Path) -> None:
    path = edit_pyproject(
        scratch,
        "afd-weights",
        f"{CORE_REQ},",
        f"{CORE_REQ},\n    {REMOTE_REQ},",
    )
    line = path.read_text().splitlines().index(f"    {REMOTE_REQ},") + 1
    assert report(scratch) == [
        f"packages/afd-weights/pyproject.toml:{line}: [edge-not-allowed] afd-weights declares afd-remote, "
        "an edge [tool.afd.allowed-deps] does not allow (allowed: ['afd-core'])"
    ]


def test_ffn_siblings_import_one_another(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-remote/src/afd_remote/planted.py",
        "def f():\n    from afd_compute_npu import x\n",
    )
    assert report(scratch) == [
        "packages/afd-remote/src/afd_remote/planted.py:2: [ffn-independence] "
        "afd_remote imports afd_compute_npu, but afd-remote does not declare afd-compute-npu"
    ]


def test_ffn_siblings_declare_one_another(scratch: Path) -> None:
    path = edit_pyproject(
        scratch,
        "afd-cam",
        f"{CORE_REQ},",
        f"{CORE_REQ},\n    {REMOTE_REQ},",
    )
    line = path.read_text().splitlines().index(f"    {REMOTE_REQ},") + 1
    assert report(scratch) == [
        f"packages/afd-cam/pyproject.toml:{line}: [ffn-independence] afd-cam declares afd-remote; "
        "afd-remote, afd-cam and afd-compute-npu never depend on one another"
    ]


def test_lower_package_imports_runtime_or_models(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-core/src/afd_core/planted.py",
        "import os\n\n\ndef f():\n    import afd_runtime.worker\n    from afd_models import plugin\n",
    )
    assert report(scratch) == [
        "packages/afd-core/src/afd_core/planted.py:5: [upward-import] "
        "afd_core imports afd_runtime.worker, but afd-core does not declare afd-runtime",
        "packages/afd-core/src/afd_core/planted.py:6: [upward-import] "
        "afd_core imports afd_models, but afd-core does not declare afd-models",
    ]


def test_vllm_import_below_runtime_eager_or_lazy(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-cam/src/afd_cam/planted.py",
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import vllm.config\n"
        "def lazy():\n    import vllm\n"
        "try:\n    from vllm.distributed import get_tp_group\nexcept ImportError:\n    pass\n"
        "def npu():\n    from vllm_ascend import ops\n",
    )
    tail = "; nothing below afd-runtime touches vLLM (the runtime plugs in through afd_core.forward_context.StageHooks)"
    assert report(scratch) == [
        f"packages/afd-cam/src/afd_cam/planted.py:5: [vllm-reach] afd_cam imports vllm{tail}",
        f"packages/afd-cam/src/afd_cam/planted.py:7: [vllm-reach] afd_cam imports vllm.distributed{tail}",
        f"packages/afd-cam/src/afd_cam/planted.py:11: [vllm-reach] afd_cam imports vllm_ascend{tail}",
    ]


def test_vllm_reach_through_sys_modules_or_importlib_below_runtime(scratch: Path) -> None:
    """The reach afd-core's forward context once had: vLLM's modules looked up by name."""
    plant(
        scratch,
        "packages/afd-core/src/afd_core/planted.py",
        "import importlib\nimport sys\n\n\n"
        "def ubatching():\n    return sys.modules.get('vllm.v1.worker.ubatching')\n\n\n"
        "def fc():\n    return importlib.import_module('vllm.forward_context')\n\n\n"
        "NOTE = 'vllm serve runs this; vllm.x is not a module name here'\n\n\n"
        "def typed(cfg: 'vllm.config.VllmConfig') -> 'vllm.config.VllmConfig':\n    return cfg\n\n\n"
        "def scan(name):\n    return f'vllm.{name}' in sys.modules\n",
    )
    tail = "; nothing below afd-runtime touches vLLM (no sys.modules or importlib reach either)"
    assert report(scratch) == [
        "packages/afd-core/src/afd_core/planted.py:6: [vllm-reach] afd_core names the module "
        f"'vllm.v1.worker.ubatching' in a string{tail}",
        "packages/afd-core/src/afd_core/planted.py:10: [vllm-reach] afd_core names the module "
        f"'vllm.forward_context' in a string{tail}",
        "packages/afd-core/src/afd_core/planted.py:21: [vllm-reach] afd_core names the module "
        f"'vllm.' in a string{tail}",
    ]


def test_runtime_may_import_vllm_eagerly(scratch: Path) -> None:
    plant(scratch, "packages/afd-runtime/src/afd_runtime/planted.py", "import vllm\n")
    assert report(scratch) == []


def test_ffn_package_imports_concrete_classes(scratch: Path) -> None:
    plant(
        scratch,
        "packages/afd-compute-npu/src/afd_compute_npu/planted.py",
        "def f():\n"
        "    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE\n"
        "    from somewhere.else_ import NPUModelRunner, helper\n",
    )
    assert report(scratch) == [
        "packages/afd-compute-npu/src/afd_compute_npu/planted.py:2: [vllm-reach] afd_compute_npu "
        "imports vllm.model_executor.models.deepseek_v2; nothing below afd-runtime touches vLLM "
        "(the runtime plugs in through afd_core.forward_context.StageHooks)",
        "packages/afd-compute-npu/src/afd_compute_npu/planted.py:2: [concrete-class] afd_compute_npu "
        "imports vllm.model_executor.models.deepseek_v2; FFN packages never import a concrete model "
        "or worker/runner class",
        "packages/afd-compute-npu/src/afd_compute_npu/planted.py:3: [concrete-class] afd_compute_npu "
        "imports NPUModelRunner; FFN packages never import a concrete model or worker/runner class",
    ]


def test_sibling_without_range_or_excluding_version(scratch: Path) -> None:
    core = tomllib.loads((scratch / "packages/afd-core/pyproject.toml").read_text())
    version = core["project"]["version"]
    declared = CORE_REQ  # what afd-cam and afd-remote declare today
    path = edit_pyproject(scratch, "afd-cam", declared, '"afd-core"')
    line = path.read_text().splitlines().index('    "afd-core",') + 1
    path2 = edit_pyproject(scratch, "afd-remote", declared, '"afd-core>=9.5,<9.6"')
    line2 = path2.read_text().splitlines().index('    "afd-core>=9.5,<9.6",') + 1
    assert report(scratch) == [
        f"packages/afd-cam/pyproject.toml:{line}: [sibling-range] afd-cam requires afd-core without a version range",
        f"packages/afd-remote/pyproject.toml:{line2}: [sibling-range] afd-remote requires "
        f"'afd-core<9.6,>=9.5', but the workspace has afd-core {version}",
    ]


def test_sibling_range_in_an_extra_is_checked_too(scratch: Path) -> None:
    """A platform extra (``cpu = ["afd-runtime[cpu]>=..."]``) is a sibling requirement as well:
    a range left behind by a version bump there breaks ``afd-models[cpu]`` installs."""
    runtime = tomllib.loads((scratch / "packages/afd-runtime/pyproject.toml").read_text())
    version = runtime["project"]["version"]
    models = (scratch / "packages/afd-models/pyproject.toml").read_text()
    declared = next(
        spec
        for spec in tomllib.loads(models)["project"]["optional-dependencies"]["cpu"]
        if spec.startswith("afd-runtime[cpu]")
    )
    path = edit_pyproject(scratch, "afd-models", f'"{declared}"', '"afd-runtime[cpu]>=9.1,<9.2"')
    line = (
        path.read_text()
        .splitlines()
        .index('cpu = ["afd-runtime[cpu]>=9.1,<9.2", "afd-models[demo]"]')
        + 1
    )
    assert report(scratch) == [
        f"packages/afd-models/pyproject.toml:{line}: [sibling-range] afd-models requires "
        f"'afd-runtime[cpu]<9.2,>=9.1', but the workspace has afd-runtime {version}",
    ]


def test_import_linter_catches_indirect_chain(scratch: Path) -> None:
    """afd_cam -> afd_core -> afd_weights: no direct edge is wrong in afd_cam, the chain is."""
    plant(scratch, "packages/afd-core/src/afd_core/planted.py", "import afd_weights\n")
    plant(scratch, "packages/afd-cam/src/afd_cam/planted.py", "import afd_core.planted\n")
    config = scratch / "importlinter.ini"
    config.write_text(cb.importlinter_config(scratch))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(p) for p in (scratch / "packages").glob("*/src")),
    }
    lint_imports = shutil.which("lint-imports")
    assert lint_imports, "import-linter must be installed in the boundaries environment"
    out = subprocess.run(
        [lint_imports, "--config", str(config), "--no-cache"],
        capture_output=True,
        text=True,
        env=env,
        cwd=scratch,
    )
    assert out.returncode == 1, out.stdout
    assert "afd-cam imports only its allowed siblings (afd-core) BROKEN" in " ".join(
        out.stdout.split()
    )
    assert "afd_cam.planted -> afd_core.planted" in out.stdout
    assert "afd_core.planted -> afd_weights" in out.stdout
