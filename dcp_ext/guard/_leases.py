"""Root leases: a save that builds on another checkpoint pins it until it ends.

An incremental save (and an incremental drain from the local tiers) refers
to the data files of its *base* checkpoint and to every file the base refers
to. Nothing may delete or rewrite those files while the save is in flight,
in this process, another process, or on another host. So before it reads
its base, the save's coordinator writes a **lease** in the root,
``ROOT/.dcp_ext.lease.<id>.json``: a :class:`~dcp_ext.guard._save_lock.LockRecord`
naming the tag it saves and its base, judged live or abandoned by the save
lock's one rule (:func:`dcp_ext.guard._save_lock.file_state`). The lease is deleted
when the save has committed or failed.

Every step that deletes or rewrites files in a root (retention,
``delete``, ``compact``, an ``overwrite=True`` save, leftover cleanup) takes
the save lock of each directory it changes *before* it reads the live leases
and the committed checkpoints (:meth:`dcp_ext.root.CheckpointRoot.scan`),
and leaves a leased base as it is. A save writes its lease *before* it
checks that its base's save lock is free and reads the base's metadata.
Of the two, whichever comes second sees the other: the deleter finds the
lease (and keeps the base), or the save finds the base locked or gone (and
writes every frame, building on nothing).

Which ranks call what: the coordinator of the save only; plain I/O.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import DcpExtError
from ..storage import Location, Store
from ._heartbeat import Renewal, renew_while_held, stop_renewing
from ._save_lock import LockRecord, LockState, file_state, forget, hold

__all__ = ["LEASE_PREFIX", "LEASE_SUFFIX", "Lease", "is_lease_name", "live_leases"]

log = logging.getLogger("dcp_ext.leases")

LEASE_PREFIX = ".dcp_ext.lease."
LEASE_SUFFIX = ".json"


def is_lease_name(name: str) -> bool:
    """Whether a root-level file name is a lease."""
    return name.startswith(LEASE_PREFIX) and name.endswith(LEASE_SUFFIX)


class Lease:
    """A lease held by one save on its base (see the module docstring).

    Pickles (without its open store), so a process-based upload can end it.

    Args:
        root: The checkpoint root.
        tag: The tag being saved.
        base: The tag it builds on.
    """

    def __init__(self, root: Location, tag: str, base: str) -> None:
        self.location = root
        self.url = root.url
        self.config = root.config
        self.id = uuid.uuid4().hex
        self.name = f"{LEASE_PREFIX}{self.id}{LEASE_SUFFIX}"
        self.record = LockRecord.mine(self.id, tag=tag, base=base, timeout=root.config.heartbeat_timeout)
        self.held = False
        self._store: Store | None = None
        self._renewal: Renewal | None = None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = self.location.open()
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        # Open stores hold clients and sockets; the copy opens its own. The
        # lease stays counted as held by the process that took it.
        return {**self.__dict__, "_store": None, "_renewal": None}

    def take(self) -> None:
        """(coordinator) Write the lease; from now on no deleter touches the base."""
        self.store.write_file(self.name, self.record.to_json())
        hold(self.id, self)
        self.held = True
        self._renewal = renew_while_held(self, self.store, self.name, self.record, self.config.heartbeat_interval)

    def end(self) -> None:
        """(coordinator) Delete the lease (after the commit, or the failure)."""
        forget(self.id)
        stop_renewing(self._renewal)
        self._renewal = None
        if not self.held:
            return
        self.held = False
        try:
            self.store.delete(self.name)
        except DcpExtError as err:  # it expires by the lock rule: only tidiness is lost
            log.warning("could not delete the lease %s: %s", self.store.describe(self.name), err)


@dataclass(frozen=True)
class LiveLease:
    """A live lease found in a root.

    Attributes:
        name: Its file name.
        state: Its state by the lock rule (``state.record`` is ``None`` when
            the record is unreadable: then which base it pins is unknown).
    """

    name: str
    state: LockState

    @property
    def base(self) -> str | None:
        return None if self.state.record is None else self.state.record.base


def live_leases(root: Store, names: list[str], now: float | None = None) -> list[LiveLease]:
    """(any process) The live leases among the root-level file ``names``
    (one read per lease file; abandoned ones are deleted)."""
    found = []
    for name in names:
        if not is_lease_name(name):
            continue
        state = file_state(root, name, now)
        if state is None:
            continue  # ended meanwhile
        if state.live:
            found.append(LiveLease(name, state))
            continue
        log.info("removing the abandoned lease %s: %s", root.describe(name), state.reason)
        try:
            root.delete(name)
        except DcpExtError as err:
            log.warning("could not delete %s: %s", root.describe(name), err)
    return found
