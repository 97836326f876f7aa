"""Mutation check (``nox -s mutation``): mutmut over a few core files, each package with its own tests.

mutmut reads its config from the working directory's pyproject.toml and copies the source it
mutates into ``mutants/`` beside it, so each package runs in its own scratch folder
``build/mutation/<dist>/`` (ignored by git): a fresh copy of the package's ``src``, ``tests`` and
``benchmarks`` plus a generated pyproject.toml holding ``[tool.mutmut]`` and the workspace's pytest
options. Tests run with the default sessions' marker filter. ``PYTHONPATH`` points at the mutated
copy as well, so worker processes that the tests spawn import the mutant too.

Usage: ``python tools/mutation.py [DIST ...]`` (all targets when none is named). Prints, per
package and in total, killed / survived / other / total and the score killed / total.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "mutation"
CPU_MARKERS = "not npu and not e2e and not faults and not load and not bench"

#: The files mutated, per distribution (glob patterns relative to the package root).
TARGETS: dict[str, list[str]] = {
    "afd-remote": ["src/afd_remote/routing.py"],
    "afd-compute-npu": ["src/afd_compute_npu/reference.py"],
    # session/ and connector/ in full run for hours on a 2-core host (threads, sockets and
    # multi-process worlds behind most lines): its handshake, pure logic.
    "afd-core": ["src/afd_core/session/handshake.py"],
}

COPIED = ("src", "tests", "benchmarks")


def _toml_value(value: object) -> str:
    return json.dumps(value)  # JSON strings, lists and numbers are valid TOML values


def prepare(dist: str, *, baseline: bool = False) -> Path:
    package = ROOT / "packages" / dist
    work = WORK / dist
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in COPIED:
        if (package / name).is_dir():
            shutil.copytree(
                package / name,
                work / name,
                # baseline: the suite as it was before the mutation check's own test files
                ignore=shutil.ignore_patterns(
                    "__pycache__", "*.pyc", *(["test_*_mutants.py"] if baseline else [])
                ),
            )
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]
    lines = [
        "[tool.mutmut]",
        f"source_paths = {_toml_value(['src'])}",
        f"only_mutate = {_toml_value(TARGETS[dist])}",
        f"also_copy = {_toml_value([n for n in COPIED[1:] if (work / n).is_dir()])}",
        f"pytest_add_cli_args = {_toml_value(['-m', CPU_MARKERS, '-p', 'no:cacheprovider'])}",
        f"pytest_add_cli_args_test_selection = {_toml_value(['tests'])}",
        "use_git_change_detection = false",
        # mutmut times a test's call phase only: worker pools started by fixtures (the gloo
        # tests) are not in it, so its default 1 s constant reports good mutants as timeouts.
        "timeout_constant = 60.0",
        "",
        "[tool.pytest.ini_options]",
        *(f"{key} = {_toml_value(value)}" for key, value in pytest_options.items()),
        "",
    ]
    (work / "pyproject.toml").write_text("\n".join(lines))
    # Exists before mutmut starts: a PYTHONPATH entry missing at start-up is cached as absent
    # (sys.path_importer_cache), and the tests would then import the unmutated package.
    (work / "mutants" / "src").mkdir(parents=True)
    return work


def _survivors(work: Path, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results"],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line.split(":")[0].strip() for line in out.splitlines() if line.endswith(": survived")]


def run(
    dist: str, max_children: int, *, baseline: bool = False, survivors_only: bool = False
) -> dict[str, int]:
    work = WORK / dist
    env = dict(os.environ)
    mutated_src = str(work / "mutants" / "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [mutated_src, env.get("PYTHONPATH")]))
    mutmut = [sys.executable, "-m", "mutmut"]
    names: list[str] = []
    if survivors_only and (work / "mutants").is_dir():
        # Keep every verdict of the last run; bring the package's tests up to date (mutmut
        # collects stats for the new tests only) and test again only the mutants that survived.
        shutil.copytree(ROOT / "packages" / dist / "tests", work / "tests", dirs_exist_ok=True)
        names = _survivors(work, env)
        if not names:
            print(f"{dist}: no survivors to test again")
    else:
        prepare(dist, baseline=baseline)
    if names or not survivors_only:
        subprocess.run(
            [*mutmut, "run", "--max-children", str(max_children), *names],
            cwd=work,
            env=env,
            check=True,
        )
    subprocess.run([*mutmut, "export-cicd-stats"], cwd=work, env=env, check=True)
    stats = json.loads((work / "mutants" / "mutmut-cicd-stats.json").read_text())
    results = subprocess.run(
        [*mutmut, "results"], cwd=work, env=env, check=True, capture_output=True, text=True
    )
    (work / "survivors.txt").write_text(results.stdout)
    print(results.stdout)
    return {key: int(value) for key, value in stats.items() if isinstance(value, int)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dists", nargs="*", metavar="DIST", help=f"any of {', '.join(TARGETS)}")
    parser.add_argument("--max-children", type=int, default=1)
    parser.add_argument(
        "--survivors",
        action="store_true",
        help="keep the last run's verdicts and test only its survivors again (current tests)",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="leave out the test_*_mutants.py files (the score before they were written)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.dists) - set(TARGETS))
    if unknown:
        parser.error(f"no mutation targets for {unknown}; known: {list(TARGETS)}")
    summary: dict[str, dict[str, int]] = {}
    for dist in args.dists or list(TARGETS):
        summary[dist] = run(
            dist, args.max_children, baseline=args.baseline, survivors_only=args.survivors
        )
    print("\nmutation score (killed / total; timeouts and segfaults count as killed by mutmut)")
    for dist, stats in summary.items():
        print(f"  {dist}: {json.dumps(stats, sort_keys=True)}  files: {', '.join(TARGETS[dist])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
