"""Code that runs on each rank of the spawned worlds in test_async_staging.py.

The test runs both suites in one world (:func:`thread_and_process_suites`):
background-staged saves with
the state mutated right after ``staging_completion``, through the manager and
through stock ``dcp.async_save``; buffer reuse over many saves; an upload
failure on one rank; process-based uploads.
"""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter, KeepLast, Stager
from tests.support.compare import assert_same_state
from tests.support.dist_workers import app_state, load_into_fresh, local_leaves, make_fsdp


def _snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's values of the whole state, as private copies."""
    return local_leaves(app_state(model, optim))


def _train_on(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """Change every tensor of the state in place, as the next training step would."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.add_(1.0)


def _resume(manager: dcp_ext.CheckpointManager, tag: str, world_size: int) -> dict[str, Any]:
    """Resume ``tag`` into a differently initialized FSDP2 model and Adam; their leaves."""
    model, optim = make_fsdp(world_size, seed=99)
    manager.resume(model, optim, tag=tag)
    return local_leaves(app_state(model, optim))


def thread_suite(rank: int, world_size: int, root: str, s3_root: str,
                 s3_options: list[dict[str, Any]]) -> dict[str, Any]:
    """Manager and stock async saves with background staging (uploads in a thread)."""
    report: dict[str, Any] = {}
    model, optim = make_fsdp(world_size, seed=3)

    # 1. Manager: mutate every tensor right after staging; the checkpoint holds the old values.
    manager = dcp_ext.CheckpointManager(root)
    handle = manager.save("a1", model, optim, async_save=True)
    assert isinstance(handle, dcp_ext.AsyncSaveHandle) and handle.upload_completion is handle
    handle.staging_completion.result()
    expected = _snapshot(model, optim)
    _train_on(model, optim)
    assert handle.result() is None
    assert manager.read_newest() == "a1"
    assert_same_state(expected, _resume(manager, "a1", world_size), "manager async save")
    report["first_allocated"] = manager.stager.last_stats.allocated_bytes
    report["buffer_bytes"] = manager.stager.buffer_bytes

    # 2. Stock dcp.async_save with dcp_ext's Stager: DCP's AsyncSaveResponse.
    with Stager() as stager:
        state = app_state(model, optim)
        response = dcp.async_save(state, storage_writer=CheckpointWriter(f"{root}/stock"), async_stager=stager)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result()
        expected = _snapshot(model, optim)
        _train_on(model, optim)
        response.upload_completion.result()
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=CheckpointReader(f"{root}/stock")))
    assert_same_state(expected, got, "stock dcp.async_save with Stager")

    # 3. Stock dcp.async_save with no stager: the writer's own blocking copy.
    future = dcp.async_save(app_state(model, optim), storage_writer=CheckpointWriter(f"{root}/plain"))
    expected = _snapshot(model, optim)
    _train_on(model, optim)
    future.result()
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=CheckpointReader(f"{root}/plain")))
    assert_same_state(expected, got, "stock dcp.async_save without stager")

    # 4. Twenty saves in a row: buffers allocated once, memory flat, retention applied.
    process = psutil.Process()
    allocated, rss = [], []
    for step in range(20):
        handle = manager.save(f"r{step}", model, optim, async_save=True, retention=KeepLast(2))
        handle.staging_completion.result()
        allocated.append(manager.stager.last_stats.allocated_bytes)
        _train_on(model, optim)
        handle.result()
        rss.append(process.memory_info().rss)
    assert allocated == [0] * 20, allocated  # the buffers of save a1, reused
    assert manager.tags() == ["r18", "r19"], manager.tags()
    report["rss_growth_5_to_20"] = rss[-1] - rss[4]
    report["buffer_bytes_after"] = manager.stager.buffer_bytes
    manager.close()
    assert manager.stager is None

    # 5. S3, rank 1's endpoint fails every upload: both handles fail with the
    #    same error, newest stays on the good save, which still loads.
    good = dcp_ext.CheckpointManager(s3_root, storage_options=s3_options[0])
    good.save("good", model, optim)
    expected = _snapshot(model, optim)
    _train_on(model, optim)
    from dcp_ext import IOConfig, RetryPolicy

    # SlowDown is throttling: paced retries, PACED_ATTEMPTS_FACTOR (4) x
    # max_attempts of them, down to 1 request/s. One attempt allowed is 4
    # paced attempts (~2 s); 2 were 8 (~5 s of waiting out the pacing).
    config = IOConfig(retry=RetryPolicy(max_attempts=1, base_delay=0.01, max_delay=0.02))
    bad = dcp_ext.CheckpointManager(s3_root, storage_options=s3_options[rank], config=config)
    handle = bad.save("bad", model, optim, async_save=True)
    handle.staging_completion.result()
    try:
        handle.result(timeout=60)
    except Exception as err:  # noqa: BLE001 - reported to the test
        report["failure"] = (type(err).__name__, str(err).splitlines()[0])
    bad.close()
    assert good.read_newest() == "good"
    assert_same_state(expected, _resume(good, "good", world_size), "good S3 save after a failed one")
    return report


def process_suite(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Uploads in DCP's checkpoint process: the manager's and stock ``dcp.async_save``'s."""
    # DCP's checkpoint process finds its peers through MASTER_ADDR (this
    # world rendezvouses through a file and sets none).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    model, optim = make_fsdp(world_size, seed=5)
    report: dict[str, Any] = {}
    with dcp_ext.CheckpointManager(root, async_uploads="process", retention=KeepLast(1)) as manager:
        for tag in ("p1", "p2"):
            handle = manager.save(tag, model, optim, user_content={"tag": tag}, async_save=True)
            handle.staging_completion.result()
            expected = _snapshot(model, optim)
            _train_on(model, optim)
            handle.result(timeout=120)
            assert manager.read_newest() == tag and manager.tags() == [tag]  # newest + retention ran
            assert_same_state(expected, _resume(manager, tag, world_size), f"process upload {tag}")
        report["shared"] = all(b.is_shared() for b in manager.stager._buffers._by_path.values())
    future = dcp.async_save(app_state(model, optim), storage_writer=CheckpointWriter(f"{root}/stock"),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    expected = _snapshot(model, optim)
    _train_on(model, optim)
    future.result(timeout=120)
    got = load_into_fresh(world_size, lambda sd: dcp.load(sd, storage_reader=CheckpointReader(f"{root}/stock")))
    assert_same_state(expected, got, "stock process-based dcp.async_save")
    report["user_content"] = dcp_ext.CheckpointManager(root).resume(make_fsdp(world_size, 7)[0]).user_content
    return report


def thread_and_process_suites(rank: int, world_size: int, root: str, s3_root: str,
                              s3_options: list[dict[str, Any]], process_root: str) -> dict[str, Any]:
    """:func:`thread_suite`, then :func:`process_suite`, in one world (spawning one costs seconds)."""
    return {"thread": thread_suite(rank, world_size, root, s3_root, s3_options),
            "process": process_suite(rank, world_size, process_root)}
