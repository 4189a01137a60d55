"""Heartbeats: every save lock and lease this process holds is renewed while it lives.

The one liveness rule (:mod:`dcp_ext.guard._liveness`) judges a record of
another host (or another PID namespace) by the last time it was renewed. So
while a lock or lease is held, one daemon thread per process (running
only while something is held) rewrites its record with a new ``heartbeat`` every ``IOConfig.heartbeat_interval``
seconds; once its holder releases it (or is garbage collected without
releasing: a failed stock ``dcp.save``), renewals stop, and the record
counts as dead ``heartbeat_timeout`` seconds after the last one, on every
host. A whole host that dies stops renewing with it.

Before each renewal the thread reads the record back: one that another
process took over (it judged ours dead: a holder stopped for longer than
the timeout) or that was removed by hand is not written again, and its
holder is marked lost; the writer checks that before it commits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError
from ..storage import Store
from ._liveness import LockRecord

__all__ = ["Renewal", "renew_while_held", "stop_renewing", "renewals"]

log = logging.getLogger("dcp_ext.heartbeat")


@dataclass
class Renewal:
    """One record this process keeps renewed.

    Attributes:
        store: Where the record lies.
        name: Its file name.
        record: The record as last written.
        interval: Seconds between renewals.
        lost: Another process took it over, or it was removed: no longer renewed.
        renewed: Renewals written so far.
    """

    store: Store
    name: str
    record: LockRecord
    interval: float
    lost: bool = False
    renewed: int = 0
    due: float = field(default=0.0)
    stopped: bool = False
    # Held while a renewal is written, so that a release never races one (a
    # renewal after the release would bring the record back).
    guard: threading.Lock = field(default_factory=threading.Lock, repr=False)


class _Renewer:
    """The daemon thread that renews every held record of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._held: dict[int, Renewal] = {}
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, renewal: Renewal) -> None:
        with self._lock:
            self._reset_after_fork()
            renewal.due = time.monotonic() + renewal.interval
            self._held[id(renewal)] = renewal
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dcp_ext-heartbeat", daemon=True)
                self._thread.start()
            self._wake.notify()

    def remove(self, renewal: Renewal) -> None:
        with self._lock:
            self._held.pop(id(renewal), None)
            thread = self._thread if not self._held else None
            self._wake.notify()
        # The last record released: the thread ends (it is started again when needed), so a
        # process holding nothing runs no thread of ours.
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def held(self) -> list[Renewal]:
        with self._lock:
            self._reset_after_fork()
            return list(self._held.values())

    def _reset_after_fork(self) -> None:
        # A forked child holds none of its parent's records (and has no thread).
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._held.clear()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._pid != os.getpid():
                    return
                if not self._held:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [r for r in self._held.values() if r.due <= now]
                if not due:
                    wait = min((r.due for r in self._held.values()), default=now + 1.0) - now
                    self._wake.wait(timeout=max(0.05, min(wait, 1.0)))
                    continue
            for renewal in due:
                _renew(renewal)
                renewal.due = time.monotonic() + renewal.interval
                if renewal.lost:
                    self.remove(renewal)


_RENEWER = _Renewer()


def _renew(renewal: Renewal) -> None:
    """Rewrite one record with a new heartbeat, unless it is no longer ours."""
    with renewal.guard:
        if not renewal.stopped:
            _rewrite(renewal)


def _rewrite(renewal: Renewal) -> None:
    store, name = renewal.store, renewal.name
    try:
        current = LockRecord.from_json(store.read_file(name))
        if current is None or current.save_id != renewal.record.save_id or current.released:
            renewal.lost = True
            log.error("%s is no longer held by %s (%s): not renewing it", store.describe(name),
                      renewal.record.describe(), "taken over" if current is not None else "damaged")
            return
        renewal.record = renewal.record.renewed()
        store.write_file(name, renewal.record.to_json())
        renewal.renewed += 1
    except CheckpointNotFoundError:
        # Removed by hand, or ended by a copy of its holder in another process (a process-based upload).
        renewal.lost = True
        log.info("%s is gone while %s held it: not renewing it", store.describe(name), renewal.record.describe())
    except Exception as err:  # noqa: BLE001 - a storage hiccup: the next renewal tries again
        log.warning("could not renew %s: %s", store.describe(name), err)


def renew_while_held(holder: Any, store: Store, name: str, record: LockRecord, interval: float) -> Renewal:
    """Renew ``record`` (file ``name`` in ``store``) every ``interval`` seconds
    until :func:`stop_renewing`, or until ``holder`` is garbage collected."""
    renewal = Renewal(store, name, record, interval)
    _RENEWER.add(renewal)
    weakref.finalize(holder, stop_renewing, renewal)
    return renewal


def stop_renewing(renewal: Renewal | None) -> None:
    """Stop renewing (the holder releases its record); waits for a renewal
    being written, so none follows."""
    if renewal is not None:
        with renewal.guard:
            renewal.stopped = True
        _RENEWER.remove(renewal)


def renewals() -> list[Renewal]:
    """The records this process renews now (tests, diagnostics)."""
    return _RENEWER.held()
