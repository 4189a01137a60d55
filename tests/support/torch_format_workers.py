"""Rank code of test_torch_formats.py: torch's HuggingFaceStorageWriter in a
2-rank world, and its output loaded resharded with dcp_ext."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor

from dcp_ext import CheckpointReader, LayoutLoadPlanner


def hf_state() -> dict[str, torch.Tensor]:
    """The tensors every HF test saves (2.5 MiB: big enough that a rank
    reading half of it is told apart from one reading it all)."""
    generator = torch.Generator().manual_seed(18)
    return {
        "embed.weight": torch.randn(1024, 512, generator=generator),
        "head.weight": torch.randn(512, 512, generator=generator).to(torch.bfloat16),
        "head.bias": torch.arange(7, dtype=torch.int64),
    }


# How the world saves (distributed) and how it loads the parent's full folder
# (row shards: contiguous byte ranges of the stored tensors).
SAVE_PLACEMENTS: dict[str, Placement] = {"embed.weight": Shard(1), "head.weight": Shard(0), "head.bias": Replicate()}
LOAD_PLACEMENTS: dict[str, Placement] = {"embed.weight": Shard(0), "head.weight": Shard(0), "head.bias": Shard(0)}


def hf_world(rank: int, world_size: int, distributed_dir: str, full_dir: str) -> dict[str, Any]:
    """Save with torch's writer (``save_distributed=True``: one file per rank),
    then load ``full_dir`` (written by one process) into other shardings
    with ``CheckpointReader``. Returns this rank's loaded shards and bytes read."""
    mesh = init_device_mesh("cpu", (world_size,))
    state = hf_state()
    sharded = {k: distribute_tensor(v, mesh, [SAVE_PLACEMENTS[k]]) for k, v in state.items()}
    dcp.save(sharded, storage_writer=HuggingFaceStorageWriter(distributed_dir, save_distributed=True))

    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [LOAD_PLACEMENTS[k]]) for k, v in state.items()}
    reader = CheckpointReader(full_dir)
    dcp.load(target, storage_reader=reader, planner=LayoutLoadPlanner())
    return {
        "local": {k: v.to_local().clone() for k, v in target.items()},
        "expected": {k: distribute_tensor(v, mesh, [LOAD_PLACEMENTS[k]]).to_local().clone() for k, v in state.items()},
        "bytes_read": reader.store.stats.snapshot().bytes_read,
    }

