#!/usr/bin/env python3
"""Enforce the afd package map (CONTRIBUTING.md) on a workspace checkout.

The allowed sibling edges live in one place: ``[tool.afd.allowed-deps]`` of the root
``pyproject.toml``. This script checks what import-linter and deptry cannot express, and generates
the import-linter contracts (indirect import chains) from the same map.

Rules (each violation is printed as ``path:line: [rule] message``):

``undeclared-sibling``   a module imports a workspace sibling its pyproject does not declare.
``edge-not-allowed``     a pyproject declares a sibling edge the map does not allow.
``ffn-independence``     afd-remote, afd-cam and afd-compute-npu import or declare one another.
``upward-import``        a package below afd-runtime imports afd_runtime or afd_models.
``vllm-reach``           a package below afd-runtime reaches vLLM: it imports vllm or vllm_ascend
                         (at any time; a ``TYPE_CHECKING`` import for annotations is allowed) or
                         names one of their modules in a string (``sys.modules.get("vllm.x")``,
                         ``importlib.import_module("vllm.x")``).
``concrete-class``       an FFN package imports a concrete model or a worker/runner class.
``sibling-range``        a sibling requirement has no version range, or its range excludes the
                         sibling's current version.

Exit status: 0 when clean, 1 on violations, 2 on a malformed workspace.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

#: Packages that sit above the line: they may import vLLM eagerly and be imported by nobody below.
UPPER = frozenset({"afd-runtime", "afd-models"})
#: vLLM's top-level modules: nothing below afd-runtime imports them or names them in a string.
VLLM_MODULES = frozenset({"vllm", "vllm_ascend"})
VLLM_MODULE_NAME = re.compile(r"(?:vllm|vllm_ascend)(?:\.[A-Za-z_][A-Za-z0-9_]*)*\.?")
#: FFN packages: mutually independent, and blind to concrete models and worker/runner classes.
FFN_SIBLINGS = frozenset({"afd-remote", "afd-cam", "afd-compute-npu"})
FFN_PACKAGES = FFN_SIBLINGS | {"afd-weights"}
#: Modules that hold concrete model, worker or model-runner classes.
CONCRETE_MODULE_PREFIXES = (
    "vllm.model_executor.models",
    "vllm.v1.worker",
    "vllm.worker",
    "vllm_ascend.worker",
    "vllm_ascend.models",
    "afd_models",
    "afd_runtime",
)
CONCRETE_NAME_SUFFIXES = ("Worker", "ModelRunner", "ForCausalLM")


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    rule: str
    message: str

    def render(self, root: Path) -> str:
        try:
            shown = self.path.relative_to(root)
        except ValueError:
            shown = self.path
        return f"{shown}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Member:
    dist: str
    module: str
    root: Path
    pyproject: Path
    version: Version
    sibling_reqs: dict[str, tuple[Requirement, int]]  # dist -> (requirement, line in pyproject)
    #: Every further requirement of a sibling (an extra's, e.g. ``afd-runtime[cpu]>=0.4,<0.5``):
    #: (dist, requirement, line); only its version range is checked.
    more_sibling_reqs: tuple[tuple[str, Requirement, int], ...] = ()


@dataclass(frozen=True)
class ImportSite:
    module: str  # absolute dotted module name
    names: tuple[str, ...]  # names imported from it (``from m import a, b``)
    line: int
    module_level: bool  # executed at module import time (not inside a def, not TYPE_CHECKING)
    type_only: bool = False  # inside ``if TYPE_CHECKING:`` (never executed)


def _dist_to_module(dist: str) -> str:
    return canonicalize_name(dist).replace("-", "_")


def load_workspace(root: Path) -> tuple[dict[str, Member], dict[str, frozenset[str]]]:
    """Read the members and the allowed map; raise ``SystemExit(2)`` on a malformed workspace."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    try:
        allowed_raw = data["tool"]["afd"]["allowed-deps"]
    except KeyError:
        raise SystemExit("pyproject.toml: missing [tool.afd.allowed-deps]") from None
    allowed: dict[str, frozenset[str]] = {
        str(canonicalize_name(k)): frozenset(str(canonicalize_name(d)) for d in v)
        for k, v in allowed_raw.items()
    }
    members: dict[str, Member] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        text = pyproject.read_text()
        project = tomllib.loads(text)["project"]
        dist = str(canonicalize_name(project["name"]))
        members[dist] = Member(
            dist=dist,
            module=_dist_to_module(dist),
            root=pyproject.parent,
            pyproject=pyproject,
            version=Version(project["version"]),
            sibling_reqs={},
        )
    unknown = set(allowed) - set(members)
    missing = set(members) - set(allowed)
    if unknown or missing:
        raise SystemExit(
            f"[tool.afd.allowed-deps] must name exactly the workspace members: "
            f"unknown {sorted(unknown)}, missing {sorted(missing)}"
        )
    for dist, member in list(members.items()):
        project = tomllib.loads(member.pyproject.read_text())["project"]
        lines = member.pyproject.read_text().splitlines()
        reqs: dict[str, tuple[Requirement, int]] = {}
        more: list[tuple[str, Requirement, int]] = []
        raw = list(project.get("dependencies", []))
        for extra_reqs in project.get("optional-dependencies", {}).values():
            raw.extend(extra_reqs)
        for spec in raw:
            req = Requirement(spec)
            name = str(canonicalize_name(req.name))
            if name in members and name != dist:
                lineno = next((i + 1 for i, text in enumerate(lines) if f'"{spec}"' in text), 1)
                if name in reqs:
                    more.append((name, req, lineno))
                else:
                    reqs[name] = (req, lineno)
        members[dist] = Member(
            **{**member.__dict__, "sibling_reqs": reqs, "more_sibling_reqs": tuple(more)}
        )
    return members, allowed


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def iter_imports(path: Path, package_module: str) -> Iterator[ImportSite]:
    """Yield every import in ``path`` with whether it runs at module import time."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel_parts = path.with_suffix("").parts
    # Resolve relative imports against the file's own dotted name.
    idx = len(rel_parts) - 1 - rel_parts[::-1].index(package_module)
    own = list(rel_parts[idx:])
    is_init = own[-1] == "__init__"
    if is_init:
        own = own[:-1]

    def visit(node: ast.AST, module_level: bool, type_only: bool = False) -> Iterator[ImportSite]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, False, type_only)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), False, True)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), module_level)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield ImportSite(alias.name, (), child.lineno, module_level, type_only)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = own if is_init else own[:-1]
                    base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    name = ".".join([*base, child.module] if child.module else base)
                else:
                    name = child.module or ""
                yield ImportSite(
                    name, tuple(a.name for a in child.names), child.lineno, module_level, type_only
                )
            else:
                yield from visit(child, module_level, type_only)

    yield from visit(tree, True)


def _range_violations(
    member: Member, sib: str, req: Requirement, line: int, members: dict[str, Member]
) -> list[Violation]:
    """``sibling-range``: ``req`` (a requirement of ``member`` on ``sib``) has no version range,
    or its range excludes ``sib``'s current version."""
    version = members[sib].version
    if not str(req.specifier):
        msg = f"{member.dist} requires {sib} without a version range"
    elif not req.specifier.contains(version, prereleases=True):
        msg = f"{member.dist} requires '{req}', but the workspace has {sib} {version}"
    else:
        return []
    return [Violation(member.pyproject, line, "sibling-range", msg)]


def iter_vllm_module_strings(path: Path) -> Iterator[tuple[str, int]]:
    """Every string constant in ``path`` that is a vLLM module's dotted name (``"vllm"``,
    ``"vllm.forward_context"``, ``"vllm_ascend.ops"``, or a prefix of one such as ``"vllm."``
    in ``f"vllm.{name}"`` or ``startswith("vllm.")``): what ``sys.modules`` or ``importlib``
    would be handed to reach vLLM without an import statement. Quoted annotations are
    type-only and pass."""
    tree = ast.parse(path.read_text(), filename=str(path))
    # Quoted annotations (``x: "vllm.config.VllmConfig"``) are type-only, like TYPE_CHECKING.
    annotations: set[int] = set()
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            found.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            found.append(node.returns)
        for annotation in found:
            annotations.update(id(n) for n in ast.walk(annotation))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in annotations
            and VLLM_MODULE_NAME.fullmatch(node.value)
        ):
            yield node.value, node.lineno


def check(root: Path) -> list[Violation]:
    """Return every violation of the package map found under ``root``."""
    members, allowed = load_workspace(root)
    by_module = {m.module: m for m in members.values()}
    violations: list[Violation] = []

    for dist, member in members.items():
        for sib, (req, line) in member.sibling_reqs.items():
            if sib not in allowed[dist]:
                if dist in FFN_SIBLINGS and sib in FFN_SIBLINGS:
                    rule = "ffn-independence"
                    msg = f"{dist} declares {sib}; afd-remote, afd-cam and afd-compute-npu never depend on one another"
                elif dist not in UPPER and sib in UPPER:
                    rule = "upward-import"
                    msg = f"{dist} declares {sib}; packages below afd-runtime never depend on afd-runtime or afd-models"
                else:
                    rule = "edge-not-allowed"
                    msg = f"{dist} declares {sib}, an edge [tool.afd.allowed-deps] does not allow (allowed: {sorted(allowed[dist]) or 'none'})"
                violations.append(Violation(member.pyproject, line, rule, msg))
            violations.extend(_range_violations(member, sib, req, line, members))
        for sib, req, line in member.more_sibling_reqs:
            violations.extend(_range_violations(member, sib, req, line, members))

        src = member.root / "src" / member.module
        for path in sorted(src.rglob("*.py")):
            if dist not in UPPER:
                violations.extend(
                    Violation(
                        path,
                        line,
                        "vllm-reach",
                        f"{member.module} names the module {name!r} in a string; nothing below afd-runtime touches vLLM (no sys.modules or importlib reach either)",
                    )
                    for name, line in iter_vllm_module_strings(path)
                )
            for site in iter_imports(path, member.module):
                top = site.module.split(".")[0]
                target = by_module.get(top)
                if (
                    target is not None
                    and target.dist != dist
                    and target.dist not in member.sibling_reqs
                ):
                    if dist in FFN_SIBLINGS and target.dist in FFN_SIBLINGS:
                        rule = "ffn-independence"
                    elif dist not in UPPER and target.dist in UPPER:
                        rule = "upward-import"
                    else:
                        rule = "undeclared-sibling"
                    violations.append(
                        Violation(
                            path,
                            site.line,
                            rule,
                            f"{member.module} imports {site.module}, but {dist} does not declare {target.dist}",
                        )
                    )
                if dist not in UPPER and top in VLLM_MODULES and not site.type_only:
                    violations.append(
                        Violation(
                            path,
                            site.line,
                            "vllm-reach",
                            f"{member.module} imports {site.module}; nothing below afd-runtime touches vLLM (the runtime plugs in through afd_core.forward_context.StageHooks)",
                        )
                    )
                if dist in FFN_PACKAGES:
                    concrete_mod = site.module.startswith(CONCRETE_MODULE_PREFIXES)
                    concrete_names = [n for n in site.names if n.endswith(CONCRETE_NAME_SUFFIXES)]
                    if concrete_mod or concrete_names:
                        what = ", ".join(concrete_names) or site.module
                        violations.append(
                            Violation(
                                path,
                                site.line,
                                "concrete-class",
                                f"{member.module} imports {what}; FFN packages never import a concrete model or worker/runner class",
                            )
                        )
    return violations


def importlinter_config(root: Path) -> str:
    """Render import-linter contracts (INI) from the allowed map: one forbidden contract a package."""
    members, allowed = load_workspace(root)
    modules = sorted(m.module for m in members.values())
    out = [
        "[importlinter]",
        "root_packages =",
        *[f"    {m}" for m in modules],
        "include_external_packages = False",
        "",
    ]
    for dist in sorted(members):
        forbidden = sorted(
            members[o].module for o in members if o != dist and o not in allowed[dist]
        )
        if not forbidden:
            continue
        out += [
            f"[importlinter:contract:{members[dist].module}]",
            f"name = {dist} imports only its allowed siblings ({', '.join(sorted(allowed[dist])) or 'none'})",
            "type = forbidden",
            f"source_modules = {members[dist].module}",
            "forbidden_modules =",
            *[f"    {m}" for m in forbidden],
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument(
        "--write-importlinter",
        type=Path,
        metavar="FILE",
        help="also write import-linter contracts generated from the map to FILE",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    violations = check(root)
    for v in violations:
        print(v.render(root))
    if args.write_importlinter:
        args.write_importlinter.write_text(importlinter_config(root))
    if violations:
        print(f"{len(violations)} boundary violation(s)")
        return 1
    print("package map: no boundary violations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
