"""One save at a time: the asynchronous save in flight, waiting for it, the exit hook, the stager's life."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any, Protocol

from ..dcp_io import AsyncSaveHandle, Stager

__all__ = ["InFlight", "watch_at_exit"]

log = logging.getLogger("dcp_ext.manager")


class InFlight:
    """The save a manager has in flight, and the staging buffers it reuses.

    Used by every rank's manager; :meth:`wait` is collective in effect (every
    rank waits for its part of the same save).

    Args:
        stager: The caller's :class:`~dcp_ext.staging.Stager` (``None``: one
            of the manager's own is made on the first asynchronous save and
            closed with the manager).
    """

    def __init__(self, stager: Stager | None) -> None:
        self.stager = stager
        self._own_stager = stager is None
        self._pending: AsyncSaveHandle | None = None
        self.lock = threading.Lock()

    def stager_for(self, share_memory: bool = False) -> Stager:
        """The stager asynchronous saves use (made on first use)."""
        if self.stager is None:
            self.stager = Stager(share_memory=share_memory)
        return self.stager

    def track(self, handle: AsyncSaveHandle) -> None:
        """Remember ``handle`` as the save in flight (waited for by the next save)."""
        with self.lock:
            self._pending = handle

    def wait(self) -> None:
        """(all ranks) Block until the save in flight is done (or failed: its
        own handle reports that)."""
        with self.lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as err:  # reported by that save's own handle
                log.warning("the previous asynchronous save failed: %s", err)

    def close(self) -> None:
        """Free the staging buffers of the manager's own stager (after :meth:`wait`)."""
        if self.stager is not None and self._own_stager:
            self.stager.close()
            self.stager = None


class _Waits(Protocol):
    def wait_for_persist(self) -> None: ...


# Managers with a save possibly in flight; each is waited for at exit, so a
# committed save always gets its ``newest`` before the process ends.
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_at_exit(manager: _Waits) -> None:
    """Wait for ``manager``'s saves and drains in flight when the interpreter exits."""
    _LIVE.add(manager)


@atexit.register
def _wait_for_saves_in_flight() -> None:
    for manager in list(_LIVE):
        manager.wait_for_persist()
