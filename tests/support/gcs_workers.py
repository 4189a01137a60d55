"""Rank and process code of the GCS end-to-end tests (tests/test_store_gcs.py), and their checks.

Importable by name, as spawned ranks need. Models are those of the
resharding tests (:mod:`tests.support.reshard_workers`): ``big`` is four
512 x 512 layers, 12 MiB with Adam's state, so with 256 KiB parts every data
file is a parallel composite upload.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import dcp_ext
from dcp_ext import CheckpointManager, CheckpointReader, CheckpointWriter, KeepLast
from dcp_ext.errors import (
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointNotFoundError,
    NotACheckpointError,
    unwrap_checkpoint_exception,
)
from dcp_ext.storage import GCSOptions, Location
from tests.support.compare import assert_same_state, state_diff
from tests.support.reshard_workers import big, build, full_state, train

#: Seconds from killing the server to the save's error, at most. Measured 3.7-5.0 s with the default
#: retry policy (6 attempts, backoff ceilings 0.1-1.6 s): the parts in flight, then the abort's listing.
KILL_BOUND_SECONDS = 15.0


def _fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = big(seed)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train("plain", model, optim, steps=1, width=512)  # optimizer state exists, values differ
    return model, optim


# -- one 2-rank world --------------------------------------------------------------------------


def sharded_world(rank: int, world_size: int, root: Location) -> dict[str, Any]:
    """FSDP2 + Adam: a plain DCP save through dcp_ext's writer, then three
    manager saves keeping the last two. Rank 0 returns the full states."""
    model = build("fsdp2", 0, big(0))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train("fsdp2", model, optim, steps=1, width=512)
    msd, osd = get_state_dict(model, optim)
    dcp_save({"model": msd, "optimizer": osd}, storage_writer=CheckpointWriter(root.child("sharded")))
    sharded = copy.deepcopy(full_state(model, optim))  # Adam's `step` tensors change in place later
    # By URL and storage_options: the manager's partial saves open their
    # stores from those, without a Location's backend options (see the report of issue 42).
    manager = CheckpointManager(root.child("managed").url, storage_options=_storage_options(root),
                                retention=KeepLast(2))
    for step in (1, 2, 3):
        train("fsdp2", model, optim, steps=1, width=512)
        manager.save(f"t{step}", model, optim, user_content={"step": step})
    tags = manager.tags()
    managed = full_state(model, optim)
    return {"sharded": sharded, "managed": managed, "tags": tags} if rank == 0 else {}


def _storage_options(root: Location) -> dict[str, Any]:
    options: GCSOptions = root.options
    return {"endpoint_url": options.endpoint, "token": "anon"}


def check_one_rank_loads(root: Location, full: dict[str, Any]) -> None:
    """(the test process: 1 rank) Load both checkpoints of :func:`sharded_world`, bit-exact."""
    assert not dist.is_initialized()
    assert full["tags"] == ["t2", "t3"], full["tags"]  # KeepLast(2) removed t1
    model, optim = _fresh(7)
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optimizer": osd}
    dcp_load(state, storage_reader=CheckpointReader(root.child("sharded")))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    assert_same_state(full["sharded"], full_state(model, optim))
    model, optim = _fresh(8)
    storage_options = _storage_options(root)
    url = root.child("managed").url
    result = CheckpointManager(url, storage_options=storage_options).resume(model, optim)
    assert (result.tag, result.user_content) == ("t3", {"step": 3})
    assert_same_state(full["managed"], full_state(model, optim))
    store = root.child("managed").open()
    assert "t1_partial" not in store.list_dirs() and {"t2_partial", "t3_partial"} <= set(store.list_dirs())
    # The SMP-style functions on the same root.
    dcp_ext.save_checkpoint(url, "t4", model, optim, storage_options=storage_options, num_kept_partial_checkpoints=2)
    again, again_optim = _fresh(9)
    assert dcp_ext.resume_from_checkpoint(url, again, again_optim, storage_options=storage_options).tag == "t4"
    assert_same_state(full_state(model, optim), full_state(again, again_optim))
    assert CheckpointManager(url, storage_options=storage_options).tags() == ["t3", "t4"]


# -- two processes racing ----------------------------------------------------------------------

ROUNDS = 3


def race(root: str, options: dict[str, Any], seed: int, barrier: Any, results: Any) -> None:
    """(a process of its own, no process group) Save tags ``race0..`` as the
    other process does, each at the same moment; report who won each."""
    model = big(seed)
    outcome = []
    for round_ in range(ROUNDS):
        barrier.wait()
        try:
            CheckpointManager(root, storage_options=options).save(f"race{round_}", model)
            outcome.append("won")
        except (CheckpointExistsError, CheckpointInProgressError) as err:
            outcome.append(type(err).__name__)
    results.put((seed, outcome))


def check_race(root: str, options: dict[str, Any], outcomes: dict[int, list[str]]) -> None:
    """Each round exactly one process won and the other was refused; the
    checkpoint holds the winner's model."""
    for round_ in range(ROUNDS):
        seen = {seed: outcome[round_] for seed, outcome in outcomes.items()}
        winners = [seed for seed, what in seen.items() if what == "won"]
        assert len(winners) == 1, f"round {round_}: {seen}"
        (loser,) = [what for what in seen.values() if what != "won"]
        assert loser in ("CheckpointExistsError", "CheckpointInProgressError"), seen
        model = big(99)
        CheckpointManager(root, storage_options=options).resume(model, tag=f"race{round_}")
        assert state_diff(big(winners[0]).state_dict(), model.state_dict()) == [], round_


# -- the server killed mid-upload --------------------------------------------------------------


def save_while_killed(url: str, proxy: Any, server: Any) -> dict[str, Any]:
    """Save (this process, 1 rank) through ``proxy``; kill ``server`` once
    the third part is on its way (two are stored). Returns the error, and seconds from the kill to it."""
    location = Location(url, options=GCSOptions(endpoint=proxy.endpoint_url, anonymous=True,
                                                part_size=256 << 10, max_concurrency=2))
    model = big(3)
    killed: list[float] = []

    def kill_after_two_parts() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sum("uploadType=media" in e.path for e in list(proxy.log)) >= 3:  # two stored, one in flight
                server.kill()
                killed.append(time.monotonic())
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_after_two_parts, daemon=True)
    killer.start()
    error: BaseException | None = None
    try:
        dcp_save({"model": model.state_dict()}, storage_writer=CheckpointWriter(location))
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        error = unwrap_checkpoint_exception(err)
    ended = time.monotonic()
    killer.join(timeout=5)
    assert killed, "the server was not killed: the save finished before two parts were stored"
    return {"error": error, "seconds_after_kill": ended - killed[0], "url": url,
            "message": f"{type(error).__name__}: {error}"}


def check_nothing_committed(url: str, server: Any) -> None:
    """(a server restarted on the killed one's files) No metadata, no data file,
    and a load says there is no checkpoint."""
    bucket, _, prefix = url[len("gs://"):].partition("/")
    names = server.names(bucket, prefix + "/")
    assert not any(n.endswith(("dcp_ext.metadata.json", "/.metadata", ".distcp")) for n in names), names
    options = server.storage_options()
    try:
        dcp_ext.load({"model": big(4).state_dict()}, url, storage_options=options)
    except (CheckpointNotFoundError, NotACheckpointError):
        return
    raise AssertionError(f"{url} loaded after its save failed")
