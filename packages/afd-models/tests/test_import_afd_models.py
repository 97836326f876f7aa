"""Every module of afd_models imports in an environment holding only afd-models and its declared deps."""

import importlib
import pkgutil
import sys
from pathlib import Path

import afd_models


def test_every_module_imports() -> None:
    # vLLM's qwen3_5 module (under afd_models.models.qwen3_5_moe) imports torchvision through
    # its vision stack; PyPI's torchvision is kept out of these environments (see the kit).
    sys.path.insert(0, str(Path(__file__).parent))
    import afd_models_adapter_kit

    afd_models_adapter_kit.import_qwen3_5()
    names = [m.name for m in pkgutil.walk_packages(afd_models.__path__, prefix="afd_models.")]
    for name in names:
        importlib.import_module(name)
    assert afd_models.__version__


def test_demo_packages_come_only_with_the_demo_extra() -> None:
    """A plain (e.g. Ascend) install needs none of the demo's packages; cpu and cuda pull them in."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    demo = {"prometheus-client", "psutil", "requests", "safetensors", "tokenizers"}
    reqs = [Requirement(r) for r in requires("afd-models") or []]
    base = {r.name for r in reqs if r.marker is None}
    assert not base & demo
    in_demo = {r.name for r in reqs if r.marker and r.marker.evaluate({"extra": "demo"})}
    assert in_demo == demo
    for extra in ("cpu", "cuda"):
        assert any(
            r.name == "afd-models" and r.extras == {"demo"} and r.marker.evaluate({"extra": extra})
            for r in reqs
            if r.marker
        )
    assert not any(
        r.name in demo or r.name == "afd-models"
        for r in reqs
        if r.marker and r.marker.evaluate({"extra": "ascend"})
    )
