"""The root README's testable parts: its marked shell blocks and its support matrix.

A fenced block is marked by an HTML comment on the line before its opening fence:
``<!-- readme-test: NAME -->`` (run as written by an engine test) or
``<!-- readme-check: serve-args -->`` (its ``afd serve`` commands are parsed, not run) or
``<!-- readme-check: plan -->`` (its ``afd plan`` command runs in-process on a stand-in config
and prints the text block that follows). The
support matrix is the table between ``<!-- support-matrix: begin -->`` and ``... end -->``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"

_MARKER = re.compile(r"^<!--\s*readme-(test|check):\s*([\w-]+)\s*-->\s*$")
_FENCE = re.compile(r"^```(\w*)\s*$")
#: An ``afd`` subcommand invoked on a shell line (also as ``uv run ... afd demo``, ``$(afd tiny)``).
AFD_COMMAND = re.compile(r"(?<![\w./-])afd\s+(serve|demo|tiny|bench|plan)(?![\w:-])")


@dataclass(frozen=True)
class Block:
    kind: str | None  # "test", "check" or None (unmarked)
    name: str | None
    lang: str
    text: str
    line: int  # 1-based line of the opening fence


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README, with the marker on the line before it (if any)."""
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"README.md line {i + 1}: fenced block never closed")
        found.append(
            Block(
                kind=marker.group(1) if marker else None,
                name=marker.group(2) if marker else None,
                lang=fence.group(1),
                text="\n".join(lines[i + 1 : end]) + "\n",
                line=i + 1,
            )
        )
        i = end + 1
    return found


def marked_block(name: str) -> str:
    """The text of the block marked ``readme-test: name`` (exactly one must exist)."""
    matches = [b for b in blocks() if b.kind == "test" and b.name == name]
    if len(matches) != 1:
        raise AssertionError(
            f"README.md must hold exactly one block marked 'readme-test: {name}', "
            f"found {len(matches)}"
        )
    return matches[0].text


def shell_commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def afd_argv(command: str) -> list[str]:
    """``afd serve X --flag v`` -> ``["serve", "X", "--flag", "v"]`` (shell words, comments and
    a trailing ``&`` or redirection dropped)."""
    words = shlex.split(command, comments=True)
    start = words.index("afd") + 1
    argv = []
    for w in words[start:]:
        if w in {"&", ">", "2>&1", "|"} or w.startswith(">"):
            break
        argv.append(w)
    return argv


@dataclass(frozen=True)
class MatrixRow:
    cells: tuple[str, ...]

    @property
    def verified_tests(self) -> list[str]:
        """Test names of this row's verified cells (``verified `NAME` ``)."""
        return [m for cell in self.cells for m in re.findall(r"verified `([^`]+)`", cell)]


def support_matrix() -> tuple[list[str], list[MatrixRow]]:
    """The header and rows of the README's support matrix."""
    text = README.read_text()
    begin = text.index("<!-- support-matrix: begin -->")
    end = text.index("<!-- support-matrix: end -->")
    lines = [ln for ln in text[begin:end].splitlines()[1:] if ln.startswith("|")]
    split = [tuple(c.strip() for c in ln.strip().strip("|").split("|")) for ln in lines]
    header, rule, *rows = split
    assert all(set(c) <= {"-", ":"} for c in rule), rule
    for row in rows:
        assert len(row) == len(header), f"support matrix row has {len(row)} cells: {row}"
    return list(header), [MatrixRow(r) for r in rows]


#: PyTorch's CPU index, as the README's quick start names it.
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def stand_in_torch_index(root: Path) -> str:
    """A PEP 503 simple index under ``root`` serving the torch wheel the committed lock names
    (PyTorch's CPU index cannot be reached from the build machine); its ``file://`` URL.

    Raises ``FileNotFoundError`` when that wheel is not on this machine."""
    import hashlib
    import os
    import tomllib

    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    (torch,) = [p for p in lock["package"] if p["name"] == "torch"]
    (entry,) = torch["wheels"]
    wheel = Path(entry["path"])
    if not wheel.is_file():
        raise FileNotFoundError(wheel)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    project = root / "torch"
    project.mkdir(parents=True)
    os.symlink(wheel, project / wheel.name)
    href = wheel.name.replace("+", "%2B")
    (root / "index.html").write_text('<html><body><a href="torch/">torch</a></body></html>\n')
    (project / "index.html").write_text(
        f'<html><body><a href="{href}#sha256={digest}">{wheel.name}</a></body></html>\n'
    )
    return root.as_uri()


def copy_checkout(dest: Path) -> None:
    """The repository's files as a fresh clone has them (tracked and untracked-but-not-ignored
    files when git is there; else the tree without build outputs and environments)."""
    import shutil
    import subprocess

    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(
            ROOT,
            dest,
            ignore=shutil.ignore_patterns(
                ".git", ".venv", ".nox", "dist", "__pycache__", "*.egg-info", "afd-*-logs"
            ),
        )
        return
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
