"""tools/junit_failures.py: the digest the ``failures`` nox session prints at the end of a run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "junit_failures.py"
spec = importlib.util.spec_from_file_location("junit_failures", TOOL)
assert spec is not None and spec.loader is not None
junit_failures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(junit_failures)

FAILING = """\
def test_ok():
    assert True

def test_bad():
    codes = [0, -6]
    assert codes == [0, 0]

def test_broken_fixture(missing_fixture):
    pass
"""


def test_a_real_pytest_report_names_each_failure_with_its_assertion(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(FAILING)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the workspace's settings
    reports = tmp_path / "reports"
    reports.mkdir()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(tmp_path / "test_sample.py"),
            "-p",
            "no:cacheprovider",
            "-c",
            str(tmp_path / "pytest.ini"),
            "--rootdir",
            str(tmp_path),
            f"--junitxml={reports / 'tests-package-afd-runtime.xml'}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout
    digest = junit_failures.render(reports)
    assert digest.splitlines()[0].startswith("2 failed or errored test(s) in 1 report(s)")
    heads = [line for line in digest.splitlines() if line.startswith("== ")]
    assert len(heads) == 2, digest
    assert heads[0].startswith("== tests-package-afd-runtime: FAILURE ")
    assert heads[0].endswith("test_sample::test_bad")
    assert "assert [0, -6] == [0, 0]" in digest
    assert heads[1].startswith("== tests-package-afd-runtime: ERROR ")
    assert heads[1].endswith("test_sample::test_broken_fixture")
    assert "missing_fixture" in digest
    assert "test_ok" not in digest


def test_nothing_failed_unreadable_and_missing_reports_are_said(tmp_path: Path) -> None:
    assert junit_failures.render(tmp_path) == f"no test reports in {tmp_path}"
    (tmp_path / "lint.xml").write_text("<testsuites><testsuite><testcase classname='a' name='b'/>")
    (tmp_path / "ok.xml").write_text(
        "<testsuites><testsuite><testcase classname='a' name='b'/></testsuite></testsuites>"
    )
    digest = junit_failures.render(tmp_path)
    assert digest.splitlines()[0].startswith("0 failed or errored test(s) in 2 report(s)")
    assert "== lint: unreadable report (ParseError" in digest


def test_the_cli_exits_zero_and_keeps_the_last_lines(tmp_path: Path) -> None:
    text = "\n".join(f"line {i}" for i in range(100))
    (tmp_path / "e2e.xml").write_text(
        "<testsuites><testsuite><testcase classname='m' name='t'>"
        f"<failure message='x'>{text}</failure></testcase></testsuite></testsuites>"
    )
    run = subprocess.run(
        [sys.executable, str(TOOL), str(tmp_path), "--lines", "3"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0
    assert run.stdout.splitlines()[1:] == [
        "== e2e: FAILURE m::t",
        "   line 97",
        "   line 98",
        "   line 99",
    ]
