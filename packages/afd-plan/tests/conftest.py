"""Fixtures over the shared inputs of ``afd_plan_inputs``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from afd_plan.hardware import HardwareProfile, profile_from_mapping
from afd_plan.shape import ModelShape, shape_from_config
from afd_plan_inputs import ROUND_DEVICE, TINY_QWEN3


@pytest.fixture
def device() -> HardwareProfile:
    return profile_from_mapping(ROUND_DEVICE)


@pytest.fixture
def tiny() -> ModelShape:
    return shape_from_config(TINY_QWEN3)
