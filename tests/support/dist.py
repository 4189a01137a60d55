"""Run a function on every rank of a real gloo process group (spawned processes).

``run_world(n, fn, *args)`` starts ``n`` processes, initializes a gloo process
group in each (file-based rendezvous, so no port races), runs
``fn(rank, world_size, *args)`` and returns the per-rank results. Every rank
passes a barrier, flushes its result, and leaves with ``os._exit(0)`` without
tearing gloo down (a rank torn down while a peer is still in gloo can die with
SIGABRT and fail the run). If any rank raises, the others are killed and the
first traceback is re-raised in the test process.

Ranks start with ``spawn`` (a fresh interpreter each) unless the caller asks for
``forkserver``, as the test suite does (``tests/conftest.py`` sets
:data:`START_METHOD`): a fork server is a fresh interpreter that imports torch
once, and every rank of every later world is forked from it. A rank is still a
process of its own with its own gloo group; it only skips the seconds of
interpreter start and ``import torch`` that a spawned rank pays (on 2 loaded
cores, 2-5 s of wall time per world). Each rank takes the test process's
environment as it is at ``run_world`` (not the fork server's, which is the
environment of the first world), before it imports anything of dcp_ext.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


#: How ranks start: ``"spawn"`` (default; ``bench/`` keeps it) or ``"forkserver"``.
START_METHOD = "spawn"

#: What the fork server imports once, before it forks any rank: torch only
#: (dcp_ext reads some settings from the environment at import, so each rank
#: imports it itself, after it took the caller's environment).
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]


def context() -> Any:
    """The multiprocessing context ranks start in (:data:`START_METHOD`), fork server preloaded."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _call_with_environ(environ: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    target(*args)


def process(ctx: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``ctx.Process(target=target, args=args)`` for tests that start processes
    themselves (no process group, or one that must lose a rank): the process
    runs ``target`` with the caller's current environment, as a spawned one would."""
    return ctx.Process(target=_call_with_environ, args=(dict(os.environ), target, *args))


def run_processes(ctx: Any, target: Callable[..., Any], args: list[tuple[Any, ...]], timeout: float) -> tuple[
        dict[Any, Any], list[int | None]]:
    """Start one :func:`process` per ``args`` (each ``target(*args, results)``
    puts one ``(key, value)`` on the queue ``results``); wait for every
    result, join (killing a process that does not end within 30 s).

    Returns:
        The results by key, and each process's exit code.
    """
    results = ctx.Queue()
    procs = [process(ctx, target, (*a, results)) for a in args]
    for proc in procs:
        proc.start()
    try:
        outcomes = dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return outcomes, [proc.exitcode for proc in procs]


class WorldError(AssertionError):
    """A rank of a spawned world failed; the message holds its traceback."""


def _entry(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    collective_timeout: float,
    environ: dict[str, str],
) -> None:
    # A forked rank inherits the fork server's environment: take the caller's.
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world_size, *args)
        dist.barrier()
        # Tensors in a multiprocessing queue travel as shared-memory handles
        # that die with this process; send plain bytes instead.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
        results.close()
        results.join_thread()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        # Flush the queue's feeder thread, then leave without waiting for
        # peers that may be stuck in a collective.
        results.close()
        results.join_thread()
        os._exit(1)
    # Every rank passed the barrier and its result is flushed: leave without
    # running C++ destructors. Tearing gloo down (destroy_process_group, or
    # interpreter exit) while a peer is still inside it occasionally aborts a
    # rank with "terminate called without an active exception" (seen here
    # even after a barrier), which fails a run that produced correct results.
    os._exit(0)


def _decode(payload: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 240.0,
    collective_timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    ``fn`` must be importable by its module's name in a fresh interpreter
    (spawned ranks unpickle it), e.g. ``tests.support.dist_workers.two_rank_suite``.
    Also used by ``bench/`` (``from tests.support.dist import run_world``).

    Returns:
        ``fn``'s return values, indexed by rank (they must pickle).

    Raises:
        WorldError: A rank raised, died or the world exceeded ``timeout`` s.
    """
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dcp_ext_world_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(rank, world_size, init_file, fn, args, results, collective_timeout, dict(os.environ)),
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) < world_size:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and results.empty():
                        raise WorldError(
                            f"rank process(es) died without a result: exit codes "
                            f"{[p.exitcode for p in procs]}"
                        ) from None
                    if time.monotonic() > deadline:
                        raise WorldError(f"world of {world_size} timed out after {timeout}s") from None
                    continue
                if not ok:
                    raise WorldError(f"rank {rank} failed:\n{value}")
                values[rank] = _decode(value)
            for proc in procs:
                proc.join(timeout=30)
            codes = [p.exitcode for p in procs]
            if any(code != 0 for code in codes):
                raise WorldError(f"ranks exited with codes {codes} after finishing")
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=5)
        return [values[r] for r in range(world_size)]
