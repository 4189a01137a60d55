"""Rank and process code of the Azure end-to-end tests (tests/test_store_azure.py).

Importable by name, as spawned ranks and racing processes need.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dcp_ext import CheckpointManager, CheckpointReader, CheckpointWriter, IOConfig, KeepLast
from dcp_ext.errors import DcpExtError, unwrap_checkpoint_exception
from dcp_ext.storage import AzureOptions, Location
from tests.support.compare import state_diff
from tests.support.reshard_workers import big, build, full_state, train

#: 1 MiB blocks, 4 in flight: each rank's ~6 MiB file is staged in several blocks.
OPTIONS = AzureOptions(block_size=1 << 20, max_concurrency=4)
#: 64 KiB frames: several frames per tensor, ranged reads across them.
CONFIG = IOConfig(frame_size=64 * 1024)


def location(url: str, storage_options: dict[str, Any]) -> Location:
    return Location(url, storage_options, CONFIG, OPTIONS)


def world(rank: int, world_size: int, root: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """(2 ranks) An FSDP2 model (4 x 1 MiB weights) with Adam:

    1. ``dcp.save`` through ``CheckpointWriter`` into ``root/sharded`` (each
       rank streams its shards as blocks), loaded back into a fresh FSDP2
       model through ``CheckpointReader``;
    2. a ``CheckpointManager`` on ``root/managed`` with ``KeepLast(2)``: three
       saves, trained between them, then a new manager resumes the newest
       into a fresh model.

    Returns (rank 0) the full state of both saves, the differences found
    in-world, and the manager's tags."""
    out: dict[str, Any] = {}
    model = build("fsdp2", 0, big(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train("fsdp2", model, optim, steps=1, width=512)
    msd, osd = get_state_dict(model, optim)
    sharded = location(f"{root}/sharded", storage_options)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=CheckpointWriter(sharded))
    # A copy: the optimizer's step counters are returned as they are and trained on below.
    out["sharded_ref"] = copy.deepcopy(full_state(model, optim))

    fresh = build("fsdp2", 7, big(7))
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
    train("fsdp2", fresh, fresh_optim, steps=1, width=512)
    msd, osd = get_state_dict(fresh, fresh_optim)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, storage_reader=CheckpointReader(sharded))
    set_state_dict(fresh, fresh_optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    out["sharded_diff"] = state_diff(out["sharded_ref"], full_state(fresh, fresh_optim))

    managed = location(f"{root}/managed", storage_options)
    manager = CheckpointManager(managed, retention=KeepLast(2))
    for step in (1, 2, 3):
        manager.save(f"step{step}", model, optim)
        if step < 3:
            train("fsdp2", model, optim, steps=1, width=512)
    out["tags"] = manager.tags()
    out["newest"] = manager.read_newest()
    out["managed_ref"] = copy.deepcopy(full_state(model, optim))
    manager.close()
    dist.barrier()

    resumed = build("fsdp2", 9, big(9))
    resumed_optim = torch.optim.Adam(resumed.parameters(), lr=0.01)
    train("fsdp2", resumed, resumed_optim, steps=1, width=512)
    again = CheckpointManager(managed)
    result = again.resume(resumed, resumed_optim)
    out["resumed_tag"] = result.tag
    out["resumed_diff"] = state_diff(out["managed_ref"], full_state(resumed, resumed_optim))
    again.close()
    return out if rank == 0 else {}


def load_into_one_rank(url: str, storage_options: dict[str, Any], manager: bool) -> dict[str, Any]:
    """(no process group) Load a 2-rank checkpoint into a plain model + Adam; its full state."""
    model = build("plain", 5, big(5))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train("plain", model, optim, steps=1, width=512)
    if manager:
        CheckpointManager(location(url, storage_options)).resume(model, optim)
    else:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optimizer": osd}
        dcp.load(state, storage_reader=CheckpointReader(location(url, storage_options)))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return full_state(model, optim)


def racer(k: int, root: str, storage_options: dict[str, Any], barrier: Any, results: Any) -> None:
    """One of two processes saving the same tag under one root at once: ``(k,
    (outcome, error type, message))`` on ``results``."""
    torch.manual_seed(k)
    model = torch.nn.Linear(256, 256)
    manager = CheckpointManager(location(root, storage_options))
    barrier.wait()
    try:
        manager.save("step1", model)
        outcome: tuple[str, str, str] = ("won", "", "")
    except DcpExtError as err:
        outcome = ("lost", type(err).__name__, str(err))
    except BaseException as err:  # noqa: BLE001 - reported to the test, which names it
        unwrapped = unwrap_checkpoint_exception(err)
        kind = "lost" if isinstance(unwrapped, DcpExtError) else "failed"
        outcome = (kind, type(unwrapped).__name__, f"{type(err).__name__}: {unwrapped}")
    try:
        manager.close()
    finally:
        results.put((k, (*outcome, os.getpid())))
