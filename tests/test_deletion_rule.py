"""The root's one rule (dcp_ext/root.py): nothing a committed checkpoint or a
save in flight refers to is deleted or rewritten, and cleanup touches only
what dcp_ext wrote. Each test is a finding of issue 32 that lost a checkpoint
before; the concurrent ones run real jobs and real ``dcp-ext`` commands in
other processes, on local disk and on SeaweedFS.

Those processes are forked from the suite's fork server (tests/support/forked.py:
each its own process, session and environment, running ``dcp_ext.cli.main``
or ``tests.support.root_jobs.main`` as ``python -m`` would) instead of fresh
interpreters, which would each spend 2-3 s of CPU importing torch; the
``python -m dcp_ext`` entry point itself is run by tests/test_cli.py and
tests/test_demo_and_readme.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dcp_ext
from dcp_ext.errors import CheckpointInUseError, ForeignCheckpointError
from dcp_ext.guard._liveness import this_process
from dcp_ext.guard._save_lock import _process_stat
from dcp_ext.layout import InvalidTagError
from dcp_ext.layout import RETIRED_FILE, strays_marker
from tests.support import forked
from tests.support.backends import Backend, backend_for
from tests.support.root_jobs import model_at

from tests.support.root_cli import REPO
from tests.support.root_cli import env as _env
from tests.support.root_cli import loads as _loads
from tests.support.root_cli import manager as _manager


def _cli(backend: Backend, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in another process (``tests.support.root_cli.run_cli``, forked)."""
    options = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    return forked.run("dcp_ext.cli:main", [*options, *args], env=_env(backend, **extra_env), cwd=REPO)


def _job(backend: Backend, root: str, tag: str, step: int, keep: int | None = None,
         **extra_env: str) -> forked.Forked:
    """``python -m tests.support.root_jobs ROOT OPTIONS TAG STEP [KEEP]``, forked."""
    argv = [root, json.dumps(backend.storage_options), tag, str(step)] + ([str(keep)] if keep else [])
    return forked.start("tests.support.root_jobs:main", argv, env=_env(backend, **extra_env), cwd=REPO, text=True)


class _PausedJob:
    """A save of ``tag`` in another process paused at ``point`` until :meth:`go`
    (``tests.support.root_cli.PausedJob``, forked)."""

    def __init__(self, backend: Backend, root: str, tag: str, step: int, gate: Path, keep: int | None = None,
                 point: str = "before_metadata") -> None:
        self.gate = gate
        self.proc = _job(backend, root, tag, step, keep, DCP_EXT_PAUSE_AT=point, DCP_EXT_PAUSE_FILE=str(gate))
        deadline = time.monotonic() + 120
        while not Path(f"{gate}.reached").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the job never reached {point}: {self.proc.communicate()}")
            time.sleep(0.05)

    def go(self) -> tuple[int, str]:
        self.gate.touch()
        _, err = self.proc.communicate(timeout=120)
        return int(self.proc.returncode or 0), err


def test_tag_reuse_never_rewrites_files_others_refer_to(tmp_path: Path) -> None:
    """Findings 1a and 1b: an overwrite of a tag a later incremental checkpoint
    refers to, and a save to the name of a retired tag, are refused before
    anything changes; both checkpoints still load bit-exact."""
    root = str(tmp_path / "root")
    manager = dcp_ext.CheckpointManager(root, incremental=True)
    for step in (1, 2, 3):
        manager.save(f"step{step}", model_at(step))
    assert manager.checkpoints.scan().referrers("step2") == ["step3"]
    model = model_at(0)
    manager.resume(model, tag="step1")
    with torch.no_grad():
        model[4].weight += 1
    with pytest.raises(CheckpointInUseError, match=r"step3.*refer to.*Nothing was changed") as err:
        manager.save("step2", model, overwrite=True)
    assert "step2_partial" in str(err.value)
    assert _loads(manager, "step3", 3) and _loads(manager, "step2", 2)
    assert manager.read_newest() == "step3"
    manager.save("step2b", model)  # the way out the message names: a new tag
    manager.close()

    # 1b: KeepLast(1) retires tag a (its files kept for b); a save to "a" needs no overwrite.
    root_b = str(tmp_path / "root_b")
    keep_one = dcp_ext.CheckpointManager(root_b, incremental=True, retention=dcp_ext.KeepLast(1))
    keep_one.save("a", model_at(1))
    keep_one.save("b", model_at(2))
    assert keep_one.tags() == ["b"] and keep_one.checkpoints.retired_tags() == ["a"]
    with pytest.raises(CheckpointInUseError, match=r"'a' again would break them"):
        keep_one.save("a", model_at(3))
    assert (Path(root_b) / "a_partial" / RETIRED_FILE).exists()
    assert _loads(keep_one, "b", 2)
    keep_one.close()


def test_cleanup_touches_only_what_dcp_ext_wrote(tmp_path: Path) -> None:
    """Finding 3: a checkpoint written by torch's FileSystemWriter as
    ROOT/init_partial (and a torch save that never finished) survive the
    manager's saves and retention; resume(tag="init") loads it; deleting it
    is refused."""
    root = tmp_path / "root"
    model = model_at(7)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(root / "init_partial")))
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(root / "crashed_partial")))
    (root / "crashed_partial" / ".metadata").unlink()  # a torch save that died before its commit
    torch_files = sorted(p.name for p in (root / "init_partial").iterdir())
    manager = dcp_ext.CheckpointManager(str(root), incremental=True, retention=dcp_ext.KeepLast(1))
    for step in (1, 2):
        manager.save(f"step{step}", model_at(step))
    assert sorted(p.name for p in (root / "init_partial").iterdir()) == torch_files
    assert sorted(p.name for p in (root / "crashed_partial").iterdir()) == ["__0_0.distcp"]
    assert manager.tags() == ["step2"]
    assert manager.checkpoints.is_torch_checkpoint("init")
    assert _loads(manager, "init", 7)
    with pytest.raises(ForeignCheckpointError, match="torch's own writer"):
        manager.delete("init")
    assert dcp_ext.CheckpointRoot(str(root)).remove_leftovers().uncommitted == ()
    listed = forked.run("dcp_ext.cli:main", ["ls", str(root), "--json"], cwd=REPO)
    states = {entry["tag"]: entry["state"] for entry in json.loads(listed.stdout)["checkpoints"]}
    assert states["init"] == "torch" and states["step2"] == "committed", listed.stdout
    assert (root / "init_partial" / ".metadata").exists() and (root / "crashed_partial" / "__0_0.distcp").exists()
    manager.close()


def test_tag_with_a_line_break_is_refused(tmp_path: Path) -> None:
    """Finding 10: ``"step1\\n"`` was accepted ($ matches before a trailing
    newline): ``step1\\n_partial`` was created and ``newest`` read back wrong."""
    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root))
    manager.save("step0", nn.Linear(4, 4))
    for bad in ("step1\n", "step1\r", "\nstep1"):
        with pytest.raises(InvalidTagError, match="invalid checkpoint tag"):
            manager.save(bad, nn.Linear(4, 4))
    assert sorted(p.name for p in root.iterdir()) == ["newest", "step0_partial"]
    assert (root / "newest").read_text() == "step0\n"
    manager.close()


def test_incremental_saves_go_on_past_a_garbage_newest(tmp_path: Path) -> None:
    """Finding 8: an empty or garbage ``newest`` (or one naming a tag that is
    gone) made every incremental save fail with InvalidTagError about a tag
    the user never passed; now the save warns, builds on the newest committed
    tag, and moves ``newest``."""
    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root), incremental=True)
    manager.save("step1", model_at(1))
    for garbage in (b"garbage!!\n", b"", b"step9\n"):
        (root / "newest").write_bytes(garbage)
        tag = f"g{len(garbage)}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager.save(tag, model_at(3))
        assert any("newest" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert manager.read_newest() == tag and _loads(manager, tag, 3)
    # It built on a committed tag: the last save refers to earlier files.
    assert manager.checkpoints.scan().referrers("step1") != []
    manager.close()


def test_failed_save_is_cleaned_up_by_the_next_one(tmp_path: Path) -> None:
    """A save that fails while another rank's file is in its directory (a rank
    that died) leaves the lock there, released, as dcp_ext's mark, so the
    next save's cleanup removes the directory; a directory without the mark
    stays whatever it holds."""
    from dcp_ext.dcp_io import run_save

    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root))
    manager.save("ok", nn.Linear(4, 4))
    failed = root / "failed_partial"
    failed.mkdir()
    (failed / "model_rank1.distcp").write_bytes(b"a rank that died")

    def fail(store: object) -> None:
        raise RuntimeError("injected before the commit")

    writer = dcp_ext.CheckpointWriter(str(failed), before_commit=fail)
    with pytest.raises(RuntimeError, match="injected before the commit"):
        run_save({"w": torch.ones(4)}, writer, None, None)
    assert sorted(p.name for p in failed.iterdir()) == [".dcp_ext.saving", "model_rank1.distcp"]
    assert json.loads((failed / ".dcp_ext.saving").read_text())["released"] is True
    foreign = root / "foreign_partial"
    foreign.mkdir()
    (foreign / "data.distcp").write_bytes(b"someone else's")
    # A deleter killed while linking its lock into place in a committed directory.
    me = this_process()  # the lock rule judges records of this host, boot and PID namespace by their process
    dead = {"save_id": "d", "started": time.time(), "host": socket.gethostname(), "pid": 1, "pid_start": 0,
            "boot_id": me.boot_id, "pid_ns": me.pid_ns}
    (root / "ok_partial" / ".dcp_ext.saving.dcp_ext-tmp-0123456789ab").write_text(json.dumps(dead))
    # A save killed between writing its lock record and linking it into place
    # (bench.torture --incremental, 2026-11-27: this directory stayed for the
    # rest of the run); and one that is doing so now, in this process.
    killed = root / "killed_partial"
    killed.mkdir()
    (killed / ".dcp_ext.saving.dcp_ext-tmp-0123456789ab").write_text(json.dumps(dead))
    racing = root / "racing_partial"
    racing.mkdir()
    other = subprocess.Popen(["sleep", "120"])  # another process on this host, alive
    alive = {**dead, "pid": other.pid, "pid_start": _process_stat(other.pid)[1]}
    (racing / ".dcp_ext.saving.dcp_ext-tmp-0123456789ab").write_text(json.dumps(alive))
    try:
        manager.save("ok2", nn.Linear(4, 4))
    finally:
        other.kill()
        other.wait()
    assert not failed.exists() and (foreign / "data.distcp").exists()
    assert not killed.exists() and (racing / ".dcp_ext.saving.dcp_ext-tmp-0123456789ab").exists()
    assert sorted(p.name for p in (root / "ok_partial").iterdir() if p.name.startswith(".")) == [".metadata"]
    manager.close()


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_compact_and_prune_while_a_save_builds_on_the_tag(kind: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """Finding 2a, with a real ``dcp-ext compact`` (and ``prune``) in another
    process while a save whose base is step2 waits before its commit: compact
    is refused, prune deletes only what nothing needs, the save commits and
    every tag loads; compact succeeds once the save is done."""
    backend = backend_for(kind, request, tmp_path)
    root = backend.url("root")
    manager = _manager(backend, root)
    manager.save("step1", model_at(1))
    manager.save("step2", model_at(2))
    job = _PausedJob(backend, root, "step3", 3, tmp_path / "go")
    refused = _cli(backend, "compact", root, "step2")
    assert refused.returncode == 2, refused
    assert refused.stderr.startswith("dcp-ext: error:") and "builds on it" in refused.stderr, refused.stderr
    pruned = _cli(backend, "prune", root, "--keep", "1")
    assert pruned.returncode == 0, pruned
    code, err = job.go()
    assert code == 0, err
    assert manager.read_newest() == "step3"
    assert _loads(manager, "step3", 3) and _loads(manager, "step2", 2)
    done = _cli(backend, "compact", root, "step2")
    assert done.returncode == 0 and "rewrote" in done.stdout, done
    assert _loads(manager, "step3", 3) and _loads(manager, "step2", 2)

    manager.close()


def test_killed_compaction_is_swept_by_the_next_save(tmp_path: Path) -> None:
    """Finding 9: ``dcp-ext compact`` killed after writing its new file left
    ``model_rank0-c<stamp>.distcp`` in the committed tag for ever; now the
    root marks the tag before the new files are written, and the next save
    removes them (and the mark); the tag loads throughout."""
    backend = Backend("local", str(tmp_path))
    root = str(tmp_path / "root")
    manager = _manager(backend, root)
    for step in (1, 2, 3):
        manager.save(f"step{step}", model_at(step))
    killed = forked.run("dcp_ext.cli:main", ["compact", root, "step3"], cwd=REPO,
                        env=_env(backend, DCP_EXT_CRASH_AT="mid_compact"))
    assert killed.returncode == -9, killed
    directory = Path(root) / "step3_partial"
    assert [p.name for p in directory.glob("*-c*.distcp")] and (Path(root) / strays_marker("step3")).exists()
    assert _loads(manager, "step3", 3)
    manager.save("step4", model_at(4))
    assert not list(directory.glob("*-c*.distcp")) and not (Path(root) / strays_marker("step3")).exists()
    assert _loads(manager, "step3", 3) and _loads(manager, "step4", 4)
    manager.close()


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_two_jobs_on_one_root_with_keep_last_one(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Finding 2b: job A's incremental save (base a0) waits before its commit
    while job B saves b1 with KeepLast(1); B's retention leaves a0 (A builds
    on it); A then commits, its own KeepLast(1) removes the rest, and
    ``newest`` (a1) loads bit-exact."""
    backend = backend_for(kind, request, tmp_path)
    root = backend.url("root")
    manager = _manager(backend, root)
    manager.save("a0", model_at(1))
    job_a = _PausedJob(backend, root, "a1", 2, tmp_path / "go", keep=1)
    job_b = _job(backend, root, "b1", 5, 1)
    _, job_b_err = job_b.communicate(timeout=120)
    assert job_b.returncode == 0, job_b_err
    assert manager.read_newest() == "b1" and "a0" in manager.tags()
    code, err = job_a.go()
    assert code == 0, err
    assert manager.read_newest() == "a1" and manager.tags() == ["a1"]
    assert _loads(manager, "a1", 2)
    manager.close()
