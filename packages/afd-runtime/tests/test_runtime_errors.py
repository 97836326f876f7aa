"""Everything afd-runtime raises is an afd-core ``AFDError``: a scan of its source for ``raise``.

A ``raise`` of a builtin exception class (``ValueError``, ``TypeError``, ``RuntimeError``, ...) is
refused; so is a ``raise`` of a class defined or imported at module level that does not derive
from ``AFDError``. Allowed: ``SystemExit`` (how a role's process ends on SIGTERM: vLLM's engine
loop stops on it, and it is not an error), re-raising a caught error (``raise`` / ``raise err``),
and the vLLM exception types that vLLM's own API dispatches on (imported inside the patch that
raises them, so not resolvable here; see :mod:`afd_runtime.ffn_loss`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import afd_runtime
import pytest
from afd_core.errors import AFDError

SRC = Path(afd_runtime.__file__).parent
#: Builtin exception classes afd-runtime may raise, and why.
ALLOWED_BUILTINS = {"SystemExit": "ends the process on SIGTERM; not an error"}


def _raised_name(node: ast.Raise) -> str | None:
    """The class name a ``raise`` names (``raise X``, ``raise X(...)``, ``raise mod.X(...)``)."""
    exc = node.exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    if isinstance(exc, ast.Name):
        return exc.id
    if isinstance(exc, ast.Attribute):
        return exc.attr
    return None


def builtin_raises(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: raise <Builtin>`` for every raise of a builtin exception not allowed."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Raise):
            continue
        name = _raised_name(node)
        obj = getattr(builtins, name, None) if name else None
        is_exc = isinstance(obj, type) and issubclass(obj, BaseException)
        if is_exc and name not in ALLOWED_BUILTINS:
            found.append(f"{filename}:{node.lineno}: raise {name}")
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def test_scan_covers_the_package() -> None:
    names = {name for name, _ in _modules()}
    # The modules the rule was written for are scanned (a moved tree would scan nothing).
    assert {"afd_runtime.roles", "afd_runtime.workers.base", "afd_runtime.compute"} <= names


@pytest.mark.parametrize(
    "planted",
    [
        "def f():\n    raise ValueError('x')\n",
        "def f():\n    raise TypeError\n",
        "import builtins\ndef f():\n    raise builtins.RuntimeError('x') from None\n",
        "def f():\n    try:\n        pass\n    except OSError:\n        raise KeyError('k')\n",
    ],
)
def test_scan_finds_a_planted_builtin_raise(planted: str) -> None:
    assert len(builtin_raises(planted, "planted.py")) == 1


def test_scan_allows_afd_errors_reraises_and_system_exit() -> None:
    source = (
        "from afd_core.errors import AFDConfigError\n"
        "def f(err):\n"
        "    raise AFDConfigError('port', 1, 'a port')\n"
        "def g(err):\n"
        "    raise err\n"
        "def h():\n"
        "    try:\n"
        "        pass\n"
        "    except OSError:\n"
        "        raise\n"
        "def i():\n"
        "    raise SystemExit(0)\n"
    )
    assert builtin_raises(source) == []


def test_afd_runtime_raises_no_builtin_exception() -> None:
    found = []
    for _, path in _modules():
        found += builtin_raises(path.read_text(), str(path.relative_to(SRC.parent)))
    assert found == [], "afd-runtime raises builtin exceptions; raise an afd-core AFDError:\n" + (
        "\n".join(found)
    )


def test_every_module_level_class_afd_runtime_raises_is_an_afd_error() -> None:
    offenders = []
    for name, path in _modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:  # the NPU worker needs vllm-ascend
            assert err.name == "vllm_ascend", err
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            raised = _raised_name(node) if isinstance(node, ast.Raise) else None
            obj = getattr(module, raised, None) if raised else None
            if not isinstance(obj, type) or raised in ALLOWED_BUILTINS:
                continue  # a caught error re-raised, a function's result, or SystemExit
            if not issubclass(obj, AFDError):
                offenders.append(f"{name}:{node.lineno}: {raised}")
    assert offenders == []
