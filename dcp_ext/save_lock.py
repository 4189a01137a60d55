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

import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass

from .errors import CheckpointInProgressError, CheckpointNotFoundError, DcpExtError
from .storage import Store

__all__ = ["LOCK_FILE", "STALE_LOCK_SECONDS", "LockRecord", "LockState", "SaveLock", "lock_state"]

log = logging.getLogger("dcp_ext.save_lock")

LOCK_FILE = ".dcp_ext.saving"
#: A lock older than this counts as abandoned. Read at call time, so tests
#: and unusual deployments can change it (``dcp_ext.save_lock.STALE_LOCK_SECONDS``).
STALE_LOCK_SECONDS = 3600.0

# Locks held by saves of this process (save id -> lock): a lock written by
# this process whose save is gone (a stock ``dcp.save`` that failed never
# releases it) is abandoned.
_HELD: weakref.WeakValueDictionary[str, SaveLock] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class LockRecord:
    """Who holds a save lock.

    Attributes:
        save_id: The save's id (``StorageMeta.save_id``).
        started: When the lock was taken (seconds since the epoch).
        host: Host name of the process that took it.
        pid: Its process id.
    """

    save_id: str
    started: float
    host: str
    pid: int

    def to_json(self) -> bytes:
        return json.dumps(
            {"save_id": self.save_id, "started": self.started, "host": self.host, "pid": self.pid}
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LockRecord | None:
        """The record in ``data``, or ``None`` if it is empty or not a record."""
        try:
            doc = json.loads(data)
            return cls(str(doc["save_id"]), float(doc["started"]), str(doc["host"]), int(doc["pid"]))
        except (ValueError, KeyError, TypeError):
            return None

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
    return True


def lock_state(store: Store, now: float | None = None) -> LockState | None:
    """(any rank) The state of ``store``'s save lock, or ``None`` if there is none."""
    now = time.time() if now is None else now
    stale = float(STALE_LOCK_SECONDS)
    try:
        data = store.read_file(LOCK_FILE)
    except CheckpointNotFoundError:
        return None
    record = LockRecord.from_json(data)
    if record is None:
        try:
            modified = store.modified(LOCK_FILE)
        except CheckpointNotFoundError:
            return None  # released meanwhile
        if modified is None:
            return LockState(True, 0.0, None, "its record is unreadable and the storage gives no file time")
        age = now - modified
        if age >= stale:
            return LockState(False, age, None, f"its record is unreadable and the file is {age:.0f} s old")
        return LockState(True, age, None, "its record is empty or unreadable (being written, or damaged)")
    age = now - record.started
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
        record = LockRecord(self.save_id, time.time(), socket.gethostname(), os.getpid())
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
            log.warning("taking over the lock of an abandoned save at %s: %s", store.url, state.reason)
            store.delete(LOCK_FILE)
        raise CheckpointInProgressError(f"could not take the save lock of {store.url}", store.url)

    def release(self) -> None:
        """(coordinator) Give the lock up; a lock that cannot be deleted expires."""
        _HELD.pop(self.save_id, None)
        if not self.held:
            return
        self.held = False
        try:
            # Taken over as abandoned (a save paused past the stale limit)? Then it is not ours to delete.
            record = LockRecord.from_json(self.store.read_file(LOCK_FILE))
            if record is None or record.save_id == self.save_id:
                self.store.delete(LOCK_FILE)
        except CheckpointNotFoundError:
            pass
        except DcpExtError as err:
            log.warning("could not delete %s: %s", self.store.describe(LOCK_FILE), err)
