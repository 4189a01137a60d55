"""Rank functions of tests/test_cluster_tiers.py (and ``bench/cluster.py``), run by
``Cluster.spawn`` on the namespace cluster's hosts, one rank per host.

Every rank's local tier is ``tier_dir``, a directory under the node-local
directory (``Cluster.local_path``): the same path on every host, a different
directory on each; the persistent root is the cluster's S3 server. Functions return plain data
(outcomes, errors' types and what they name, where a restore read from) for
the test process to check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

ROWS, COLS = 1536, 1024  # 6 MiB of float32 over the world: 2 MiB per rank of three


def model(step: int, world: int, rows: int = ROWS, cols: int = COLS) -> torch.nn.Module:
    """The model at ``step`` (a pure function of it), FSDP2-sharded over the world:
    a ``rows x cols`` weight dealt out by rows and a bias."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layer = torch.nn.Linear(cols, rows)
    with torch.no_grad():
        layer.weight.copy_(torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 1e-3 + step)
        layer.bias.fill_(float(step))
    fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    return layer


def manager(tier_dir: str, root: str, options: dict[str, Any], timeout: float) -> Any:
    """A tiered manager: this host's local tier, one replica on the partner host, drains only on request."""
    import dcp_ext

    config = dcp_ext.IOConfig.from_env(collective_timeout=timeout)
    return dcp_ext.CheckpointManager(root, storage_options=options, config=config, local_tier=tier_dir,
                                     replicas=1, persist_every=0, keep_local=None)


def _pause_here(point: str, gate: str) -> None:
    """Make this rank wait at crash point ``point`` until ``gate`` exists (``gate.reached`` says it is there)."""
    os.environ["DCP_EXT_PAUSE_AT"], os.environ["DCP_EXT_PAUSE_FILE"] = point, gate
    from dcp_ext._runtime import failpoints

    failpoints.reload()


def _failure(err: BaseException, started: float) -> dict[str, Any]:
    return {"ok": False, "type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - started,
            "ranks": list(getattr(err, "ranks", ())), "hosts": list(getattr(err, "hosts", ())),
            "step": getattr(err, "step", "")}


def _stay_for_the_others(gate: str, rank: int, world: int, limit: float = 60.0) -> None:
    """After a failed save: rank 0 runs the rendezvous store (``env://``), in
    which the others read who is alive while they diagnose; it stays until
    every rank has its error (or ``limit`` s), as torchrun's agent would keep
    its store up."""
    Path(f"{gate}.failed.{rank}").touch()
    deadline = time.monotonic() + limit
    while rank == 0 and time.monotonic() < deadline:
        if all(Path(f"{gate}.failed.{r}").exists() for r in range(world)):
            return
        time.sleep(0.05)


def save(tier_dir: str, root: str, options: dict[str, Any], timeout: float, steps: list[tuple[int, bool]],
         victim: int = -1, point: str = "", gate: str = "", piece: int = 0, hold: str = "") -> list[dict[str, Any]]:
    """Every rank saves ``model(step)`` as tag ``step{step}`` for each ``(step,
    persist)`` of ``steps`` (persisted ones drained to the root and waited for).

    Rank ``victim`` pauses at crash point ``point`` of the last save until
    ``gate`` exists (the test cuts its host there). ``piece``: the size of the
    pieces replicas are sent in (default 64 MiB), so that a few-MiB file
    crosses in several. ``hold``: after the saves, create ``{hold}.{rank}``
    and wait until ``hold`` exists (the job "trains" while the test kills a host).

    Returns:
        Each save's outcome: ``ok`` and its seconds, or the error's type,
        message, named ranks, hosts and step.
    """
    import torch.distributed as dist

    from dcp_ext.tiers import _replicas

    if piece:
        _replicas._PIECE = piece
    rank, world = dist.get_rank(), dist.get_world_size()
    tiered = manager(tier_dir, root, options, timeout)
    outcomes = []
    for i, (step, persist) in enumerate(steps):
        current = model(step, world)
        if rank == victim and point and i == len(steps) - 1:
            _pause_here(point, gate)
        started = time.monotonic()
        try:
            tiered.save(f"step{step}", current, persist=persist)
            if persist:
                tiered.wait_for_persist()
        except Exception as err:  # noqa: BLE001 - reported to the test
            outcomes.append(_failure(err, started))
            if gate:
                _stay_for_the_others(gate, rank, world)
            return outcomes  # the group is broken: nothing more to do together
        outcomes.append({"ok": True, "seconds": time.monotonic() - started})
    if hold:
        Path(f"{hold}.{rank}").touch()  # this rank is past its saves
        while not Path(hold).exists():
            time.sleep(0.05)
    tiered.close()
    return outcomes


def restore(tier_dir: str, root: str, options: dict[str, Any], timeout: float,
            tag: str | None = None) -> dict[str, Any]:
    """Every rank resumes the newest tag (or ``tag``) into a fresh model: its tag,
    whether it is bit-exact, the bytes read from each source, and the plan."""
    import torch.distributed as dist

    world = dist.get_world_size()
    fresh = model(-1, world)
    tiered = manager(tier_dir, root, options, timeout)
    started = time.monotonic()
    result = tiered.resume(fresh, tag=tag)
    seconds = time.monotonic() - started
    step = int(result.tag.removeprefix("step"))
    want = model(step, world)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(fresh.parameters(), want.parameters()))
    plan = tiered.last_restore_plan
    store = tiered.last_reader.store
    report = {
        "tag": result.tag, "same": same, "seconds": seconds,
        "by_source": store.bytes_by_source(), "files_by_source": store.routes(),
        "local_nodes": sorted(plan.local_nodes), "in_root": plan.in_root, "local_complete": plan.local_complete,
        "fetches": sorted((t.name, t.source, t.target) for t in plan.fetches),
        "healed_nodes": sorted(plan.healed_nodes),
    }
    tiered.close()
    return report
