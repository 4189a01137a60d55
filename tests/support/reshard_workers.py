"""Rank code for the resharding matrix (test_reshard.py): save worlds and load worlds."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dcp_ext
from dcp_ext.metadata.frame_index import frame_count
from dcp_ext import CheckpointManager, CheckpointReader, IOConfig, LayoutLoadPlanner
from tests.support.compare import state_diff

# Frames of the "big" checkpoints: 16 rows of a 512-column fp32 tensor.
SMALL_FRAME = 32 * 1024

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def mlp(seed: int, width: int = 8, hidden: int = 32, out: int = 2) -> nn.Sequential:
    # 32 rows split unevenly over 3 ranks (11/11/10); the 2-element output
    # layer leaves ranks without elements at 3 and 4 ranks. (Tensor parallel
    # needs even splits of the hidden size, which 2 and 4 ranks give.)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, out))


def big(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 4 x 1 MiB of weights


def build(kind: str, seed: int, model: nn.Module | None = None) -> nn.Module:
    model = model if model is not None else mlp(seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if kind == "plain":
        return model
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    elif kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    elif kind == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
    else:
        raise ValueError(kind)
    return model


def train(kind: str, model: nn.Module, optim: torch.optim.Optimizer, steps: int = 2, width: int = 8) -> None:
    replicated_input = kind in ("tp", "2d", "plain")
    for step in range(steps):
        rank = dist.get_rank() if dist.is_initialized() else 0
        torch.manual_seed(100 + step * 10 + (0 if replicated_input else rank))
        optim.zero_grad()
        model(torch.randn(4, width)).square().mean().backward()
        optim.step()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    if dist.is_initialized():
        msd, osd = get_state_dict(model, optim, options=FULL)
    else:
        msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optimizer": osd}


def save_one(kind: str, root: str, tag: str) -> None:
    model = build(kind, 0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(kind, model, optim)
    CheckpointManager(f"{root}/{tag}").save("s", model, optim)
    ref = full_state(model, optim)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(ref, f"{root}/{tag}.ref.pt")


def save_world(rank: int, world_size: int, root: str) -> None:
    kinds = ("fsdp2", "tp", "ddp") if world_size == 2 else ("fsdp2", "2d")
    for kind in kinds:
        save_one(kind, root, f"{kind}{world_size}")
    if world_size == 4:
        model = build("fsdp2", 0, big(0))
        optim = torch.optim.Adam(model.parameters(), lr=0.01)
        train("fsdp2", model, optim, steps=1, width=512)
        small_frames = IOConfig(frame_size=SMALL_FRAME)
        CheckpointManager(f"{root}/big4", config=small_frames).save("s", model, optim)
        CheckpointManager(f"{root}/bigz4", config=small_frames, compression="zstd").save("s", model, optim)
        CheckpointManager(f"{root}/bigmodel4").save("s", model)  # model only
        ref = full_state(model, optim)
        if rank == 0:
            torch.save(ref, f"{root}/big4.ref.pt")



def save_then_load_world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """:func:`save_world`, then (every rank saved: barrier) :func:`load_world`, in one world."""
    save_world(rank, world_size, root)
    dist.barrier()
    return load_world(rank, world_size, root)

def load_case(root: str, source: str, kind: str, via: str) -> list[str]:
    """Load checkpoint ``source`` into a fresh ``kind`` model + Adam; return differences."""
    model = build(kind, 7)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(kind, model, optim, steps=1)  # different values everywhere, optimizer state exists
    if via == "resume":
        dcp_ext.resume_from_checkpoint(f"{root}/{source}", model, optim)
    else:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optimizer": osd}
        reader = CheckpointReader(f"{root}/{source}/s_partial")
        dcp_load(state, storage_reader=reader, planner=LayoutLoadPlanner())
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    got = full_state(model, optim)
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    return state_diff(torch.load(f"{root}/{source}.ref.pt", weights_only=False), got)


CASES: dict[int, list[tuple[str, str, str]]] = {
    # world size -> (checkpoint, target layout, load path)
    2: [
        ("plain1", "fsdp2", "dcp"), ("fsdp22", "fsdp2", "resume"), ("fsdp24", "fsdp2", "dcp"),
        ("fsdp22", "tp", "resume"), ("tp2", "fsdp2", "dcp"), ("2d4", "fsdp2", "resume"),
        ("2d4", "tp", "dcp"), ("ddp2", "fsdp2", "resume"), ("fsdp22", "ddp", "dcp"),
    ],
    3: [("plain1", "fsdp2", "resume"), ("fsdp22", "fsdp2", "dcp"), ("fsdp24", "fsdp2", "resume")],
    4: [("plain1", "fsdp2", "dcp"), ("fsdp22", "fsdp2", "resume"), ("fsdp24", "fsdp2", "resume")],
}


def load_world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"diffs": {}}
    for source, kind, via in CASES[world_size]:
        out["diffs"][f"{source}->{kind}{world_size}({via})"] = load_case(root, source, kind, via)
    if world_size in (2, 3):
        # Bytes read by each rank in a 4 -> M reshard of a 12 MiB checkpoint:
        # exact byte ranges without checksum verification, whole 32 KiB frames
        # with it (the default), and whole compressed frames.
        sources = ("big4", "bigz4") if world_size == 3 else ("big4",)
        for source in sources:
            for verify in (False, True) if source == "big4" else (True,):
                model = build("fsdp2", 5, big(5))
                optim = torch.optim.Adam(model.parameters(), lr=0.01)
                train("fsdp2", model, optim, steps=1, width=512)
                # bigz4: no hole merging, so bytes read show exactly which
                # frames were fetched (compressed frames here are ~30 KB, and
                # the default 64 KiB local gap would read through the 1-2
                # frames between one tensor's rows and the next tensor's).
                gap = 0 if source == "bigz4" else None
                config = IOConfig(verify_checksums=verify, coalesce_gap=gap)
                manager = CheckpointManager(f"{root}/{source}", config=config)
                manager.resume(model, optim)
                reader, planner = manager.last_reader, manager.last_load_planner
                assert reader is not None and planner is not None
                metadata_reads = reader.metadata_reads  # before this rank's own read below
                meta = reader.read_metadata()
                got = full_state(model, optim)
                out[f"{source}/{verify}"] = {
                    "bytes_read": reader.store.stats.snapshot().bytes_read,
                    "verified": reader.frame_stats.verified,
                    "decoded": reader.frame_stats.decoded,
                    "decoded_bytes": reader.frame_stats.decoded_bytes,
                    "fast_path": planner.fast_path_keys,
                    "stored": sum(i.data_length for i in meta.storage_data.values()),
                    "raw": sum(i.raw_size for i in meta.storage_data.values()),
                    "frames": sum(frame_count(i) for i in meta.storage_data.values()),
                    "metadata_reads": metadata_reads,
                    "diff": state_diff(torch.load(f"{root}/big4.ref.pt", weights_only=False), got)
                    if rank == 0 else [],
                }
    if world_size == 4:
        # Same partition: each rank reads only its own file, no overlap planning.
        model = build("fsdp2", 5, big(5))
        manager = CheckpointManager(f"{root}/bigmodel4")
        manager.resume(model)
        assert manager.last_reader is not None and manager.last_load_planner is not None
        out["files_read"] = sorted(manager.last_reader.store.stats.snapshot().files_read)
        # Version-3 metadata: the coordinator read the document for all ranks,
        # and each rank read the frame index of its own file only.
        out["metadata_reads"] = manager.last_reader.metadata_reads
        out["indexes_read"] = sorted(manager.last_reader.storage_data.attached_files)
        out["fast_path"] = manager.last_load_planner.fast_path_keys
        out["tensors"] = len(get_model_state_dict(model))
    return out
