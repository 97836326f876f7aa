#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2026.4"]
# ///
"""Checks for the afd workspace. ``uv run nox`` runs the default (CPU) set; ``nox -l`` lists all.

Every session installs from ``uv.lock`` only (``uv sync --locked``) into its own venv, so a session
for one package holds exactly that package and what it declares: an undeclared import fails there.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import nox

nox.needs_version = ">=2026.4"
nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

ROOT = Path(__file__).parent
PYTHON = "3.11"
WHEELHOUSE = os.environ.get("AFD_WHEELHOUSE", "/opt/wheels")


def _members() -> dict[str, Path]:
    found = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        found[tomllib.loads(pyproject.read_text())["project"]["name"]] = pyproject.parent
    return found


PACKAGES = _members()
#: Packages that import vLLM eagerly: their isolated env needs the CPU extra.
VLLM_PACKAGES = ("afd-runtime", "afd-models")
CPU_MARKERS = "not npu and not e2e and not faults and not load and not bench"


def _sync(session: nox.Session, *args: str, bytecode: bool = True) -> None:
    """Install exactly what uv.lock says for ``args`` into this session's venv.

    ``bytecode``: compile the installed packages once (``uv sync --compile-bytecode``). Where
    ``PYTHONDONTWRITEBYTECODE`` is set (this build machine and CI) nothing else ever writes a
    ``.pyc``, so every process would compile vLLM, torch and transformers from source again: a
    vLLM CPU engine, three processes deep, then took ~75 s to start instead of ~30 s. Sessions
    that only read sources (lint, boundaries) skip it.
    """
    venv = session.virtualenv.location
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *(["--compile-bytecode"] if bytecode else []),
        f"--python={venv}",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": venv},
    )


#: Each pytest session's JUnit report (read back by the ``failures`` session).
REPORTS = ROOT / ".nox-reports"


def _pytest(session: nox.Session, *args: str, env_dir: Path | None = None) -> None:
    """Run pytest with a JUnit report at ``.nox-reports/<session>.xml`` (replaced each run);
    ``env_dir``: the pytest of that env (see :func:`_engine_tests`) instead of the session's."""
    REPORTS.mkdir(exist_ok=True)
    report = REPORTS / f"{_slug(session.name)}.xml"
    report.unlink(missing_ok=True)
    if env_dir is None:
        session.run("pytest", *args, f"--junitxml={report}", *session.posargs)
        return
    bin_dir = env_dir / "bin"
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "VIRTUAL_ENV": str(env_dir),
    }
    session.run(
        str(bin_dir / "pytest"),
        *args,
        f"--junitxml={report}",
        *session.posargs,
        env=env,
        external=True,
    )


#: The env the engine sessions (e2e, faults, load) share: they need the same selection of the
#: lock (every package, the CPU extra, the test group), so it is synced and byte-compiled once
#: per run instead of once per session (vLLM, torch and transformers: about a minute each on
#: 2 cores); the later sessions' ``uv sync`` finds it current.
ENGINE_ENV = ROOT / ".nox" / "engines"


def _engine_tests(session: nox.Session, marker: str) -> None:
    """``pytest packages -m marker`` in :data:`ENGINE_ENV`, synced first (``--locked``)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        "--compile-bytecode",
        f"--python={PYTHON}",
        *("--all-packages", "--extra", "cpu", "--group", "test"),
        env={"UV_PROJECT_ENVIRONMENT": str(ENGINE_ENV)},
        external=True,
    )
    _pytest(session, "packages", "-m", marker, env_dir=ENGINE_ENV)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("_")


@nox.session(python=PYTHON, tags=["cpu"])
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's tests in an env holding only it and its declared dependencies."""
    extra = ["--extra", "cpu"] if package in VLLM_PACKAGES else []
    _sync(session, "--package", package, "--group", "test", *extra)
    if package not in VLLM_PACKAGES:
        # Prove the isolation this session exists for: no vLLM below afd-runtime.
        session.run(
            "python",
            "-c",
            "import importlib.util as u, sys; "
            "sys.exit('vllm must not be installed here' if u.find_spec('vllm') else 0)",
        )
    _pytest(session, str(PACKAGES[package] / "tests"), "-m", CPU_MARKERS)


@nox.session(python=PYTHON, tags=["cpu"])
def boundaries(session: nox.Session) -> None:
    """The package map: custom rules, import-linter contracts (indirect chains), deptry."""
    _sync(
        session,
        "--all-packages",
        *("--extra", "cpu", "--group", "boundaries", "--group", "test"),
        bytecode=False,
    )
    config = Path(session.create_tmp()) / "importlinter.ini"
    session.run("python", "tools/check_boundaries.py", "--write-importlinter", str(config))
    session.run("lint-imports", "--config", str(config), "--no-cache")
    for package, path in PACKAGES.items():
        module = package.replace("-", "_")
        session.run(
            "deptry",
            str(path / "src" / module),
            "--config",
            str(path / "pyproject.toml"),
            "--known-first-party",
            module,
        )
    _pytest(session, "tools/tests")


@nox.session(python=PYTHON, tags=["cpu"])
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and mypy over every package."""
    _sync(
        session,
        "--all-packages",
        *("--extra", "cpu", "--group", "lint", "--group", "test"),
        bytecode=False,
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *(str(p / "src") for p in PACKAGES.values()), "tools")


@nox.session(python=PYTHON, tags=["cpu"])
def build(session: nox.Session) -> None:
    """Build every wheel with --no-sources, install them outside the workspace, import everything."""
    session.install("uv")  # the session venv is empty; we only need the uv binary on PATH
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "uv", "build", "--package", package, "--no-sources", "--wheel", "--out-dir", str(dist)
        )
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != len(PACKAGES):
        session.error(
            f"expected {len(PACKAGES)} wheels in {dist}, found {[w.name for w in wheels]}"
        )
    with tempfile.TemporaryDirectory(prefix="afd-wheel-check-") as tmp:
        venv = Path(tmp) / "venv"
        excludes = Path(tmp) / "excludes.txt"
        excludes.write_text("torchvision\ntorchaudio\ntorchcodec\n")
        session.run("uv", "venv", "--no-config", "--python", sys.executable, str(venv))
        python = str(venv / "bin" / "python")
        session.run(
            "uv",
            "pip",
            "install",
            "--no-config",
            "--python",
            python,
            "--find-links",
            str(dist),
            "--find-links",
            WHEELHOUSE,
            "--excludes",
            str(excludes),
            "afd-models[cpu]",
            *wheels,
            external=True,
        )
        session.run(
            python,
            str(ROOT / "tools" / "check_wheels.py"),
            *map(str, wheels),
            external=True,
            env={"PYTHONPATH": ""},
        )


@nox.session(python=PYTHON, tags=["cpu", "e2e"], venv_backend="none")
def e2e(session: nox.Session) -> None:
    """End-to-end: real `vllm serve` engines on CPU, AFD roles against plain vLLM (marker e2e)."""
    _engine_tests(session, "e2e")


@nox.session(python=PYTHON, tags=["cpu", "faults"], venv_backend="none")
def faults(session: nox.Session) -> None:
    """Faults, shutdown, bad input and access on real `vllm serve` engines (marker faults)."""
    _engine_tests(session, "faults")


@nox.session(python=PYTHON, tags=["cpu", "load"], venv_backend="none")
def load(session: nox.Session) -> None:
    """vLLM's own `bench serve` client against a 2:1 AFD pair (256 requests at concurrency 32,
    zero failures, then token parity with plain vLLM; marker load). Writes
    packages/afd-models/benchmarks/results/load.json."""
    _engine_tests(session, "load")


@nox.session(python=PYTHON, tags=["cpu"], venv_backend="none")
def failures(session: nox.Session) -> None:
    """Runs last: lists the failed tests of the sessions' JUnit reports (``.nox-reports/``) with
    the end of each failure's text, so the end of a long log (CI keeps its tail) names them.
    Reports are those of each session's latest run; this session itself never fails."""
    session.run(
        sys.executable, str(ROOT / "tools" / "junit_failures.py"), str(REPORTS), external=True
    )


@nox.session(python=PYTHON, default=False, tags=["mutation"])
def mutation(session: nox.Session) -> None:
    """Mutation check, off by default: mutmut over afd-core's session/handshake.py,
    afd-compute-npu's reference and afd-remote's routing, each against its package's own CPU tests
    (tools/mutation.py; work under build/mutation/). ``nox -s mutation -- afd-remote`` runs one."""
    # The three packages need no vLLM: no extra, so no vLLM in this env.
    _sync(session, "--all-packages", "--group", "test", "--group", "mutation")
    session.run("python", "tools/mutation.py", *session.posargs)


@nox.session(python=PYTHON, default=False, tags=["bench"])
def bench(session: nox.Session) -> None:
    """The tests marked ``bench`` (speed relations between engine runs), every
    packages/*/benchmarks/bench_*.py, then ``afd bench`` (serving TPOT, AFD vs plain); JSON
    results under each package's benchmarks/results."""
    _sync(session, "--all-packages", "--extra", "cpu", "--group", "test")
    _pytest(session, "packages", "-m", "bench")
    scripts = sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
    if not scripts:
        session.error("no benchmark scripts found under packages/*/benchmarks/")
    for script in scripts:
        out = script.parent / "results" / f"{script.stem.removeprefix('bench_')}.json"
        out.parent.mkdir(exist_ok=True)
        session.run("python", str(script), "--out", str(out), *session.posargs)
    serving = PACKAGES["afd-models"] / "benchmarks" / "results" / "serving.json"
    serving.parent.mkdir(parents=True, exist_ok=True)
    session.run("afd", "bench", "--out", str(serving), "--log-dir", session.create_tmp())


@nox.session(python=PYTHON, default=False, tags=["release"])
@nox.parametrize("package", list(PACKAGES))
def release(session: nox.Session, package: str) -> None:
    """Build one package alone (wheel + sdist, --no-sources) after checking its CHANGELOG entry."""
    session.install("uv")
    path = PACKAGES[package]
    version = tomllib.loads((path / "pyproject.toml").read_text())["project"]["version"]
    changelog = (path / "CHANGELOG.md").read_text()
    if f"## {version}" not in changelog:
        session.error(
            f"{path / 'CHANGELOG.md'} has no '## {version}' entry for {package} {version}"
        )
    out = ROOT / "dist" / "release" / package
    shutil.rmtree(out, ignore_errors=True)
    session.run("uv", "build", "--package", package, "--no-sources", "--out-dir", str(out))
    built = sorted(p.name for p in out.iterdir() if p.suffix in {".whl", ".gz"})
    session.log(f"built {built}; tag the release with: git tag '{package}=={version}'")


@nox.session(python=PYTHON, default=False, tags=["npu"])
def npu(session: nox.Session) -> None:
    """Tests marked `npu` on an Ascend host (torch-npu + a visible NPU); skips elsewhere."""
    if shutil.which("npu-smi") is None:
        session.skip(
            "no Ascend NPU here: `npu-smi` is not on PATH; run `nox -t npu` on an Ascend "
            "host with CANN, torch-npu and vllm-ascend installed (see README)"
        )
    _sync(session, "--all-packages", "--extra", "ascend", "--group", "test")
    session.run("python", "-c", "import torch_npu, torch; assert torch.npu.is_available()")
    session.run("pytest", "packages", "-m", "npu", *session.posargs)


if __name__ == "__main__":
    nox.main()
