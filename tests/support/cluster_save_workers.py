"""Rank functions of tests/test_cluster.py, run by ``Cluster.spawn`` on the namespace cluster's hosts.

Every function returns plain data (the outcome, the error's type, message,
named ranks, hosts and step, and the seconds from the failure's start) so
the test process can check what each survivor saw.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

ROWS, COLS = 768, 512  # 1.5 MiB of float32 per rank of three: a few MiB per checkpoint


def model(step: int, world: int) -> torch.nn.Module:
    """The model at ``step`` (a pure function of it), FSDP2-sharded over the world: a
    ``ROWS x COLS`` weight dealt out by rows and a bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layer = torch.nn.Linear(COLS, ROWS)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step)
        layer.bias.fill_(float(step))
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    return layer


def _pause_here(point: str, gate: str) -> None:
    """Make this rank wait at crash point ``point`` until ``gate`` exists (``gate.reached`` says it is there)."""
    os.environ["DCP_EXT_PAUSE_AT"], os.environ["DCP_EXT_PAUSE_FILE"] = point, gate
    from dcp_ext._runtime import failpoints

    failpoints.reload()


def _outcome(started: float, fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"ok": False, "type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - started,
                "ranks": list(getattr(err, "ranks", ())), "hosts": list(getattr(err, "hosts", ())),
                "step": getattr(err, "step", "")}
    return {"ok": True, "seconds": time.monotonic() - started}


def save(path: str, step: int, options: dict[str, Any], timeout: float, victims: list[int], point: str = "",
         gate: str = "", manager_root: str = "", incremental: bool = False) -> dict[str, Any]:
    """Every rank saves ``state(step)`` to ``path`` (or as tag ``step{step}`` of
    the manager root ``manager_root``); the ranks in ``victims`` pause at
    ``point`` until ``gate`` exists (the test kills or cuts their host there)."""
    import torch.distributed as dist

    import dcp_ext

    rank, world = dist.get_rank(), dist.get_world_size()
    current = model(step, world)
    if rank in victims and point:
        _pause_here(point, gate)
    config = dcp_ext.IOConfig.from_env(collective_timeout=timeout)
    started = time.monotonic()
    if manager_root:
        manager = dcp_ext.CheckpointManager(manager_root, storage_options=options, config=config,
                                            incremental=incremental)
        result = _outcome(started, lambda: manager.save(f"step{step}", current))
    else:
        result = _outcome(started, lambda: dcp_ext.save({"model": current.state_dict()}, path,
                                                        storage_options=options, config=config))
    return result


def expected(step: int) -> dict[str, torch.Tensor]:
    """The model at ``step`` as whole tensors (what a one-process load gives)."""
    weight = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + step
    return {"weight": weight, "bias": torch.full((ROWS,), float(step))}


def resume(root: str, options: dict[str, Any], incremental: bool = False) -> dict[str, Any]:
    """Every rank resumes ``newest`` of the manager root into a fresh model; its tag and whether it is bit-exact."""
    import torch.distributed as dist

    import dcp_ext

    world = dist.get_world_size()
    fresh = model(-1, world)
    manager = dcp_ext.CheckpointManager(root, storage_options=options, incremental=incremental)
    result = manager.resume(fresh)
    step = int(result.tag.removeprefix("step"))
    want = model(step, world)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(fresh.parameters(), want.parameters()))
    manager.close()
    return {"tag": result.tag, "same": same}


def recover(root: str, options: dict[str, Any], step: int, timeout: float) -> dict[str, Any]:
    """After a failed save, in one world: :func:`resume` ``newest`` of the
    manager root, save ``step{step}`` (:func:`save`), :func:`resume` again;
    the three results. Each resume builds its own manager and a fresh model,
    so the second one reads the new tag from storage, as a new world would."""
    before = resume(root, options)
    saved = save(f"{root}/plain{step}", step, options, timeout, [], manager_root=root)
    return {"before": before, "saved": saved, "after": resume(root, options)}
