"""A 2-rank training job that saves one checkpoint, for crash-consistency trials.

``python -m tests.support.crash_job ROOT STEP CRASH [MODE]`` (from the
repository root) saves ``step{STEP}`` under ROOT with
``CheckpointManager`` (FSDP2 over 2 gloo ranks, keep 2) and exits 0. MODE is
one of :data:`MODES`:

* ``sync`` (default);
* ``async``: ``async_save=True``; the crash points then fire in the
  background upload while the training thread waits on the handle;
* ``sync-incremental`` / ``async-incremental``: the same with
  ``incremental=True``, ``max_chain=`` :data:`MAX_CHAIN` and frames of
  :data:`FRAME_SIZE` bytes; the model changes little from step to step
  (:func:`make_model`), so saves refer to earlier checkpoints' files.

CRASH says how to die on the way:

* ``none``: no crash;
* ``{rank|all}:{point}``: SIGKILL at crash point ``point`` (see
  ``dcp_ext/_failpoints.py``) on one rank or on every rank;
* ``{rank|all}:random:{seconds}``: SIGKILL that rank (or the whole job's
  process group) that many seconds after the save starts.

The model's weights are a pure function of STEP and MODE (:func:`make_model`),
so the driver can check any checkpoint bit for bit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

KEEP = 2
MODES = ("sync", "async", "sync-incremental", "async-incremental")
#: Incremental mode: saves allowed after a self-contained one; small, so
#: chains restart even in a short run (a chain is ``MAX_CHAIN + 1`` saves).
MAX_CHAIN = 2
#: Incremental mode: raw bytes per frame. One rank's shard of the first
#: layer's weight (512 rows of 512 float32) is four frames.
FRAME_SIZE = 256 * 1024
#: Incremental mode: the first layer's weight rows form this many blocks of
#: one frame each; step ``s`` redraws block ``s % ROW_BLOCKS`` only.
ROW_BLOCKS = 8


def is_incremental(mode: str) -> bool:
    """Whether ``mode`` (one of :data:`MODES`) saves with ``incremental=True``."""
    return mode.endswith("-incremental")


def make_model(step: int, incremental: bool = False):  # type: ignore[no-untyped-def]
    """The job's model at ``step``: a pure function of both arguments.

    4.3 MB of weights: several data-file items per rank, so "mid data" and
    random-time kills land inside the data. Without ``incremental`` every
    weight depends on ``step``; with it most are the same at every step (the
    second layer, most of the first), so incremental saves refer to earlier
    files for them (see :func:`_redraw_for_step`).
    """
    import torch
    from torch import nn

    torch.manual_seed(0 if incremental else step)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 64))
    if incremental:
        _redraw_for_step(model, step)
    return model


def _redraw_for_step(model, step: int) -> None:  # type: ignore[no-untyped-def]
    """Redraw, from a generator seeded by ``step``, the last layer's weight and
    one frame-sized block of rows of the first layer's (block ``step % ROW_BLOCKS``).

    Two consecutive steps differ in the last layer and in at most two blocks
    of the first: a rank's shard then mixes written and referred-to frames.
    """
    import torch

    generator = torch.Generator().manual_seed(step)
    first = model[0].weight
    rows = first.shape[0] // ROW_BLOCKS
    block = step % ROW_BLOCKS
    with torch.no_grad():
        first[block * rows : (block + 1) * rows].normal_(generator=generator)
        model[2].weight.normal_(generator=generator)


def _arm(rank: int, crash: str) -> None:
    if crash == "none":
        return
    who, _, what = crash.partition(":")
    if who not in ("all", str(rank)):
        return
    if what.startswith("random:"):
        delay = float(what.split(":", 1)[1])
        target = os.getpgrp() if who == "all" else os.getpid()

        def kill() -> None:
            if who == "all":
                os.killpg(target, signal.SIGKILL)
            os.kill(target, signal.SIGKILL)

        timer = threading.Timer(delay, kill)
        timer.daemon = True
        timer.start()
        return
    os.environ["DCP_EXT_CRASH_AT"] = what
    from dcp_ext._runtime import failpoints as _failpoints

    _failpoints.reload()


def job(rank: int, world_size: int, root: str, step: int, crash: str, mode: str = "sync") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    if mode not in MODES:
        raise ValueError(f"MODE must be one of {MODES}, got {mode!r}")
    incremental = is_incremental(mode)
    model = make_model(step, incremental)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    _arm(rank, crash)
    manager = (
        dcp_ext.CheckpointManager(root, config=dcp_ext.IOConfig(frame_size=FRAME_SIZE), incremental=True,
                                  max_chain=MAX_CHAIN)
        if incremental else dcp_ext.CheckpointManager(root)
    )
    handle = manager.save(
        f"step{step}", model, user_content={"step": step}, num_kept_partial_checkpoints=KEEP,
        async_save=mode.startswith("async"),
    )
    if handle is not None:
        handle.staging_completion.result()
        with torch_no_grad():  # training goes on: the checkpoint must not see this
            for param in model.parameters():
                param.add_(1.0)
        handle.result()
    manager.close()


def torch_no_grad():  # type: ignore[no-untyped-def]
    import torch

    return torch.no_grad()


if __name__ == "__main__":
    from tests.support import dist
    from tests.support.dist import run_world

    # Both ranks fork from one process that imported torch once (dist.py), not
    # two fresh interpreters each importing it: on 2 busy cores that is about a
    # second of CPU per job. That process is this job's child, in its process
    # group, so a kill of "all" (killpg) still takes the job and both ranks.
    dist.START_METHOD = "forkserver"

    mode = sys.argv[4] if len(sys.argv) > 4 else "sync"
    run_world(2, job, sys.argv[1], int(sys.argv[2]), sys.argv[3], mode, timeout=120.0)
