"""The one liveness rule for save locks and leases (issue 40, findings 3, 7, 8, 9;
the heartbeat rule of issue 41): records dated in the future, damaged
records, pids that cannot be, other PID namespaces, heartbeats that stop,
and every refusal naming the file, its holder and how to clear it.

Real processes and real ``dcp-ext`` commands, some in a PID namespace of
their own (``unshare -p``, root only: skipped elsewhere, never under CI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import dcp_ext
from dcp_ext import IOConfig
from dcp_ext.errors import CheckpointInProgressError, CheckpointInUseError
from dcp_ext.guard import LOCK_FILE, LockRecord, SaveLock, lock_state, renewals
from dcp_ext.guard._leases import LEASE_PREFIX, LEASE_SUFFIX
from dcp_ext.storage import open_store
from tests.support.backends import backend_for
from tests.support.root_cli import NamespaceCli, PausedJob, env, loads, manager, run_cli
from tests.support.root_jobs import model_at

TEN_YEARS = 315_360_000.0

# Polls the save lock of the directory argv[1] every 0.05 s, one JSON line per
# verdict change (the first line at once), until it is dead or 60 s passed.
_WATCH = """
import json, sys, time
from dcp_ext.guard import lock_state
from dcp_ext.storage import open_store
from dcp_ext import IOConfig
store, last, end = open_store(sys.argv[1], IOConfig(), {}), None, time.monotonic() + 60
while time.monotonic() < end:
    state = lock_state(store)
    live = state is not None and state.live
    if live != last:
        print(json.dumps({"t": time.monotonic(), "live": live, "reason": state and state.reason}), flush=True)
        last = live
    if not live:
        break
    time.sleep(0.05)
"""


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    if os.geteuid() != 0:
        return "a new PID namespace needs root"
    return None


def _need_unshare() -> None:
    reason = _can_unshare()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the PID-namespace checks must run in CI: {reason}")
        pytest.skip(reason)


def _other_host(save_id: str, *, started: float, heartbeat: float | None, base: str | None = None,
                tag: str | None = None, pid: Any = 4242) -> bytes:
    doc: dict[str, Any] = {"save_id": save_id, "started": started, "host": "trainer-7.example", "pid": pid,
                           "boot_id": "0" * 32, "pid_ns": 4026531836}
    if heartbeat is not None:
        doc.update(heartbeat=heartbeat, timeout=60.0)
    if base is not None:
        doc.update(base=base, tag=tag or "step9")
    return json.dumps(doc).encode()


def _root_with_two(tmp_path: Path) -> tuple[dcp_ext.CheckpointManager, Path]:
    root = tmp_path / "root"
    saver = dcp_ext.CheckpointManager(str(root))
    saver.save("step1", model_at(1))
    saver.save("step2", model_at(2))
    return saver, root


def test_future_dated_leases_do_not_pin_forever(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Finding 3: a lease of another host dated ten years ahead, with and
    without heartbeats, pins its base only while its file is fresh (the
    storage's clock), and the refusal names the file, the holder and the way
    out; a garbage lease whose file time lies in the future is judged
    abandoned, so retention goes on (``dcp-ext prune`` exits 0)."""
    saver, root = _root_with_two(tmp_path)
    backend = backend_for("local", request, tmp_path)
    for heartbeat in (None, time.time() + TEN_YEARS):
        lease = root / f"{LEASE_PREFIX}skewed{LEASE_SUFFIX}"
        lease.write_bytes(_other_host("skewed", started=time.time() + TEN_YEARS, heartbeat=heartbeat, base="step1"))
        with pytest.raises(CheckpointInUseError) as refused:
            saver.checkpoints.delete("step1")
        message = str(refused.value)
        assert str(lease) in message and "pid 4242 on trainer-7.example" in message, message
        assert "counts as dead" in message and "dcp-ext locks ROOT --break" in message, message
        pruned = run_cli(backend, "prune", str(root), "--keep", "1")
        assert pruned.returncode == 3 and "kept step1 for now" in pruned.stdout, pruned
        assert str(lease) in pruned.stdout
        # The file has not changed for longer than the timeout: dead, whatever its record says.
        old = time.time() - 4000
        os.utime(lease, (old, old))
        listed = run_cli(backend, "locks", str(root))
        assert f"{lease.name}  lease  dead" in listed.stdout, listed
        broken = run_cli(backend, "locks", str(root), "--break", lease.name)
        assert broken.returncode == 0 and not lease.exists(), broken
        assert (root / "step1_partial").exists()
    garbage = root / f"{LEASE_PREFIX}garbage{LEASE_SUFFIX}"
    garbage.write_bytes(b"\x00not json")
    future = time.time() + TEN_YEARS
    os.utime(garbage, (future, future))
    pruned = run_cli(backend, "prune", str(root), "--keep", "1")
    assert pruned.returncode == 0 and "deleted step1" in pruned.stdout, pruned
    assert loads(saver, "step2", 2)
    # A garbage lease written just now pins every tag, for the heartbeat timeout, and says so.
    saver.save("step3", model_at(3))
    garbage.write_bytes(b"{}")
    pruned = run_cli(backend, "prune", str(root), "--keep", "1")
    assert pruned.returncode == 3 and "kept step2 for now" in pruned.stdout and str(garbage) in pruned.stdout, pruned
    assert "cannot be read" in pruned.stdout
    saver.close()


def test_records_with_impossible_fields_are_damaged_not_crashes(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Finding 7: a lock and a lease naming this host with ``pid = 2**70``
    (and other fields that cannot be) are damaged records, judged by their
    file time: saves (``overwrite=True`` too), ``prune`` and ``compact``
    answer with typed refusals or go on, never an ``OverflowError``."""
    backend = backend_for("local", request, tmp_path)
    me = json.loads(LockRecord.mine("x").to_json())
    for bad in ({"pid": 2**70}, {"pid": -1}, {"started": 1e300}, {"host": "a b\n"}, {"pid_ns": "x"},
                {"timeout": -5}, {"heartbeat": float("nan")}):
        assert LockRecord.from_json(json.dumps({**me, **bad}).encode()) is None, bad
    root = tmp_path / "root"
    saver = dcp_ext.CheckpointManager(str(root), incremental=True)
    saver.save("step1", model_at(1))
    lock = root / "step1_partial" / LOCK_FILE
    lock.write_bytes(json.dumps({**me, "pid": 2**70}).encode())
    with pytest.raises(CheckpointInProgressError) as refused:
        saver.save("step1", model_at(1), overwrite=True)
    assert str(lock) in str(refused.value) and "damaged record" in str(refused.value)
    lease = root / f"{LEASE_PREFIX}huge{LEASE_SUFFIX}"
    lease.write_bytes(json.dumps({**me, "pid": 2**70, "base": "step1", "tag": "step2"}).encode())
    saver.save("step2", model_at(2))  # a new tag: neither record stands in its way
    for command in (("prune", str(root), "--keep", "1"), ("compact", str(root), "step2"), ("locks", str(root))):
        done = run_cli(backend, *command)
        assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr, done
        assert done.returncode in (0, 2, 3), done
    old = time.time() - 4000
    for path in (lock, lease):
        os.utime(path, (old, old))
    saver.save("step1", model_at(1), overwrite=True)  # damaged and old: taken over
    assert loads(saver, "step1", 1) and loads(saver, "step2", 2)
    saver.close()


def test_heartbeats_renew_and_stop(tmp_path: Path) -> None:
    """A held lock is renewed every interval (its file changes while the save
    waits), a record of another host is live until its heartbeat timeout and
    dead after it, and a save whose lock was taken over never commits."""
    config = IOConfig(heartbeat_interval=0.2, heartbeat_timeout=1.0)
    store = open_store(str(tmp_path / "ck"), config, {})
    store.ensure_root()
    lock = SaveLock(store, "renewed", config)
    lock.acquire()
    first = LockRecord.from_json(store.read_file(LOCK_FILE))
    time.sleep(0.9)
    later = LockRecord.from_json(store.read_file(LOCK_FILE))
    assert first is not None and later is not None and later.heartbeat > first.heartbeat + 0.3  # type: ignore[operator]
    assert any(r.store is store and r.renewed >= 2 for r in renewals())
    lock.release()
    assert not store.exists(LOCK_FILE) and not any(r.store is store for r in renewals())
    time.sleep(0.5)
    assert not store.exists(LOCK_FILE)  # no renewal brought it back
    store.write_file(LOCK_FILE, _other_host("far", started=time.time(), heartbeat=time.time()).replace(
        b'"timeout": 60.0', b'"timeout": 1.0'))
    state = lock_state(store, config=config)
    assert state is not None and state.live and state.expires_in is not None and state.expires_in <= 1.0
    time.sleep(1.2)
    state = lock_state(store, config=config)
    assert state is not None and not state.live and "last heartbeat" in state.reason, state
    # Taken over while this save ran: it must not commit.
    store.delete(LOCK_FILE)

    def take_over(checkpoint: Any) -> None:
        checkpoint.write_file(LOCK_FILE, LockRecord.mine("thief", timeout=60.0).to_json())

    from dcp_ext.dcp_io import run_save

    path = tmp_path / "taken"
    writer = dcp_ext.CheckpointWriter(str(path), before_commit=take_over)
    with pytest.raises(CheckpointInProgressError, match="no longer held by this save"):
        run_save({"w": model_at(1)[0].weight.detach()}, writer, None, None)
    assert not (path / "dcp_ext.metadata.json").exists()


def test_other_pid_namespace_never_judges_a_live_save_dead(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Finding 9: ``dcp-ext prune`` and ``locks`` run in another PID namespace
    (``unshare -p``) while an incremental save based on step1 waits before
    its metadata: the save is live by its heartbeat, nothing of it is taken
    over, it commits, and every tag loads bit-exact. Once the save's
    process is killed, its lock dies by the heartbeat rule after the
    timeout there too, and ``dcp-ext locks --break`` removes it."""
    _need_unshare()
    backend = backend_for("local", request, tmp_path)
    root = str(tmp_path / "root")
    saver = manager(backend, root)
    saver.save("step0", model_at(0))
    saver.save("step1", model_at(1))
    fast = {"DCP_EXT_HEARTBEAT_INTERVAL": "0.3", "DCP_EXT_HEARTBEAT_TIMEOUT": "2"}
    job = PausedJob(backend, root, "step2", 2, tmp_path / "go", **fast)
    with NamespaceCli(backend) as namespace:  # dcp-ext, in a PID namespace of its own
        time.sleep(2.5)  # longer than the timeout: only renewals keep it live
        listed = namespace.run("locks", root)
        assert listed.returncode == 0 and "step2_partial/.dcp_ext.saving  lock  live" in listed.stdout, listed
        assert "lease  live" in listed.stdout, listed
        pruned = namespace.run("prune", root, "--keep", "1")
        assert "taking over" not in pruned.stderr and "deleted step0" in pruned.stdout, pruned
        assert (tmp_path / "root" / "step2_partial").exists()
        refused = namespace.run("locks", root, "--break", "step2_partial/.dcp_ext.saving")
        assert refused.returncode == 2 and "not breaking" in refused.stderr and "counts as dead" in refused.stderr, refused
        code, err = job.go()
        assert code == 0, err
        assert saver.read_newest() == "step2" and loads(saver, "step2", 2) and loads(saver, "step1", 1)
        # A save killed while paused: judged from another namespace by a watcher that polls its lock,
        # live until the heartbeat timeout after its last renewal, dead from then on.
        job = PausedJob(backend, root, "step3", 3, tmp_path / "go3", **fast)
        watcher = subprocess.Popen(
            ["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", _WATCH, f"{root}/step3_partial"],
            env=env(backend), stdout=subprocess.PIPE, text=True)
        assert watcher.stdout is not None and json.loads(watcher.stdout.readline())["live"] is True
        killed = time.monotonic()
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait()
        seen = [json.loads(line) for line in watcher.stdout]
        assert watcher.wait() == 0
        dead_at = next(entry["t"] for entry in seen if not entry["live"]) - killed
        assert 2.0 - 0.3 - 0.25 <= dead_at <= 2.0 + 1.0, (dead_at, seen[-3:])  # timeout 2 s, interval 0.3 s
        broken = namespace.run("locks", root, "--break", "step3_partial/.dcp_ext.saving")
        assert broken.returncode == 0 and "removed step3_partial/.dcp_ext.saving" in broken.stdout, broken
    saver.save("step3", model_at(3))
    assert loads(saver, "step3", 3)
    saver.close()


def test_lock_records_round_trip_with_identity() -> None:
    record = LockRecord.mine("s", tag="t", base="b", timeout=30.0)
    back = LockRecord.from_json(record.to_json())
    assert back == record and back is not None and back.boot_id and back.pid_ns and back.heartbeat == back.started
    assert dataclasses.replace(record, heartbeat=None).heartbeat is None
