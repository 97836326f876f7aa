"""The root README cannot drift from what is tested (no engines here; the marked shell blocks
themselves run in ``test_e2e_models_readme_quickstart.py`` and ``test_faults_models_readme_serving.py``).

* Every ``afd`` command in a README shell block sits in a block an engine test runs as written,
  or in one whose ``afd serve`` arguments are checked here with ``afd serve``'s own validation.
* Every ``afd demo/tiny/bench`` in the README's text parses with the CLI's parser.
* The ``afd plan`` block runs (in-process, DeepSeek-V3's public config standing in for the
  checkpoint) and prints exactly the sample output the README shows after it.
* The support matrix and the E2E cases agree: each verified cell names an existing E2E case, and
  each E2E case is named by exactly one verified cell.
* Relative links of README.md and CONTRIBUTING.md point at files the repository contains.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_models_readme import (
    AFD_COMMAND,
    README,
    ROOT,
    afd_argv,
    blocks,
    marked_block,
    shell_commands,
    support_matrix,
)

TESTS = Path(__file__).resolve().parent
#: Blocks the engine tests run as written.
ENGINE_TESTED = {"quickstart", "serving"}
#: Blocks checked here without an engine.
CHECKED = {"serve-args", "plan"}


def test_the_tested_blocks_exist_and_run_the_documented_commands() -> None:
    quick = shell_commands(marked_block("quickstart"))
    assert any(AFD_COMMAND.search(c) and "afd demo" in c for c in quick), quick
    serving = marked_block("serving")
    commands = shell_commands(serving)
    serves = [c for c in commands if "afd serve" in c]
    assert len(serves) == 2 and all(c.rstrip().endswith("&") for c in serves), serves
    assert any("afd tiny" in c for c in commands), commands
    # Waits for readiness with a bound, then the request, then stops both servers.
    assert any(c.startswith("timeout ") and "/health" in c for c in commands), commands
    assert any(c.startswith("curl ") and "/v1/completions" in c for c in commands), commands
    assert any(c.startswith("kill ") for c in commands), commands
    # The KV budget is the Attention role's own default (afd-runtime), not a setting to copy.
    assert "VLLM_CPU_KVCACHE_SPACE" not in serving


def test_every_afd_command_in_a_shell_block_is_run_or_checked() -> None:
    unmarked = []
    for block in blocks():
        commands = [c for c in shell_commands(block.text) if AFD_COMMAND.search(c)]
        if not commands:
            continue
        if block.kind == "test":
            assert block.name in ENGINE_TESTED, f"README line {block.line}: {block.name}"
        elif block.kind == "check":
            assert block.name in CHECKED, f"README line {block.line}: {block.name}"
        else:
            unmarked.append((block.line, commands))
    assert not unmarked, f"afd commands in README blocks no test runs or checks: {unmarked}"


def test_checked_serve_commands_pass_afd_serves_validation() -> None:
    from afd_models.vllm_cli import check_serve_args

    checked = [b for b in blocks() if b.kind == "check" and b.name == "serve-args"]
    assert checked, "no 'readme-check: serve-args' block left: drop this test or the marker"
    roles = []
    for block in checked:
        serves = [c for c in shell_commands(block.text) if "afd serve" in c]
        assert serves, f"README line {block.line}: a serve-args block without `afd serve`"
        for command in serves:
            argv = afd_argv(command)
            check_serve_args(argv)  # raises AFDConfigError naming the field on a bad mapping
            roles.append(re.search(r'"role":\s*"(\w+)"', command).group(1))  # type: ignore[union-attr]
    # Every checked launch is a pair: as many Attention servers as FFN servers.
    assert roles and roles.count("attention") == roles.count("ffn") == len(roles) // 2, roles


def test_a_broken_serve_block_would_be_caught() -> None:
    from afd_core.errors import AFDConfigError
    from afd_models.vllm_cli import check_serve_args

    bad = 'afd serve CKPT --additional-config \'{"afd": {"role": "fnn", "port": 29700}}\''
    with pytest.raises(AFDConfigError, match="role"):
        check_serve_args(afd_argv(bad))


def _inline_afd_commands() -> list[str]:
    text = README.read_text()
    return [m for m in re.findall(r"`(afd (?:demo|tiny|bench)(?![\w:-])[^`]*)`", text)]


def test_inline_afd_commands_parse_with_the_cli() -> None:
    from afd_models.cli import build_parser

    commands = _inline_afd_commands()
    assert commands, "the README names no afd demo/tiny/bench command"
    parser = build_parser()
    for command in commands:
        words = shlex.split(command)[1:]
        try:
            parser.parse_args(words)
        except SystemExit as err:  # argparse's way of refusing
            pytest.fail(f"README's `{command}` does not parse with the afd CLI (exit {err.code})")


def test_the_plan_block_prints_the_sample_that_follows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:

    from afd_models import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibrated profile
    all_blocks = blocks()
    index = [i for i, b in enumerate(all_blocks) if b.kind == "check" and b.name == "plan"]
    assert len(index) == 1, "exactly one 'readme-check: plan' block"
    block, sample = all_blocks[index[0]], all_blocks[index[0] + 1]
    assert sample.lang == "text", f"README line {sample.line}: the plan sample is a text block"
    (command,) = [c for c in shell_commands(block.text) if AFD_COMMAND.search(c)]
    argv = afd_argv(command)
    assert cli.main(argv) == cli.EXIT_OK
    assert capsys.readouterr().out == sample.text, "README's afd plan sample is stale"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_readme_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def _e2e_cases() -> set[str]:
    """Every E2E case as the README names it."""
    parity = _load(TESTS / "test_e2e_models_parity.py")
    quantized = _load(TESTS / "test_e2e_models_quantized.py")
    speculative = _load(TESTS / "test_e2e_models_speculative.py")
    published = _load(TESTS / "test_e2e_models_published.py")
    names = {f"parity[{case.id}]" for case in parity.CASES}
    names |= {f"quantized[{family}]" for family in quantized.CASES}
    names |= {f"speculative[{case}]" for case in speculative.CASES}
    names |= {f"published[{case.id}]" for case in published.CASES}
    expected = sum(len(m.CASES) for m in (parity, quantized, speculative, published))
    assert len(names) == expected, "duplicate case ids"
    return names


def test_support_matrix_names_every_e2e_case_once_and_nothing_else() -> None:
    header, rows = support_matrix()
    assert header[:5] == ["model", "A:F", "gate on", "experts", "stages"], header
    assert any(h.startswith("CPU") for h in header), header
    named = [t for row in rows for t in row.verified_tests]
    assert named, "no verified cell in the support matrix"
    cases = _e2e_cases()
    unknown = sorted(set(named) - cases)
    assert not unknown, f"verified cells naming no E2E case: {unknown}"
    missing = sorted(cases - set(named))
    assert not missing, f"E2E cases without a verified cell in the README's matrix: {missing}"
    repeated = sorted({t for t in named if named.count(t) > 1})
    assert not repeated, f"E2E cases named by several cells: {repeated}"
    # Only the CPU column is verified anywhere: the CUDA and Ascend workers never ran.
    cpu = next(i for i, h in enumerate(header) if h.startswith("CPU"))
    for row in rows:
        for i, cell in enumerate(row.cells):
            if i != cpu:
                assert "verified" not in cell, (header[i], row.cells)


def test_every_verified_row_names_its_settings() -> None:
    """A verified cell is only meaningful next to the settings it was verified with."""
    _, rows = support_matrix()
    for row in rows:
        if row.verified_tests:
            model, topology, gate, experts, stages = row.cells[:5]
            assert model and re.fullmatch(r"\d+:\d+(, Attention TP \d+)?", topology), row.cells
            assert gate in {"FFN", "Attention"} and experts and stages in {"1", "2"}, row.cells


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"])
def test_relative_links_point_at_files_in_the_repository(doc: str) -> None:
    text = (ROOT / doc).read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"{doc} links to files the repository does not contain: {broken}"


def test_no_file_cites_a_developers_guide_that_does_not_exist() -> None:
    if (ROOT / "DEVELOPERS.md").exists():
        return
    for path in [ROOT / "pyproject.toml", ROOT / "noxfile.py", *ROOT.glob("tools/*.py")]:
        assert "DEVELOPERS.md" not in path.read_text(), path
    for path in ROOT.glob("packages/*/README.md"):
        assert "DEVELOPERS.md" not in path.read_text(), path
