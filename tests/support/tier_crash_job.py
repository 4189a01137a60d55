"""A 2-rank, 2-node tiered training job that first resumes, then saves one checkpoint.

``python -m tests.support.tier_crash_job ROOT LOCAL_BASE STEP CRASH [incremental]``
(from the repository root): each rank is its own node (``DCP_EXT_NODE_RANK`` =
rank, local tier ``LOCAL_BASE/node{rank}``); the manager keeps 2 tags per
local tier, replicates to the partner node and drains every save to ROOT.
The job first resumes the newest readable tag (if any) into a model with
other weights and prints ``RESUMED {tag} {exact}`` (rank 0; ``exact``: every
tensor equals the weights of that step), then, unless STEP is 0, saves
``step{STEP}`` with CRASH armed (see tests/support/crash_job.py) and waits
for its drain. With ``incremental``: an incremental manager (full local
copies, drains that write only the changed frames) keeping 2 tags in the
root and every tag in the local tiers (so that the crash point
``mid_retention`` is reached in the root's retention only), and the partly
frozen model of ``make_model(step, incremental=True)``.
"""

from __future__ import annotations

import os
import sys

from tests.support.crash_job import _arm, make_model


def job(rank: int, world_size: int, root: str, local_base: str, step: int, crash: str,
        incremental: bool = False) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dcp_ext

    os.environ[dcp_ext._runtime.nodes.NODE_RANK_ENV] = str(rank)
    mesh = init_device_mesh("cpu", (world_size,))
    manager = dcp_ext.CheckpointManager(root, local_tier=os.path.join(local_base, f"node{rank}"),
                                        persist_every=1, keep_local=None if incremental else 2, replicas=1,
                                        incremental=incremental,
                                        retention=dcp_ext.KeepLast(2) if incremental else None)
    probe = make_model(10_000 + step, incremental)
    fully_shard(probe, mesh=mesh)
    try:
        result = manager.resume(probe)
    except dcp_ext.CheckpointNotFoundError:
        result = None
    if result is not None:
        expected = make_model(int(result.tag.removeprefix("step")), incremental).state_dict()
        exact = all(torch.equal(v.full_tensor(), expected[k]) for k, v in probe.state_dict().items())
        exact = exact and result.user_content == {"step": int(result.tag.removeprefix("step"))}
        if rank == 0:
            print(f"RESUMED {result.tag} {exact}", flush=True)
    if step == 0:
        manager.close()
        return
    model = make_model(step, incremental)
    fully_shard(model, mesh=mesh)
    _arm(rank, crash)
    manager.save(f"step{step}", model, user_content={"step": step})
    manager.wait_for_persist()
    manager.close()


def main(argv: list[str], start_method: str = "forkserver") -> None:
    """Run the job: ``argv`` as on the command line (ROOT LOCAL_BASE STEP CRASH [incremental])."""
    from tests.support import dist
    from tests.support.dist import run_world

    dist.START_METHOD = start_method
    run_world(2, job, argv[0], argv[1], int(argv[2]), argv[3], argv[4:] == ["incremental"], timeout=120.0)


def forked_main(argv: list[str]) -> None:
    """:func:`main` in a process forked from the test's fork server
    (tests/support/forked.py): torch is imported already, so the ranks fork
    from this process itself, in its process group."""
    main(argv, start_method="fork")


if __name__ == "__main__":
    # Both ranks fork from one process that imported torch once (dist.py), not
    # two fresh interpreters each importing it: on 2 busy cores that is about a
    # second of CPU per job. That process is this job's child, in its process
    # group, so a kill of "all" (killpg) still takes the job and both ranks.
    main(sys.argv[1:])
