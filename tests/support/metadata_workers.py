"""Rank functions for test_metadata_v3.py: plan caching and shared metadata reads."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter, LayoutSavePlanner


def _state(step: int, extra: bool = False) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {
        "model.w": distribute_tensor(torch.randn(64, 8, generator=gen), mesh, [Shard(0)]),
        "model.b": torch.full((8,), float(step)),  # replicated: one rank writes it
        "step": step,
    }
    if extra:
        state["model.extra"] = distribute_tensor(torch.randn(32, generator=gen), mesh, [Shard(0)])
    return state


def _zeros(like: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in like.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def full(v: Any) -> Any:
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    return all(
        torch.equal(full(a[k]), full(b[k])) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def plan_caching_world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Four saves with DCP's plan caching on: a first one, an unchanged one,
    one with an extra key, then unchanged again. Every one loads back
    bit-exact; the coordinator's gathered items show which plans came from the cache."""
    out: dict[str, Any] = {"gathered": [], "same": []}
    for k, extra in enumerate((False, False, True, True)):
        state = _state(k, extra)
        planner = LayoutSavePlanner(enable_plan_caching=True)
        dcp.save(state, storage_writer=CheckpointWriter(f"{root}/s{k}"), planner=planner)
        if rank == 0:
            out["gathered"].append(planner.gathered_items)
        back = _zeros(state)
        dcp_ext.load(back, f"{root}/s{k}")
        out["same"].append(_same(state, back))
    # Two states saved in turn (a model, then its optimizer-like other state), each planner named
    # after its state: from the second round on each finds its own previous plan. With one shared
    # name (the last pair) each save replaces the other's cache and plans again.
    out["named"] = []
    for k, (name_a, name_b) in enumerate((("a", "b"), ("a", "b"), ("", ""), ("", ""))):
        for name, extra in ((name_a, False), (name_b, True)):
            state = _state(10 + k, extra)
            planner = LayoutSavePlanner(enable_plan_caching=True, plan_cache_name=name)
            dcp.save(state, storage_writer=CheckpointWriter(f"{root}/n{k}{name or 'x'}{int(extra)}"), planner=planner)
            back = _zeros(state)
            dcp_ext.load(back, f"{root}/n{k}{name or 'x'}{int(extra)}")
            if rank == 0:
                out["named"].append((planner.gathered_items, _same(state, back)))
            else:
                assert _same(state, back)
    # Stock dcp.load: every rank reads the metadata itself (only dcp_ext's
    # loads, which know every rank reads it, share the coordinator's copy).
    reader = CheckpointReader(f"{root}/s0")
    state = _state(0)
    dcp.load(_zeros(state), storage_reader=reader)
    out["stock_metadata_reads"] = reader.metadata_reads
    dist.barrier()
    return out
