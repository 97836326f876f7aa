"""param_bytes: the bytes of a module's parameters (torch only, no vLLM)."""

from __future__ import annotations

import afd_weights
import torch
from afd_weights.accounting import param_bytes


def test_param_bytes_counts_shared_parameters_once_and_no_buffers() -> None:
    m = torch.nn.Module()
    m.a = torch.nn.Linear(4, 3, bias=False)
    m.b = torch.nn.Linear(3, 2, bias=True).to(torch.bfloat16)
    m.tied = m.a  # same parameters under a second name
    m.register_buffer("buf", torch.zeros(5, dtype=torch.int64))
    assert param_bytes(m) == 4 * 3 * 4 + (3 * 2 + 2) * 2


def test_param_bytes_counts_two_parameters_on_one_tensor_once() -> None:
    m = torch.nn.Module()
    m.a = torch.nn.Linear(4, 3, bias=False)
    # A distinct Parameter object over the same storage (how some loaders tie weights).
    m.alias = torch.nn.Parameter(m.a.weight.data)
    assert m.alias is not m.a.weight
    assert param_bytes(m) == 4 * 3 * 4


def test_param_bytes_of_a_module_without_parameters_is_zero() -> None:
    m = torch.nn.Module()
    m.register_buffer("buf", torch.zeros(3))
    assert param_bytes(m) == 0


def test_param_bytes_is_exported_at_the_top_level() -> None:
    assert afd_weights.param_bytes is param_bytes
    assert "param_bytes" in afd_weights.__all__
