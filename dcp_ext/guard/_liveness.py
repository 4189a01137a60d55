"""The one rule for "is this save lock or lease live": :func:`judge`.

A save lock (``.dcp_ext.saving``) or a root lease (``.dcp_ext.lease.*.json``)
holds a :class:`LockRecord`: who took it (host, boot, PID namespace, pid and
the process's start time) and its **heartbeat**, the time its holder last
renewed it (:mod:`dcp_ext.guard._heartbeat` rewrites it every
``IOConfig.heartbeat_interval`` seconds while the holder lives). Deciding
whether such a record still protects a save in flight is done here, and
only here, for every writer, deleter and cleanup. In order:

1. **Released** (a failed save gave it up, leaving the mark): abandoned.
2. **Damaged** (empty, not JSON, or a field that cannot be: a pid outside
   ``1..2**22``, a host name that is no name, a time that is not a finite
   date): judged by its file's modification time alone, as a record of
   unknown holder: live until ``heartbeat_timeout`` after its last change.
3. **Written by this process** (same host, boot, PID namespace and pid):
   live while the save that took it still holds it.
4. **Written on this host, in this PID namespace, since this boot**: live
   while its process runs (pid and start time match: a reused pid is not the
   holder, a zombie holds nothing). Only then may a process be judged by
   its pid: a process in another PID namespace (a sidecar container, a
   ``hostNetwork`` pod, ``unshare -p``) sees other processes under the same
   pids, so there the record is judged by time, as one from another host.
5. **Anything else** (another host, another PID namespace, another boot,
   or a record written by dcp_ext before heartbeats, which has neither
   namespace nor heartbeat): by time. Its last sign of life is the later of
   its heartbeat and its file's modification time (the storage's clock;
   for a record without heartbeats, its start time alone unless that is
   not believed), counting only times that are not more than
   ``clock_skew_tolerance`` seconds in this host's future.
   Live while that is less than the record's heartbeat timeout ago (the
   holder's ``heartbeat_timeout``, at most an hour; an hour for a record
   without heartbeats, which nobody renews). A record whose every time lies
   further in the future is not believed: abandoned, with a warning.

**Clock skew.** Rule 5 compares another host's clock (the heartbeat) and
the storage's clock (the file time) with this host's. A holder whose clock
runs ahead by ``s`` seconds (at most the tolerance) keeps its record live
``s`` seconds longer after it dies; one that runs behind is still seen live
by its file time, which the storage sets. With every clock within the
tolerance of the others, a live holder is never judged dead and a dead one
is judged dead at most ``heartbeat_timeout + clock_skew_tolerance`` after
its last renewal. Clocks further apart than that (an S3 endpoint refuses
requests more than 15 minutes off anyway) are outside what the rule promises.
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LEGACY_STALE_SECONDS",
    "LockRecord",
    "LockState",
    "ProcessIdentity",
    "this_process",
    "judge",
    "hold",
    "forget",
    "is_held",
    "process_stat",
]

log = logging.getLogger("dcp_ext.save_lock")

#: A record without heartbeats (written by dcp_ext before them) is live this
#: long after it was taken, as all records were then.
LEGACY_STALE_SECONDS = 3600.0
#: The largest heartbeat timeout a record may declare for itself (a larger one is capped).
MAX_HEARTBEAT_TIMEOUT = 3600.0
#: Pids are at most 2**22 on Linux (PID_MAX_LIMIT); a larger one cannot be a process.
PID_LIMIT = 1 << 22
# Dates are believed between 2001 and 2286 (a record saying otherwise is damaged).
_EARLIEST, _LATEST = 1e9, 1e10

# Records held by saves of this process (save id -> holder): a record
# written by this process whose holder is gone (a stock ``dcp.save`` that
# failed never releases its lock) is abandoned.
_HELD: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def hold(save_id: str, holder: object) -> None:
    """Count the lock or lease ``save_id`` as held by this process while ``holder`` lives."""
    _HELD[save_id] = holder


def forget(save_id: str) -> None:
    """This process no longer holds ``save_id`` (its file, if left, is then abandoned)."""
    _HELD.pop(save_id, None)


def is_held(save_id: str) -> bool:
    """Whether a holder in this process still holds ``save_id``."""
    return save_id in _HELD


@dataclass(frozen=True)
class ProcessIdentity:
    """What tells one process apart from every other, beyond host name and pid.

    Attributes:
        host: Host name (``socket.gethostname()``).
        pid: Process id, in its PID namespace.
        pid_start: Start time (clock ticks since boot), ``None`` where unknown.
        boot_id: The kernel's boot id (``/proc/sys/kernel/random/boot_id``).
        pid_ns: The inode of its PID namespace (``/proc/self/ns/pid``).
    """

    host: str
    pid: int
    pid_start: int | None
    boot_id: str | None
    pid_ns: int | None


_IDENTITY: ProcessIdentity | None = None


def this_process() -> ProcessIdentity:
    """This process's identity (read once per process)."""
    global _IDENTITY
    pid = os.getpid()
    if _IDENTITY is None or _IDENTITY.pid != pid:  # forked since
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id: str | None = f.read().strip() or None
        except OSError:
            boot_id = None
        try:
            pid_ns: int | None = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pid_ns = None
        _IDENTITY = ProcessIdentity(socket.gethostname(), pid, process_stat(pid)[1], boot_id, pid_ns)
    return _IDENTITY


def process_stat(pid: int) -> tuple[bytes | None, int | None]:
    """The state letter and start time (clock ticks since boot) of ``pid``
    from ``/proc`` (Linux); ``(None, None)`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[-1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None, None


@dataclass(frozen=True)
class LockRecord:
    """Who holds a save lock or a lease, and when it last said so.

    Attributes:
        save_id: The save's id (``StorageMeta.save_id``).
        started: When it was taken (seconds since the epoch, holder's clock).
        host: Host name of the process that took it.
        pid: Its process id (in its PID namespace).
        released: The save failed and gave the lock up, but files of it may
            remain: the record stays as the mark that dcp_ext wrote this
            directory (so leftover cleanup may remove it), and counts as
            abandoned at once.
        tag: Leases only (:mod:`dcp_ext.guard._leases`): the tag being saved.
        base: Leases only: the tag whose files the save may refer to.
        pid_start: When the process started (Linux clock ticks since boot;
            ``None`` where unknown): a process that reuses the pid of a dead
            holder is not the holder.
        boot_id: The holder's kernel boot id (``None``: unknown).
        pid_ns: The holder's PID namespace inode (``None``: unknown).
        heartbeat: When the holder last renewed it (its clock); ``None`` for
            records written before heartbeats.
        timeout: The holder's heartbeat timeout: seconds after the last
            heartbeat at which the record counts as dead.
    """

    save_id: str
    started: float
    host: str
    pid: int
    released: bool = False
    tag: str | None = None
    base: str | None = None
    pid_start: int | None = None
    boot_id: str | None = None
    pid_ns: int | None = None
    heartbeat: float | None = None
    timeout: float | None = None

    @classmethod
    def mine(cls, save_id: str, tag: str | None = None, base: str | None = None,
             timeout: float | None = None) -> LockRecord:
        """A record of this process, taken now (``tag``, ``base``: a lease's;
        ``timeout``: the heartbeat timeout its renewals keep it within;
        ``None`` writes a record without heartbeats)."""
        me = this_process()
        now = time.time()
        return cls(save_id, now, me.host, me.pid, tag=tag, base=base, pid_start=me.pid_start, boot_id=me.boot_id,
                   pid_ns=me.pid_ns, heartbeat=now if timeout is not None else None, timeout=timeout)

    def renewed(self, now: float | None = None) -> LockRecord:
        """The record with its heartbeat at ``now``."""
        return dataclasses.replace(self, heartbeat=time.time() if now is None else now)

    def to_json(self) -> bytes:
        doc: dict[str, object] = {"save_id": self.save_id, "started": self.started, "host": self.host, "pid": self.pid}
        optional = {"tag": self.tag, "base": self.base, "pid_start": self.pid_start, "boot_id": self.boot_id,
                    "pid_ns": self.pid_ns, "heartbeat": self.heartbeat, "timeout": self.timeout}
        if self.released:
            doc["released"] = True
        doc.update({k: v for k, v in optional.items() if v is not None})
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LockRecord | None:
        """The record in ``data``, or ``None`` if it is empty, not a record,
        or holds a field that cannot be (see the module docstring, rule 2)."""
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                return None
            record = cls(
                save_id=_text(doc["save_id"], 256),
                started=_date(doc["started"]),
                host=_host(doc["host"]),
                pid=_int(doc["pid"], 1, PID_LIMIT),
                released=doc.get("released") is True,
                tag=_optional(doc.get("tag"), lambda v: _text(v, 4096)),
                base=_optional(doc.get("base"), lambda v: _text(v, 4096)),
                pid_start=_optional(doc.get("pid_start"), lambda v: _int(v, 0, 1 << 62)),
                boot_id=_optional(doc.get("boot_id"), lambda v: _text(v, 64)),
                pid_ns=_optional(doc.get("pid_ns"), lambda v: _int(v, 0, 1 << 62)),
                heartbeat=_optional(doc.get("heartbeat"), _date),
                timeout=_optional(doc.get("timeout"), _seconds),
            )
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError):
            return None
        return record

    def holder(self) -> str:
        """``pid P on HOST`` (for messages)."""
        return f"pid {self.pid} on {self.host}"

    def describe(self) -> str:
        return f"save {self.save_id} by {self.holder()}"


def _optional(value: Any, check: Callable[[Any], Any]) -> Any:
    return None if value is None else check(value)


def _text(value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
        raise ValueError(f"not a name: {value!r}")
    return value


def _host(value: Any) -> str:
    host = _text(value, 255)
    if any(c.isspace() or c in "/\\" for c in host):
        raise ValueError(f"not a host name: {value!r}")
    return host


def _int(value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{value!r} is not an integer in [{low}, {high}]")
    return value


def _date(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _EARLIEST <= value <= _LATEST:
        raise ValueError(f"{value!r} is not a date")
    return float(value)


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{value!r} is not a number of seconds")
    return float(value)


@dataclass(frozen=True)
class LockState:
    """What a lock or lease file says, judged by the one rule.

    Attributes:
        live: The save that holds it may still be running.
        age: Seconds since its last sign of life (heartbeat or file time),
            by this host's clock (negative: dated in the future).
        record: The record, or ``None`` if the file was empty or damaged.
        reason: Why it counts as live or abandoned, naming the holder.
        where: The file (``store.describe(name)``).
        expires_in: For a record judged live by time: seconds until it
            counts as dead unless renewed meanwhile; ``None`` otherwise.
    """

    live: bool
    age: float
    record: LockRecord | None
    reason: str
    where: str = ""
    expires_in: float | None = None

    def expiry(self) -> str:
        """When a live record stops counting as live, for messages."""
        if self.expires_in is not None:
            return f"it counts as dead {self.expires_in:.0f} s from now unless its holder renews it"
        return "it stays while its holder runs"

    def advice(self) -> str:
        """How to clear it, for a refusal's message."""
        if not self.live:
            return f"{self.where} is abandoned and is cleared by the next save or cleanup"
        return (f"{self.expiry()}; if its holder is gone for good, remove it with `dcp-ext locks ROOT --break` "
                f"or delete {self.where}")


def judge(
    record: LockRecord | None,
    modified: Callable[[], float | None],
    *,
    where: str,
    now: float,
    default_timeout: float,
    tolerance: float,
    legacy_timeout: float = LEGACY_STALE_SECONDS,
) -> LockState:
    """The one rule (module docstring) for one record.

    Args:
        record: The record, ``None`` when the file is empty or damaged.
        modified: Returns the file's modification time (storage clock), or
            ``None``; called only when needed (one request on object stores).
        where: The file, for messages.
        now: This host's time.
        default_timeout: Heartbeat timeout for a damaged record.
        tolerance: How far in the future a time is still believed.
        legacy_timeout: How long a record without heartbeats stays live.
    """
    if record is not None and record.released:
        return LockState(False, now - record.started, record, f"{record.describe()} failed and released it", where)
    me = this_process()
    if record is not None and record.host == me.host and record.boot_id is not None \
            and record.boot_id == me.boot_id and record.pid_ns is not None and record.pid_ns == me.pid_ns:
        running = _running_here(record, me)
        age = now - (record.heartbeat if record.heartbeat is not None else record.started)
        if not running:
            return LockState(False, age, record, f"{record.describe()} has exited", where)
        return LockState(True, age, record, f"{record.describe()} is running on this host", where)
    if record is None:
        timeout, times, who = default_timeout, [], "a damaged record (holder unknown)"
    else:
        timeout = legacy_timeout if record.heartbeat is None else min(record.timeout or default_timeout,
                                                                          MAX_HEARTBEAT_TIMEOUT)
        times = [record.heartbeat if record.heartbeat is not None else record.started]
        who = record.describe()
    believed = [t for t in times if t <= now + tolerance]
    # The file's time is a sign of life where the holder rewrites it (heartbeats), and the
    # only time a damaged record has; a record without heartbeats is judged by its start,
    # as it always was, unless that is not believed.
    legacy = record is not None and record.heartbeat is None
    if not believed or (not legacy and now - max(believed) >= timeout):
        stamp = modified()
        if stamp is not None:
            times.append(stamp)
            if stamp <= now + tolerance:
                believed.append(stamp)
    kind = "heartbeat" if record is not None and record.heartbeat is not None else "start" if record else "change"
    if not believed:
        ahead = min(times) - now if times else math.nan
        if not times:
            return LockState(True, 0.0, record, f"{who}, with no time to judge it by (the storage gives no "
                                                f"file time): kept, as it cannot be proven dead", where)
        log.warning("%s: %s is dated %.0f s in the future, beyond the clock-skew tolerance of %.0f s: "
                    "judged abandoned", where, who, ahead, tolerance)
        return LockState(False, -ahead, record, f"{who} is dated {ahead:.0f} s in the future, beyond the "
                                                 f"clock-skew tolerance of {tolerance:.0f} s", where)
    last = max(believed)
    age = now - last
    if age >= timeout:
        return LockState(False, age, record, f"{who}: its last {kind} was {age:.0f} s ago "
                                             f"(dead after {timeout:.0f} s)", where)
    place = "on another host" if record is None or record.host != me.host else "in another PID namespace or boot"
    return LockState(True, age, record, f"{who} {place}: its last {kind} was {max(age, 0.0):.0f} s ago",
                     where, expires_in=timeout - age)


def _running_here(record: LockRecord, me: ProcessIdentity) -> bool:
    """Whether the holder of a record of this host, boot and PID namespace still holds it."""
    if record.pid == me.pid:
        return record.save_id in _HELD
    try:
        os.kill(record.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's process)
    state, start = process_stat(record.pid)
    if state in (b"Z", b"X"):
        return False  # exited, not yet reaped (a killed job's ranks linger so): holds nothing
    # The pid was reused by another process after the holder died (pids wrap
    # at /proc/sys/kernel/pid_max, 32768 by default).
    return record.pid_start is None or start is None or start == record.pid_start
