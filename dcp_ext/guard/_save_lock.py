"""The save lock of a checkpoint directory: one save at a time.

A save takes the lock before it changes anything in the directory (before an
``overwrite=True`` save un-commits the old checkpoint) and releases it after
the commit. The lock is the small file ``.dcp_ext.saving`` holding a JSON
:class:`~dcp_ext.guard._liveness.LockRecord`, created with
:meth:`Store.create_exclusive`, so of two racing saves exactly one wins and
nobody ever reads a half-written record. While held, its record is renewed
(:mod:`dcp_ext.guard._heartbeat`).

Whether a lock is live (its save may still be running) is decided by the one
rule of :mod:`dcp_ext.guard._liveness`, for the writer (may I take it over?)
and for the manager's cleanup (may I delete this uncommitted directory?).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..config import IOConfig
from ..errors import CheckpointInProgressError, CheckpointNotFoundError, DcpExtError
from ..storage import Store
from ._heartbeat import Renewal, renew_while_held, stop_renewing
from ._liveness import (
    LEGACY_STALE_SECONDS,
    LockRecord,
    LockState,
    forget,
    hold,
    judge,
    process_stat,
)

__all__ = ["LOCK_FILE", "STALE_LOCK_SECONDS", "LockRecord", "LockState", "SaveLock", "lock_state", "file_state",
           "hold", "forget", "stale_lock_seconds"]

log = logging.getLogger("dcp_ext.save_lock")

LOCK_FILE = ".dcp_ext.saving"
#: How long a record without heartbeats (written by dcp_ext before them)
#: stays live, and how old a temporary file or an incomplete upload must be
#: before cleanup may remove it. Read at call time, so tests and unusual
#: deployments can change it (``dcp_ext.guard._save_lock.STALE_LOCK_SECONDS``).
STALE_LOCK_SECONDS = LEGACY_STALE_SECONDS

_process_stat = process_stat  # the name tests and older code use


def stale_lock_seconds() -> float:
    """:data:`STALE_LOCK_SECONDS` as it is now (read at each call, so a test
    or a deployment that changes the module's value is heard everywhere)."""
    return float(STALE_LOCK_SECONDS)


def lock_state(store: Store, now: float | None = None, config: IOConfig | None = None) -> LockState | None:
    """(any rank) The state of ``store``'s save lock, or ``None`` if there is none."""
    return file_state(store, LOCK_FILE, now, config)


def file_state(store: Store, name: str, now: float | None = None, config: IOConfig | None = None) -> LockState | None:
    """(any rank) The state of the lock (or lease) file ``name`` in ``store``,
    judged by the one liveness rule; ``None`` if there is no such file."""
    config = IOConfig.from_env() if config is None else config
    try:
        data = store.read_file(name)
    except CheckpointNotFoundError:
        return None
    record = LockRecord.from_json(data)
    gone = False

    def modified() -> float | None:
        nonlocal gone
        try:
            return store.modified(name)
        except CheckpointNotFoundError:
            gone = True
            return None

    state = judge(record, modified, where=store.describe(name), now=time.time() if now is None else now,
                  default_timeout=config.heartbeat_timeout, tolerance=config.clock_skew_tolerance,
                  legacy_timeout=stale_lock_seconds())
    return None if gone else state  # gone: released meanwhile


class SaveLock:
    """The save lock of one checkpoint directory, held by one save.

    Taken and released by the coordinator only.

    Args:
        store: The checkpoint directory.
        save_id: The id of the save taking it.
        config: Its heartbeat interval and timeout (default: from the environment).
    """

    def __init__(self, store: Store, save_id: str, config: IOConfig | None = None) -> None:
        self.store = store
        self.save_id = save_id
        self.config = IOConfig.from_env() if config is None else config
        self.held = False
        self._renewal: Renewal | None = None

    def acquire(self) -> None:
        """(coordinator) Take the lock; an abandoned one is taken over.

        Raises:
            CheckpointInProgressError: Another save holds a live lock.
        """
        store = self.store
        record = LockRecord.mine(self.save_id, timeout=self.config.heartbeat_timeout)
        for _ in range(3):
            if store.create_exclusive(LOCK_FILE, record.to_json()):
                self.held = True
                hold(self.save_id, self)
                self._renewal = renew_while_held(self, store, LOCK_FILE, record, self.config.heartbeat_interval)
                return
            state = lock_state(store, config=self.config)
            if state is None:
                continue  # released between our attempt and the read
            if state.live:
                raise CheckpointInProgressError(
                    f"another save to {store.url} is in progress: {state.reason}. Wait for it or save to "
                    f"another path; {state.advice()}.",
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
        forget(self.save_id)
        stop_renewing(self._renewal)
        self._renewal = None
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

    def check_held(self) -> None:
        """(coordinator, before the commit) Raise unless this save still holds
        the lock: a save stopped for longer than the heartbeat timeout may
        have been judged dead and its lock taken over; it must not commit.

        Raises:
            CheckpointInProgressError: The lock is another save's now, or gone.
        """
        renewal = self._renewal
        try:
            current = LockRecord.from_json(self.store.read_file(LOCK_FILE))
        except CheckpointNotFoundError:
            current = None
        if (renewal is not None and renewal.lost) or current is None or current.save_id != self.save_id:
            holder = current.describe() if current is not None else "nobody (it was removed)"
            raise CheckpointInProgressError(
                f"the save lock of {self.store.url} is no longer held by this save (now: {holder}); "
                f"it was judged dead while it ran (stopped for longer than the heartbeat timeout of "
                f"{self.config.heartbeat_timeout:g} s?), so it does not commit",
                self.store.url,
            )
