"""Every collective wait of a save or a load bounded, and the rank that did not come named.

DCP's plan gather and scatter and its write and commit all-reduce wait, in
gloo, for the process group's timeout (30 minutes by default); a rank that
dies or stalls then shows on the others as an untyped ``RuntimeError`` naming
at best an address. dcp_ext's saves and loads therefore:

* run their collectives on a gloo group made with ``IOConfig.collective_timeout``
  (:func:`watched_group`; for the default group one of dcp_ext's own, made
  once, collectively), which knows every rank's host and address;
* report, while a save or load runs, each rank's phase (``plan``, ``write``,
  ``written``, ``commit``...) and a heartbeat in the rendezvous store
  (:class:`RankWatch`, one small key per rank, renewed every few seconds and
  deleted at the end);
* when a collective fails with anything but a dcp_ext error, read the other
  ranks' records twice, a heartbeat apart (:meth:`RankWatch.culprits`): a rank
  whose record did not change is silent (dead, or its host cut off), one in
  an earlier phase than this rank's is stalled there. The caller raises
  :class:`~dcp_ext.errors.RankFailedError` naming them, their hosts and the
  step.

Which ranks call what: every rank of the group calls :func:`watched_group`
(collective the first time for a group and timeout) and makes one
:class:`RankWatch` per save or load, in the same order on every rank.
Store writes run on a thread of their own: a store that does not answer
(its host died) never blocks the save; reads for a diagnosis are bounded.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["Member", "WatchedGroup", "RankWatch", "Culprit", "watched_group", "SAVE_PHASES", "LOAD_PHASES"]

log = logging.getLogger("dcp_ext.rank_watch")

#: The phases of a save, in order (a rank in an earlier one than another's is behind it).
SAVE_PHASES = ("plan", "write_data", "written", "commit", "done")
#: The phases of a load, in order.
LOAD_PHASES = ("plan", "read_data", "read", "done")
# The phase of a rank that raised itself (it is alive, and no culprit).
_ENDED = "ended"
# How long a diagnosis may read the store (its host may be gone).
_READ_LIMIT = 10.0


@dataclass(frozen=True)
class Member:
    """One rank of a watched group: its group rank, host name and address."""

    rank: int
    host: str
    address: str

    def describe(self) -> str:
        return f"rank {self.rank} on {self.host} ({self.address})"


@dataclass
class WatchedGroup:
    """A process group whose collectives are bounded, with its members.

    Attributes:
        group: The group to pass to DCP (dcp_ext's own for the default group).
        members: Every rank's host and address, by group rank.
        timeout: Its collectives' bound, seconds (``None``: the caller's group, its own timeout).
        uid: Names this group's keys in the store (the same on every rank).
    """

    group: Any
    members: tuple[Member, ...]
    timeout: float | None
    uid: str
    ops: int = 0


_GROUPS: dict[tuple[Any, float], WatchedGroup] = {}
_GROUPS_LOCK = threading.Lock()
_UIDS = itertools.count()


def _address(toward: str | None) -> str:
    """The address this host sends from toward the rendezvous host (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((toward or "127.0.0.1", 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "?"


def watched_group(process_group: Any, timeout: float) -> WatchedGroup | None:
    """(every rank of the group; collective the first time for it) The group
    a save or load runs its collectives on, with every rank's host.

    For the default group (``process_group=None``) it is a gloo group of
    dcp_ext's own whose collectives time out after ``timeout`` seconds; a
    caller's group is used as it is (its own timeout applies). ``None``
    outside ``torch.distributed``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = ("default" if process_group is None else id(process_group), float(timeout))
    with _GROUPS_LOCK:
        found = _GROUPS.get(key)
    if found is not None:
        return found
    if process_group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        bound: float | None = timeout
    else:
        group, bound = process_group, None
    me = (socket.gethostname(), _address(os.environ.get("MASTER_ADDR")))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    members = tuple(Member(rank, host, address) for rank, (host, address) in enumerate(everyone))
    watched = WatchedGroup(group, members, bound, f"g{next(_UIDS)}")
    with _GROUPS_LOCK:
        _GROUPS[key] = watched
    return watched


@dataclass(frozen=True)
class Culprit:
    """A rank that did not arrive, and why it is thought not to have."""

    member: Member
    reason: str

    def describe(self) -> str:
        return f"{self.member.describe()} ({self.reason})"


# One thread writes every rank-watch record of this process: a store that
# does not answer delays the records, never the save.
_WRITER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-rank-watch")


class _Heartbeats:
    """One thread per process renews the records of every open :class:`RankWatch`.

    A save used to start a heartbeat thread of its own; ``Thread.start``
    waits until the new thread runs, which on a busy host is milliseconds
    of the training loop's time (an asynchronous save's blocked time). The
    thread starts with the first watch of the process (again in a forked
    child) and sleeps while no save or load runs.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No watch and no thread (also in a forked child: the lock may have been held at the fork)."""
        self._lock = threading.Condition(threading.Lock())
        self._watches: dict[int, RankWatch] = {}
        self._thread: threading.Thread | None = None

    def add(self, watch: RankWatch) -> None:
        """Renew ``watch``'s record every ``watch.interval`` seconds until :meth:`remove`."""
        with self._lock:
            watch.due = time.monotonic() + watch.interval
            self._watches[id(watch)] = watch
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dcp_ext-rank-heartbeat", daemon=True)
                self._thread.start()
            self._lock.notify()

    def remove(self, watch: RankWatch) -> None:
        """Stop renewing ``watch``'s record (its last post may still be on its way)."""
        with self._lock:
            self._watches.pop(id(watch), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._watches:
                    self._lock.wait()
                now = time.monotonic()
                due = [w for w in self._watches.values() if w.due <= now]
                for watch in due:  # under the lock: after remove() returns, nothing more is posted
                    watch.due = now + watch.interval
                    watch._post()
                if self._watches:
                    self._lock.wait(max(0.0, min(w.due for w in self._watches.values()) - time.monotonic()))


_HEARTBEATS = _Heartbeats()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HEARTBEATS.reset)


class RankWatch:
    """One save or load's phases and heartbeat in the rendezvous store (see the module docstring).

    Args:
        watched: The group it runs on.
        phases: Its phases, in order (:data:`SAVE_PHASES` or :data:`LOAD_PHASES`).
        interval: Seconds between heartbeats (default: from the group's size
            and timeout, 1-5 s, longer for very large groups).
    """

    def __init__(self, watched: WatchedGroup, phases: tuple[str, ...], interval: float | None = None) -> None:
        watched.ops += 1
        self.watched = watched
        self.phases = phases
        self.rank = dist.get_rank(watched.group)
        world = len(watched.members)
        bound = watched.timeout or 60.0
        self.interval = interval if interval is not None else max(1.0, min(5.0, bound / 10), world / 500)
        self._prefix = f"dcp_ext/watch/{watched.uid}/{watched.ops}/"
        try:
            self._store: Any = dist.distributed_c10d._get_default_store()
        except Exception as err:  # noqa: BLE001 - no store: nothing is watched, errors stay as they are
            log.debug("no rendezvous store to watch ranks with: %s", err)
            self._store = None
        self.phase_name = phases[0]
        self._since = time.time()
        self._seq = 0
        #: When the heartbeat thread posts this record next (``time.monotonic``).
        self.due = 0.0
        if self._store is not None:
            self._post()
            _HEARTBEATS.add(self)

    def phase(self, name: str) -> None:
        """(this rank) It enters phase ``name``."""
        self.phase_name, self._since = name, time.time()
        self._post()

    def close(self, ok: bool = True) -> None:
        """(this rank) The save or load is over: stop the heartbeat and remove
        the record; after a failure (``ok=False``) the record stays, saying so,
        for other ranks still diagnosing (a few bytes per rank and failure).

        The failure's record is written before this returns (waiting at most
        ``_READ_LIMIT`` seconds for the store): a process that raises and
        then exits at once would otherwise take the queued record with it,
        and a rank still diagnosing would find this one's heartbeat stopped
        in its last phase and name it as dead too.
        """
        if self._store is None:
            return
        _HEARTBEATS.remove(self)
        if ok:
            _WRITER.submit(self._quietly, self._store.delete_key, self._key(self.rank))
            return
        self.phase(_ENDED)
        try:
            _WRITER.submit(lambda: None).result(timeout=_READ_LIMIT)  # the one writer thread is past the record
        except Exception as err:  # noqa: BLE001 - diagnostics only: the error raised is the caller's
            log.debug("rank watch: the failure's record may not be written: %s", err)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _post(self) -> None:
        self._seq += 1
        value = json.dumps([self.phase_name, self._since, self._seq])
        _WRITER.submit(self._quietly, self._store.set, self._key(self.rank), value)

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:  # noqa: BLE001 - the watch is diagnostics; the save goes on without it
            log.debug("rank watch: %s", err)

    def _read_all(self) -> dict[int, tuple[str, float, int]] | None:
        """Every other rank's record now; ``None`` if the store does not answer in time."""
        store, found = self._store, {}

        def read() -> dict[int, tuple[str, float, int]]:
            out = {}
            for member in self.watched.members:
                key = self._key(member.rank)
                if member.rank != self.rank and store.check([key]):
                    phase, since, seq = json.loads(store.get(key))
                    out[member.rank] = (str(phase), float(since), int(seq))
            return out

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-rank-read")
        try:
            found = pool.submit(read).result(timeout=_READ_LIMIT)
        except Exception as err:  # noqa: BLE001 - a store that does not answer is itself the finding
            log.debug("rank watch: cannot read the store: %s", err)
            return None
        finally:
            pool.shutdown(wait=False)
        return found

    def culprits(self) -> tuple[list[Culprit], str]:
        """(this rank, after a collective failed) The ranks that did not
        arrive, and the step this rank was at. Reads every rank's record
        twice, one and a half heartbeats apart."""
        step = self.phase_name
        members = self.watched.members
        if self._store is None:
            return [], step
        first = self._read_all()
        if first is None:
            master = os.environ.get("MASTER_ADDR")
            hosting = [m for m in members if m.address == master] or [members[0]]
            return [Culprit(m, "its host runs the rendezvous store, which does not answer: the host is down "
                               "or cut off") for m in hosting if m.rank != self.rank], step
        time.sleep(1.5 * self.interval)
        second = self._read_all()
        # The store can go between the reads: the rank hosting it (rank 0
        # under init_process_group's env:// rendezvous) failed too and its
        # process ended. Every record then looks gone; judge by the first
        # read's phases instead, without the heartbeat comparison.
        compared = second is not None
        if second is None:
            log.debug("rank watch: the store stopped answering between the two reads; judging by the first")
            second = first
        mine = self.phases.index(step) if step in self.phases else len(self.phases)
        now = time.time()
        found = []
        for member in members:
            if member.rank == self.rank:
                continue
            before, after = first.get(member.rank), second.get(member.rank)
            if after is None:
                found.append(Culprit(member, "it never reported" if before is None else
                                     f"its record is gone; last in {before[0]!r}"))
                continue
            phase, since, seq = after
            if phase == _ENDED:
                continue  # it raised too, and is alive
            if compared and before is not None and before[2] == seq:
                found.append(Culprit(member, f"silent: no heartbeat for {1.5 * self.interval:.0f} s, last in "
                                             f"{phase!r}: dead, or its host cut off"))
            elif phase in self.phases and self.phases.index(phase) < mine:
                found.append(Culprit(member, f"alive but still in {phase!r}, entered {max(0.0, now - since):.0f} s "
                                             f"ago"))
        return found, step
