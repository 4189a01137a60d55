"""Run a benchmark function on N spawned ranks of a real gloo process group.

A thin layer over the test suite's ``tests.support.dist.run_world`` (importable
as such from the repository root, where ``python -m bench`` runs):
``run_world(n, "bench.harness.worker:throughput",
cfg)`` calls ``fn(rank, world_size, cfg)`` on each rank and returns rank 0's
value. A failing rank's traceback is raised here and the other ranks are
killed.
"""

from __future__ import annotations

import importlib
from typing import Any

from tests.support.dist import WorldError, run_world as _run_world

__all__ = ["run_world", "WorldError"]


def run_world(world: int, target: str, cfg: dict[str, Any], timeout: float = 3600.0) -> Any:
    """Run ``target`` (``"module:function"``) on ``world`` ranks; rank 0's result."""
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)
    collective_timeout = float(cfg.get("collective_timeout", 900))
    return _run_world(world, fn, cfg, timeout=timeout, collective_timeout=collective_timeout)[0]
