"""Worker for the afd-cam gloo test (not a test module): a sequence-parallel round trip through
``torch_row_gather`` on a real process group; results go to ``out_dir/rank<r>.pt``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from afd_cam import CAMStageLayout, prepare_stage_inputs, restore_stage_outputs
from afd_core.collectives import torch_row_gather

COUNTS = (5, 3)
WIDTH = 4


def parent(layout: CAMStageLayout) -> torch.Tensor:
    x = torch.arange(layout.parent_input_tokens * WIDTH, dtype=torch.float32).view(-1, WIDTH) + 1
    x[layout.real_tokens :] = 0
    return x


def run(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=150),
    )
    try:
        layout = CAMStageLayout.from_token_counts(
            COUNTS, tp_size=world_size, tp_rank=rank, use_sequence_parallel=True
        )
        local = parent(layout)[layout.local_slice(layout.parent_input_tokens)]
        gather = torch_row_gather(dist.group.WORLD)
        inputs = prepare_stage_inputs(local, local * -1, layout, gather)
        outs = [h * 2 + 1 for h in inputs.hidden_states]
        hidden, residual = restore_stage_outputs(outs, inputs.residuals, layout, gather)
        torch.save(
            {
                "local": local,
                "stages": inputs.hidden_states,
                "hidden": hidden,
                "residual": residual,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
