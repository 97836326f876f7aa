"""Rendering: the table's rows and baseline block, the JSON document, and the plot's calls (a
recording stand-in for matplotlib, which this environment need not have)."""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from afd_plan.errors import AFDPlanError
from afd_plan.hardware import HardwareProfile
from afd_plan.plan import search
from afd_plan.report import plan_json, plot_ratio, render_table
from afd_plan.shape import ModelShape
from afd_plan.workload import Workload

W = Workload(input_len=10, output_len=2)


def test_table_and_json_agree(tiny: ModelShape, device: HardwareProfile) -> None:
    result = search(tiny, W, device, devices=4, batches=(1, 8))
    table = render_table(result, tiny, device, W, top=3)
    data = plan_json(result, tiny, device, W, top=3)
    json.dumps(data)  # serialisable
    rows = table.split("\n\n")[1].splitlines()[1:]
    assert len(rows) == 3 == len(data["candidates"])
    for row, cand in zip(rows, data["candidates"], strict=True):
        assert f"{cand['tokens_per_s_per_device']:.1f}" in row
        assert f"{cand['attention_ranks']}:{cand['ffn_ranks']}" in row
    assert "colocated baseline" in table and data["colocated_baselines"]


class _Recorder:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return (self, self) if name == "subplots" else None

        return record


def _fake_matplotlib(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    mpl = types.ModuleType("matplotlib")
    mpl.__spec__ = importlib.machinery.ModuleSpec("matplotlib", None)
    mpl.use = lambda backend: calls.append(f"use:{backend}")  # type: ignore[attr-defined]
    pyplot = _Recorder(calls)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)  # type: ignore[arg-type]
    mpl.pyplot = pyplot  # type: ignore[attr-defined]


def test_plot_draws_a_line_per_f_and_the_baseline(
    tiny: ModelShape, device: HardwareProfile, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    _fake_matplotlib(monkeypatch, calls)
    result = search(tiny, W, device, devices=6, batches=(4,))
    plot_ratio(result, tmp_path / "p.png", measured={2.0: 1000.0})
    n_f = len({p.candidate.num_ffn for p in result.candidates})
    assert calls[0] == "use:Agg" and calls.count("plot") == n_f
    assert "axhline" in calls and "scatter" in calls and "savefig" in calls


def test_plot_without_matplotlib(
    tiny: ModelShape, device: HardwareProfile, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name)
    )
    result = search(tiny, W, device, devices=2, batches=(1,))
    with pytest.raises(AFDPlanError, match="pip install matplotlib") as err:
        plot_ratio(result, tmp_path / "p.png")
    assert err.value.field == "--plot"
