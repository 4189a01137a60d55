"""Concurrent jobs: two saves of one tag, and a reader racing a pruning writer."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dcp_ext
from tests.support import dist


def _filled(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


@pytest.mark.parametrize("kind", ["local", "moto", "seaweedfs"])
def test_second_save_of_a_tag_in_progress_fails_cleanly(kind: str, make_backend) -> None:
    """Job B starts saving the same checkpoint while job A is between its data
    and its metadata: B fails with CheckpointInProgressError before writing a
    byte, A commits, and the checkpoint is A's, bit for bit."""
    backend = make_backend(kind)
    url, options = backend.url("same"), backend.storage_options
    state_a = {"w": torch.full((64, 64), 1.0)}
    state_b = {"w": torch.full((64, 64), 2.0)}
    seen: list[BaseException] = []

    def job_b_arrives(store) -> None:  # runs inside A's save, just before A commits
        try:
            dcp_ext.save(state_b, url, storage_options=options)
        except BaseException as err:  # noqa: BLE001
            seen.append(err)

    dcp_ext.save(state_a, url, storage_options=options, before_commit=job_b_arrives)
    assert len(seen) == 1 and isinstance(seen[0], dcp_ext.CheckpointInProgressError), seen
    assert isinstance(seen[0], FileExistsError)
    assert "another save to" in str(seen[0]) and "in progress" in str(seen[0])
    out = {"w": torch.zeros(64, 64)}
    dcp_ext.load(out, url, storage_options=options)
    assert torch.equal(out["w"], state_a["w"])
    assert dcp_ext.verify(url, storage_options=options).ok
    # The lock is gone; a later save of the same path is refused as usual.
    with pytest.raises(dcp_ext.CheckpointExistsError):
        dcp_ext.save(state_b, url, storage_options=options)


def _save_job(root: str, value: float, results: Any) -> None:
    """(a job process of its own) Save tag ``t`` of a 24 MiB model filled with ``value``."""
    import traceback

    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(6)])
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        try:
            dcp_ext.CheckpointManager(root).save("t", model, user_content={"value": value})
            results.put((value, "SAVED"))
        except (dcp_ext.CheckpointInProgressError, dcp_ext.CheckpointExistsError) as err:
            results.put((value, f"REFUSED {type(err).__name__}"))
    except BaseException:
        results.put((value, traceback.format_exc()[-300:]))


def test_two_processes_saving_one_tag(tmp_path: Path) -> None:
    """Two real jobs (processes) race to save tag ``t`` (24 MiB each): one wins, the other
    is refused with a clear error, and ``t`` is exactly the winner's."""
    root = str(tmp_path / "root")
    # The suite's context: processes forked from a server that imported torch once.
    outcome, exitcodes = dist.run_processes(dist.context(), _save_job, [(root, 1.0), (root, 2.0)], timeout=120)
    assert exitcodes == [0, 0], outcome
    lines = [outcome[1.0], outcome[2.0]]
    assert sorted(line.split()[0] for line in lines) == ["REFUSED", "SAVED"], lines
    winner = 1.0 if lines[0] == "SAVED" else 2.0
    model = _filled(0.0)
    probe = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
    result = dcp_ext.resume_from_checkpoint(root, probe)
    assert result.user_content == {"value": winner}
    assert all(bool((p == winner).all()) for p in probe.parameters())
    del model


def test_reader_racing_a_pruning_writer_gets_whole_checkpoints(tmp_path: Path) -> None:
    """A writer saves tags s1..s12 keeping only the newest while a reader keeps
    resuming ``newest``: every load is one whole checkpoint (all weights equal
    to one tag's value, matching its user_content), none fails."""
    root = tmp_path / "root"
    dcp_ext.CheckpointManager(root).save("s0", _filled(0.0), user_content={"value": 0})
    errors: list[BaseException] = []
    loads: list[int] = []
    done = threading.Event()

    def writer() -> None:
        manager = dcp_ext.CheckpointManager(root)
        try:
            for i in range(1, 13):
                manager.save(f"s{i}", _filled(float(i)), user_content={"value": i},
                             num_kept_partial_checkpoints=1)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
        finally:
            done.set()

    def reader() -> None:
        manager = dcp_ext.CheckpointManager(root)
        while not done.is_set() or len(loads) < 3:
            probe = _filled(-1.0)
            try:
                result = manager.resume(probe)
            except BaseException as err:  # noqa: BLE001
                errors.append(err)
                return
            value = result.user_content["value"]
            if not all(bool((p == value).all()) for p in probe.parameters()):
                errors.append(AssertionError(f"mixed checkpoint: user_content {value}"))
                return
            loads.append(value)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == [], errors
    assert len(loads) >= 3 and loads == sorted(loads), loads
    assert dcp_ext.CheckpointManager(root).tags() == ["s12"]


def test_abandoned_locks_are_taken_over(tmp_path: Path) -> None:
    """A lock left by a process that died (this host), or older than an hour,
    does not block a save; a fresh lock from another host does."""
    import json
    import socket
    import time

    from dcp_ext.guard import this_process

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    state = {"w": torch.ones(4)}
    me = this_process()  # a record of this host, boot and PID namespace: judged by its process
    cases = [
        ({"save_id": "x", "started": time.time(), "host": socket.gethostname(), "pid": int(dead.stdout),
          "boot_id": me.boot_id, "pid_ns": me.pid_ns}, True),
        ({"save_id": "x", "started": time.time() - 7200, "host": "elsewhere", "pid": 1}, True),
        ({"save_id": "x", "started": time.time(), "host": "elsewhere", "pid": 1}, False),
    ]
    for n, (lock, takes_over) in enumerate(cases):
        path = tmp_path / f"c{n}"
        path.mkdir()
        (path / ".dcp_ext.saving").write_text(json.dumps(lock))
        if takes_over:
            dcp_ext.save(state, path)
            assert not (path / ".dcp_ext.saving").exists()
            out = {"w": torch.zeros(4)}
            dcp_ext.load(out, path)
            assert torch.equal(out["w"], state["w"])
        else:
            with pytest.raises(dcp_ext.CheckpointInProgressError, match="by pid 1 on elsewhere"):
                dcp_ext.save(state, path)
            assert sorted(p.name for p in path.iterdir()) == [".dcp_ext.saving"]
