"""Print the failed and errored tests of pytest JUnit reports, with the end of each one's text.

``python tools/junit_failures.py DIR [--lines N]``: every ``DIR/*.xml`` (one per nox session,
named after it), oldest first. Exits 0 whatever it finds (the sessions' own exit codes say
whether the run failed); a report that cannot be parsed is named, not fatal.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: Lines kept from the end of each failure's text (its assertion and the frames around it).
DEFAULT_LINES = 30


def failures(report: Path) -> list[tuple[str, str, str]]:
    """``(kind, test id, text)`` of each failed or errored test case of ``report``."""
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            for node in case.findall(kind):
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                text = (node.text or node.get("message") or "").rstrip()
                found.append((kind, test, text))
    return found


def render(directory: Path, lines: int = DEFAULT_LINES) -> str:
    """The digest of every report in ``directory`` (a line saying so when nothing failed)."""
    reports = sorted(directory.glob("*.xml"), key=lambda p: p.stat().st_mtime)
    out: list[str] = []
    total = 0
    for report in reports:
        try:
            found = failures(report)
        except (ET.ParseError, OSError) as err:
            out.append(f"== {report.stem}: unreadable report ({type(err).__name__}: {err})")
            continue
        total += len(found)
        for kind, test, text in found:
            tail = text.splitlines()[-lines:]
            out.append(f"== {report.stem}: {kind.upper()} {test}")
            out.extend(f"   {line}" for line in tail)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    head = (
        f"{total} failed or errored test(s) in {len(reports)} report(s) of {directory} ({stamp})"
        if reports
        else f"no test reports in {directory}"
    )
    return "\n".join([head, *out])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--lines", type=int, default=DEFAULT_LINES)
    args = parser.parse_args(argv)
    print(render(args.directory, args.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
