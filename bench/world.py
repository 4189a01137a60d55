"""Run a function on N spawned ranks of a real gloo process group.

``run_world(n, "bench.worker:throughput", cfg)`` starts ``n`` fresh Python
processes (``spawn``), rendezvous through a file, calls
``fn(rank, world_size, cfg)`` on each and returns rank 0's return value.
A failing rank's traceback is raised here and the other ranks are killed.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any


class WorldError(RuntimeError):
    """A rank failed, died or the world timed out."""


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _entry(rank: int, world: int, init_file: str, target: str, cfg: dict[str, Any], results: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=float(cfg.get("collective_timeout", 900))),
        )
        value = _resolve(target)(rank, world, cfg)
        dist.barrier()
        results.put((rank, True, value if rank == 0 else None))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run_world(world: int, target: str, cfg: dict[str, Any], timeout: float = 3600.0) -> Any:
    """Run ``target`` (``"module:function"``) on ``world`` ranks; rank 0's result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="bench_world_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(r, world, init_file, target, cfg, results), daemon=False)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) < world:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                        raise WorldError(
                            f"rank process died without a result: exit codes {[p.exitcode for p in procs]}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise WorldError(f"world of {world} timed out after {timeout:.0f}s") from None
                    continue
                if not ok:
                    raise WorldError(f"rank {rank} failed:\n{value}")
                values[rank] = value
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        return values[0]
