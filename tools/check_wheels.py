"""Run inside a fresh venv where the built afd wheels were installed (outside the workspace).

Checks: every afd distribution is installed from its wheel (not editable); every module of every
package imports (Ascend-only modules, which need vllm-ascend, and the Qwen3.5 adapter, whose vLLM
model module needs torchvision, are listed as skipped); every sibling in ``Requires-Dist`` carries a version range; the afd-models
``vllm.general_plugins`` entry point resolves and is callable twice.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pkgutil
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: Packages only an Ascend host has (CANN, torch-npu, vllm-ascend from source).
PLATFORM_ONLY = frozenset({"vllm_ascend", "torch_npu"})
#: Modules that subclass a vLLM model whose module imports the vision stack (torchvision), which
#: these CPU environments exclude (PyPI's torchvision breaks beside CPU torch). vLLM imports them
#: only when that architecture is served (the plugin registers them by name).
NEEDS_TORCHVISION = frozenset({"afd_models.models.qwen3_5_moe"})


def main(wheels: list[str]) -> int:
    names = {canonicalize_name(Path(w).name.split("-")[0]) for w in wheels}
    errors: list[str] = []
    for dist in sorted(names):
        meta = md.distribution(dist)
        if '"editable": true' in (meta.read_text("direct_url.json") or ""):
            errors.append(f"{dist}: installed editable, expected the built wheel")
        for spec in meta.requires or []:
            req = Requirement(spec)
            # A self-reference (`afd-models[demo]` inside an extra) is the same wheel: no range.
            sibling = canonicalize_name(req.name)
            if sibling in names and sibling != dist and not str(req.specifier):
                errors.append(
                    f"{dist}: Requires-Dist {spec!r} names a sibling without a version range"
                )
        module = dist.replace("-", "_")
        pkg = importlib.import_module(module)
        if "site-packages" not in (pkg.__file__ or ""):
            errors.append(
                f"{dist}: imported from {pkg.__file__}, not from the venv's site-packages"
            )
        count = 1
        for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{module}."):
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as err:
                missing = (err.name or "").split(".")[0]
                if missing == "torchvision" and info.name in NEEDS_TORCHVISION:
                    print(f"{info.name}: skipped, vLLM's model module needs torchvision")
                    continue
                # Ascend-only modules subclass vllm-ascend classes; no NPU stack installs here.
                if missing not in PLATFORM_ONLY:
                    raise
                print(f"{info.name}: skipped, needs {err.name} (Ascend platform only)")
                continue
            count += 1
        print(f"{dist} {meta.version}: {count} modules import; Requires-Dist: {meta.requires}")
    plugins = [
        ep
        for ep in md.entry_points(group="vllm.general_plugins")
        if ep.value.startswith("afd_models")
    ]
    if len(plugins) != 1:
        errors.append(f"expected one afd vllm.general_plugins entry point, found {plugins}")
    else:
        register = plugins[0].load()
        register()
        register()
        print(f"entry point {plugins[0].name} = {plugins[0].value} resolves and is re-entrant")
    for error in errors:
        print(f"ERROR: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
