"""The save lock of a checkpoint directory: one save at a time, and one rule for "is it live".

A save takes the lock before it changes anything in the directory (before an
``overwrite=True`` save un-commits the old checkpoint) and releases it after
the commit. The lock is the small file ``.dcp_ext.saving`` holding a JSON
record (:class:`LockRecord`), created with :meth:`Store.create_exclusive`, so
of two racing saves exactly one wins and nobody ever reads a half-written
record.

Whether a lock is live (its save may still be running) is decided here, and
only here, for the writer (may I take it over?) and for the manager's cleanup
(may I delete this uncommitted directory?):

* older than :data:`STALE_LOCK_SECONDS` by its record's start time: abandoned;
* empty or unreadable (a record being replaced, or damaged): live until the
  file itself is older than the stale limit;
* written on this host: live while its process runs (for this process:
  while the save that took it still holds it);
* written on another host: live, since nothing here can check it, until
  stale. On a shared file system (FSx, NFS) this is what keeps one host's
  cleanup from deleting another host's save in flight.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import time
import weakref
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointInProgressError, CheckpointNotFoundError, DcpExtError
from ..storage import Store

__all__ = ["LOCK_FILE", "STALE_LOCK_SECONDS", "LockRecord", "LockState", "SaveLock", "lock_state", "file_state", "hold", "forget", "stale_lock_seconds"]

log = logging.getLogger("dcp_ext.save_lock")

LOCK_FILE = ".dcp_ext.saving"
#: A lock older than this counts as abandoned. Read at call time, so tests
#: and unusual deployments can change it (``dcp_ext.guard._save_lock.STALE_LOCK_SECONDS``).
STALE_LOCK_SECONDS = 3600.0

# Locks held by saves of this process (save id -> lock): a lock written by
# this process whose save is gone (a stock ``dcp.save`` that failed never
# releases it) is abandoned.
_HELD: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class LockRecord:
    """Who holds a save lock.

    Attributes:
        save_id: The save's id (``StorageMeta.save_id``).
        started: When the lock was taken (seconds since the epoch).
        host: Host name of the process that took it.
        pid: Its process id.
        released: The save failed and gave the lock up, but files of it may
            remain: the record stays as the mark that dcp_ext wrote this
            directory (so leftover cleanup may remove it), and counts as
            abandoned at once.
        tag: Leases only (:mod:`dcp_ext.guard._leases`): the tag being saved.
        base: Leases only: the tag whose files the save may refer to.
        pid_start: When the process started (Linux clock ticks since boot;
            ``None`` where unknown): a process that reuses the pid of a dead
            holder is not the holder.
    """

    save_id: str
    started: float
    host: str
    pid: int
    released: bool = False
    tag: str | None = None
    base: str | None = None
    pid_start: int | None = None

    @classmethod
    def mine(cls, save_id: str, tag: str | None = None, base: str | None = None) -> LockRecord:
        """A record of this process, taken now (``tag``, ``base``: a lease's)."""
        pid = os.getpid()
        return cls(save_id, time.time(), socket.gethostname(), pid, tag=tag, base=base, pid_start=_process_stat(pid)[1])

    def to_json(self) -> bytes:
        doc: dict[str, object] = {"save_id": self.save_id, "started": self.started, "host": self.host, "pid": self.pid}
        if self.released:
            doc["released"] = True
        if self.tag is not None:
            doc["tag"] = self.tag
        if self.base is not None:
            doc["base"] = self.base
        if self.pid_start is not None:
            doc["pid_start"] = self.pid_start
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LockRecord | None:
        """The record in ``data``, or ``None`` if it is empty or not a record."""
        try:
            doc = json.loads(data)
            tag, base, pid_start = doc.get("tag"), doc.get("base"), doc.get("pid_start")
            if not isinstance(tag, (str, type(None))) or not isinstance(base, (str, type(None))):
                return None
            if pid_start is not None and (not isinstance(pid_start, int) or isinstance(pid_start, bool)):
                return None
            record = cls(str(doc["save_id"]), float(doc["started"]), str(doc["host"]), int(doc["pid"]),
                         doc.get("released") is True, tag, base, pid_start)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            return None
        return record if math.isfinite(record.started) else None

    def describe(self) -> str:
        return f"save {self.save_id} by pid {self.pid} on {self.host}"


@dataclass(frozen=True)
class LockState:
    """What a lock file says, judged by the one liveness rule.

    Attributes:
        live: The save that holds it may still be running.
        age: Seconds since it was taken (by its record, else by its file's mtime).
        record: The record, or ``None`` if the file was empty or unreadable.
        reason: Why it counts as live or abandoned, for messages.
    """

    live: bool
    age: float
    record: LockRecord | None
    reason: str


def stale_lock_seconds() -> float:
    """:data:`STALE_LOCK_SECONDS` as it is now (read at each call, so a test
    or a deployment that changes the module's value is heard everywhere)."""
    return float(STALE_LOCK_SECONDS)


def hold(save_id: str, holder: object) -> None:
    """Count the lock or lease ``save_id`` as held by this process while ``holder`` lives."""
    _HELD[save_id] = holder


def forget(save_id: str) -> None:
    """This process no longer holds ``save_id`` (its file, if left, is then abandoned)."""
    _HELD.pop(save_id, None)


def _holder_running(record: LockRecord) -> bool | None:
    """Whether the process that wrote ``record`` still holds it; ``None`` when
    that cannot be known from here (another host)."""
    if record.host != socket.gethostname():
        return None
    if record.pid == os.getpid():
        return record.save_id in _HELD
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's process)
    state, start = _process_stat(record.pid)
    if state in (b"Z", b"X"):
        return False  # exited, not yet reaped (a killed job's ranks linger so): holds nothing
    # The pid was reused by another process after the holder died (pids wrap
    # at /proc/sys/kernel/pid_max, 32768 by default).
    return record.pid_start is None or start is None or start == record.pid_start


def _process_stat(pid: int) -> tuple[bytes | None, int | None]:
    """The state letter and start time (clock ticks since boot) of ``pid``
    from ``/proc`` (Linux); ``(None, None)`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[-1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None, None


def lock_state(store: Store, now: float | None = None) -> LockState | None:
    """(any rank) The state of ``store``'s save lock, or ``None`` if there is none."""
    return file_state(store, LOCK_FILE, now)


def file_state(store: Store, name: str, now: float | None = None) -> LockState | None:
    """(any rank) The state of the lock (or lease) file ``name`` in ``store``,
    judged by the one liveness rule; ``None`` if there is no such file."""
    now = time.time() if now is None else now
    stale = float(STALE_LOCK_SECONDS)
    try:
        data = store.read_file(name)
    except CheckpointNotFoundError:
        return None
    record = LockRecord.from_json(data)
    if record is None:
        try:
            modified = store.modified(name)
        except CheckpointNotFoundError:
            return None  # released meanwhile
        if modified is None:
            return LockState(True, 0.0, None, "its record is unreadable and the storage gives no file time")
        age = now - modified
        if age >= stale:
            return LockState(False, age, None, f"its record is unreadable and the file is {age:.0f} s old")
        return LockState(True, age, None, "its record is empty or unreadable (being written, or damaged)")
    age = now - record.started
    if record.released:
        return LockState(False, age, record, f"{record.describe()} failed and released it")
    if age >= stale:
        return LockState(False, age, record, f"{record.describe()} started {age:.0f} s ago")
    running = _holder_running(record)
    if running is False:
        return LockState(False, age, record, f"{record.describe()} has exited")
    where = "on this host" if running else "on another host (cannot be checked from here)"
    return LockState(True, age, record, f"{record.describe()} started {age:.0f} s ago {where}")


class SaveLock:
    """The save lock of one checkpoint directory, held by one save.

    Taken and released by the coordinator only.

    Args:
        store: The checkpoint directory.
        save_id: The id of the save taking it.
    """

    def __init__(self, store: Store, save_id: str) -> None:
        self.store = store
        self.save_id = save_id
        self.held = False

    def acquire(self) -> None:
        """(coordinator) Take the lock; an abandoned one is taken over.

        Raises:
            CheckpointInProgressError: Another save holds a live lock.
        """
        store = self.store
        record = LockRecord.mine(self.save_id)
        for _ in range(3):
            if store.create_exclusive(LOCK_FILE, record.to_json()):
                self.held = True
                _HELD[self.save_id] = self
                return
            state = lock_state(store)
            if state is None:
                continue  # released between our attempt and the read
            if state.live:
                raise CheckpointInProgressError(
                    f"another save to {store.url} is in progress: {state.reason}. Wait for it or "
                    f"save to another path; if that job died, delete {store.describe(LOCK_FILE)} "
                    f"(a lock counts as abandoned after {STALE_LOCK_SECONDS / 60:.0f} minutes, or at "
                    f"once on the host that wrote it when its process has exited).",
                    store.url,
                )
            if state.record is None or not state.record.released:
                log.warning("taking over the lock of an abandoned save at %s: %s", store.url, state.reason)
            store.delete(LOCK_FILE)
        raise CheckpointInProgressError(f"could not take the save lock of {store.url}", store.url)

    def release(self, keep_mark: bool = False, verify: bool = True) -> None:
        """(coordinator) Give the lock up; a lock that cannot be deleted expires.

        Args:
            keep_mark: Leave the lock file, rewritten as released (abandoned
                at once), instead of deleting it: a failed save whose files
                may remain marks its directory as dcp_ext's, so that leftover
                cleanup removes it (and only it: a directory without the mark
                is not dcp_ext's to delete).
            verify: Read the lock first and leave it if another save took it
                over as abandoned (``False``: the holder knows it held it
                only briefly, as a deletion does).
        """
        _HELD.pop(self.save_id, None)
        if not self.held:
            return
        self.held = False
        try:
            if not verify and not keep_mark:
                self.store.delete(LOCK_FILE)
                return
            # Taken over as abandoned (a save paused past the stale limit)? Then it is not ours to delete.
            record = LockRecord.from_json(self.store.read_file(LOCK_FILE))
            if record is None or record.save_id == self.save_id:
                if keep_mark and record is not None:
                    self.store.write_file(LOCK_FILE, dataclasses.replace(record, released=True).to_json())
                else:
                    self.store.delete(LOCK_FILE)
        except CheckpointNotFoundError:
            pass
        except DcpExtError as err:
            log.warning("could not delete %s: %s", self.store.describe(LOCK_FILE), err)
