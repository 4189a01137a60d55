"""A 2-rank training job that saves one checkpoint, for crash-consistency trials.

``python -m tests.support.crash_job ROOT STEP CRASH [MODE]`` (from the
repository root) saves ``step{STEP}`` under ROOT with
``CheckpointManager`` (FSDP2 over 2 gloo ranks, keep 2) and exits 0. MODE is
``sync`` (default) or ``async`` (``async_save=True``: the crash points then
fire in the background upload while the training thread waits on the
handle). CRASH says how to die on the way:

* ``none``: no crash;
* ``{rank|all}:{point}``: SIGKILL at crash point ``point`` (see
  ``dcp_ext/_failpoints.py``) on one rank or on every rank;
* ``{rank|all}:random:{seconds}``: SIGKILL that rank (or the whole job's
  process group) that many seconds after the save starts.

The model's weights are a pure function of STEP (:func:`make_model`), so the
driver can check any checkpoint bit for bit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

KEEP = 2


def make_model(step: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(step)
    # 4.3 MB of weights: several data-file items per rank, so "mid data"
    # and random-time kills land inside the data.
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 64))


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
    from dcp_ext import _failpoints

    _failpoints.reload()


def job(rank: int, world_size: int, root: str, step: int, crash: str, mode: str = "sync") -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    model = make_model(step)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    _arm(rank, crash)
    manager = dcp_ext.CheckpointManager(root)
    handle = manager.save(
        f"step{step}", model, user_content={"step": step}, num_kept_partial_checkpoints=KEEP,
        async_save=mode == "async",
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
    from tests.support.dist import run_world

    mode = sys.argv[4] if len(sys.argv) > 4 else "sync"
    run_world(2, job, sys.argv[1], int(sys.argv[2]), sys.argv[3], mode, timeout=120.0)
