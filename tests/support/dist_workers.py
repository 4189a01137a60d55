"""Code that runs on each rank of the spawned worlds in test_multirank.py.

Each function is one world's worth of checks, grouped so that the cost of
spawning processes is paid once for several assertions.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter
from dcp_ext.storage import TMP_MARK
from tests.support.compare import assert_same_state


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 513 and 129 output rows do not divide evenly by 2 or 4 ranks; the last
    # layer (3 rows) leaves one rank of 4 with nothing. About 0.8 MB of fp32.
    return nn.Sequential(
        nn.Linear(256, 513), nn.ReLU(), nn.Linear(513, 129), nn.ReLU(), nn.Linear(129, 3)
    )


def make_fsdp(world_size: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An FSDP2 model with Adam state after one training step."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1000 + seed)
    model(torch.randn(8, 256)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def app_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def local_leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten a state dict to ``{path: local tensor or value}`` (DTensors -> local shard)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(local_leaves(value, f"{prefix}/{key}"))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(local_leaves(value, f"{prefix}/{i}"))
    elif isinstance(obj, torch.Tensor):
        tensor = obj.to_local() if hasattr(obj, "to_local") else obj
        out[prefix] = tensor.detach().clone()
    else:
        out[prefix] = obj
    return out


def saved_state(world_size: int) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """What every world saves: the FSDP2 model (seed 0), its app state (model
    and Adam) and that state's local leaves, to compare loads against."""
    model, optim = make_fsdp(world_size, seed=0)
    state = app_state(model, optim)
    return model, state, local_leaves(state)


def load_into_fresh(world_size: int, load: Any) -> dict[str, Any]:
    """Build a differently-initialized FSDP2 model, load into it, return its leaves."""
    model, optim = make_fsdp(world_size, seed=99)
    state = app_state(model, optim)
    load(state)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return local_leaves(app_state(model, optim))


def data_bytes(path: str, storage_options: dict[str, Any] | None = None) -> int:
    reader = CheckpointReader(path, storage_options=storage_options)
    metadata = reader.read_metadata()
    return sum(item.data_length for item in metadata.storage_data.values())


def file_digests(directory: str) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(directory))
    }


class FailingPlanner(DefaultSavePlanner):
    """Raises in the middle of one rank's write (after ``after`` items)."""

    def __init__(self, fail_rank: int, after: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank
        self.after = after
        self.resolved = 0

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.fail_rank:
            self.resolved += 1
            if self.resolved > self.after:
                raise RuntimeError(f"injected failure on rank {self.fail_rank}")
        return super().resolve_data(write_item)


# -- worlds --------------------------------------------------------------------
def two_rank_suite(rank: int, world_size: int, root: str, s3_root: str, s3_options: dict[str, Any]) -> dict[str, Any]:
    """FSDP2 + Adam on local disk and S3, async save, failure injection, interop."""
    report: dict[str, Any] = {}
    model, state, expected = saved_state(world_size)

    # 1. Local disk, sync save, same-partition load: bit-exact, and each rank
    #    reads about its half of the data.
    good = f"{root}/good"
    dcp.save(state, storage_writer=CheckpointWriter(good))
    reader = CheckpointReader(good)
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=reader))
    assert_same_state(expected, got, "local")
    snap = reader.store.stats.snapshot()
    report["local_bytes_read"] = snap.bytes_read
    report["local_total_bytes"] = data_bytes(good)

    # 2. S3 (moto) through dcp.async_save.
    s3_path = f"{s3_root}/async"
    future = dcp.async_save(state, storage_writer=CheckpointWriter(s3_path, storage_options=s3_options))
    future.result(timeout=120)
    got = load_into_fresh(
        world_size,
        lambda sd: dcp.load(sd, storage_reader=CheckpointReader(s3_path, storage_options=s3_options)),
    )
    assert_same_state(expected, got, "s3 async")

    # 3. A failure in the middle of rank 1's write.
    dist.barrier()
    before = file_digests(good) if rank == 0 else None
    broken = f"{root}/broken"
    try:
        dcp.save(state, storage_writer=CheckpointWriter(broken), planner=FailingPlanner(1, after=2))
    except CheckpointException as err:
        assert "injected failure on rank 1" in str(err)
    else:
        raise AssertionError("the injected failure did not fail the save")
    dist.barrier()
    if rank == 0:
        names = sorted(os.listdir(broken))
        report["broken_names"] = names
        assert not any(TMP_MARK in n for n in names), names
        assert "dcp_ext.metadata.json" not in names and ".metadata" not in names, names
    try:
        load_into_fresh(world_size, lambda sd: dcp_ext.load(sd, broken))
    except dcp_ext.CheckpointIncompleteError as err:
        report["broken_error"] = str(err)
    else:
        raise AssertionError("an incomplete checkpoint loaded")
    # Through dcp_ext.save, the committed files of the other ranks are removed too.
    dist.barrier()
    cleaned = f"{root}/cleaned"
    try:
        dcp_ext.save(state, cleaned, planner=FailingPlanner(1, after=2))
    except RuntimeError as err:
        report["wrapper_error"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    if rank == 0:
        report["cleaned_names"] = sorted(os.listdir(cleaned)) if os.path.exists(cleaned) else None
        assert file_digests(good) == before, "the earlier checkpoint changed"
    got = load_into_fresh(world_size, lambda sd: dcp_ext.load(sd, good))
    assert_same_state(expected, got, "earlier checkpoint after failures")

    # 4. Interop at 2 ranks: torch writes -> dcp_ext reads, and the reverse.
    theirs = f"{root}/torch_written"
    dcp.save(state, storage_writer=FileSystemWriter(theirs))
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=CheckpointReader(theirs)))
    assert_same_state(expected, got, "torch-written")
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=FileSystemReader(good)))
    assert_same_state(expected, got, "torch-read")
    return report


def four_rank_suite(
    rank: int, world_size: int, root: str, s3_root: str, s3_options: dict[str, Any], single: str
) -> dict[str, Any]:
    """FSDP2 + Adam at 4 ranks on local disk and SeaweedFS; a 1-process
    checkpoint loaded into 4 ranks; full weights returned for a 1-process load."""
    report: dict[str, Any] = {}
    model, state, expected = saved_state(world_size)
    for path, options in ((f"{root}/fsdp4", None), (f"{s3_root}/fsdp4", s3_options)):
        dcp.save(state, storage_writer=CheckpointWriter(path, storage_options=options, files_per_rank=2))
        reader = CheckpointReader(path, storage_options=options)
        got = load_into_fresh(world_size, lambda sd, r=reader: dcp.load(sd, storage_reader=r))
        assert_same_state(expected, got, path)
        report.setdefault("bytes_read", []).append(reader.store.stats.snapshot().bytes_read)
        report.setdefault("total_bytes", []).append(data_bytes(path, options))
    # A checkpoint saved by one process (plain model) loads into 4 FSDP2 ranks.
    sharded, _ = make_fsdp(world_size, seed=5)
    msd = get_model_state_dict(sharded)
    dcp.load(msd, storage_reader=CheckpointReader(single))
    set_model_state_dict(sharded, msd)
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Collectives: every rank gathers, rank 0 keeps the result.
    from_single = get_model_state_dict(sharded, options=full_options)
    full_saved = get_model_state_dict(model, options=full_options)
    if rank == 0:
        report["from_single"] = {k: v.clone() for k, v in from_single.items()}
        report["full_saved"] = {k: v.clone() for k, v in full_saved.items()}
    report["hf_2d"] = hf_export_2d(rank, f"{root}/hf2d")
    return report


def hf_export_2d(rank: int, folder: str) -> dict[str, Any]:
    """A 2 x 2 (dp, tp) mesh: tensor parallel inside FSDP2 (``_StridedShard``
    placements) exported with ``save_hf``; the full state and the placements
    for the test to check."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(11)
    mlp = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40))
    full = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(mlp, mesh=mesh["dp"])
    state = get_model_state_dict(mlp)
    written = dcp_ext.save_hf(state, folder, max_shard_size=20_000)
    return {
        "full": full if rank == 0 else None,
        "placements": {k: [type(p).__name__ for p in v.placements] for k, v in state.items()},
        "files": written.files,
    }


def one_rank_suite(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """FSDP2 + Adam with a process group of one."""
    model, state, expected = saved_state(world_size)
    dcp_ext.save(state, f"{root}/fsdp1")
    got = load_into_fresh(world_size, lambda sd: dcp_ext.load(sd, f"{root}/fsdp1"))
    assert_same_state(expected, got, "world of one")
    return {"names": sorted(os.listdir(f"{root}/fsdp1"))}


def faulty_rank_world(rank: int, world_size: int, root: str, options: list[dict[str, Any]]) -> dict[str, Any]:
    """Save through CheckpointManager where rank 1's S3 endpoint fails every
    upload; report what each rank raised and how long it took."""
    import time

    from dcp_ext import IOConfig, RetryPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB: multipart
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    # SlowDown is throttling: the store paces the retries (down to 1 request/s)
    # and gives up after PACED_ATTEMPTS_FACTOR (4) x max_attempts attempts. One
    # attempt allowed is 4 paced attempts (~2 s); 3 were 12 (~11 s of waiting
    # out the pacing, which proves nothing more).
    config = IOConfig(part_size=5 << 20, max_concurrency=2,
                      retry=RetryPolicy(max_attempts=1, base_delay=0.01, max_delay=0.05))
    manager = dcp_ext.CheckpointManager(root, storage_options=options[rank], config=config)
    start = time.monotonic()
    try:
        manager.save("t1", model)
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}
