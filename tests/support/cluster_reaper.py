"""Removing what a :class:`tests.support.cluster.Cluster` made, also after its owner died.

A cluster writes a *record* (``/run/dcp-cluster/<id>.json``) before it makes
anything: its owner's pid and start time, the network namespaces, the link in
the root namespace and the temporary directory it will make. Three things
remove them, whichever comes first:

1. ``Cluster.close()`` (also through ``atexit`` and the context manager);
2. the cluster's *watchdog*, ``python -m tests.support.cluster_reaper RECORD``:
   a process in a session of its own that reads a pipe from the owner and,
   when the pipe closes while the record still exists (the owner died, even by
   SIGKILL), reaps it;
3. :func:`sweep_stale`, run before every new cluster: reaps the records of dead
   owners, and namespaces named ``dcpc-<pid>-...`` whose pid is dead and that
   no record describes (the watchdog was killed too, or the record was lost).

Reaping kills every process inside the namespaces (a namespace outlives its
name while a process is in it), deletes the root link and the namespaces
(deleting a namespace deletes the veth ends and the bridge inside it) and the
directory. Mounts need no cleanup: every mount a cluster makes lives in the
mount namespace of the processes it started.

Only the standard library is imported: the watchdog starts in ~50 ms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "NETNS_PREFIX",
    "REGISTRY",
    "Record",
    "netns_pids",
    "kill_netns_processes",
    "reap",
    "registry_lock",
    "sweep_stale",
]

#: Every namespace a cluster makes is named ``dcpc-<owner pid>-<token>-<member>``.
NETNS_PREFIX = "dcpc"
#: Where the records live (tmpfs: gone after a reboot, like the namespaces).
REGISTRY = Path("/run/dcp-cluster")
_NETNS_DIR = Path("/run/netns")
_NAME_RE = re.compile(rf"^{NETNS_PREFIX}-(\d+)-([0-9a-f]+)-")
_KILL_ROUNDS_SECONDS = 3.0


@dataclasses.dataclass(frozen=True)
class Record:
    """What one cluster made (or is about to make), and who owns it."""

    cluster_id: str
    owner_pid: int
    owner_start: int | None
    base_dir: str
    netns: tuple[str, ...]
    root_link: str | None

    @property
    def path(self) -> Path:
        return REGISTRY / f"{self.cluster_id}.json"

    def write(self) -> None:
        REGISTRY.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.partial")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, self.path)

    @classmethod
    def read(cls, path: Path) -> Record:
        doc = json.loads(path.read_text())
        return cls(str(doc["cluster_id"]), int(doc["owner_pid"]),
                   None if doc["owner_start"] is None else int(doc["owner_start"]), str(doc["base_dir"]),
                   tuple(str(n) for n in doc["netns"]), None if doc["root_link"] is None else str(doc["root_link"]))

    def owner_alive(self) -> bool:
        return process_start(self.owner_pid) is not None and process_start(self.owner_pid) == self.owner_start


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` (clock ticks since boot), ``None`` if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[-1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def registry_lock() -> Iterator[None]:
    """Serialize choices that must not clash between clusters (subnets in the root
    namespace, link names) and sweeps, across processes."""
    REGISTRY.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def netns_pids(netns: str) -> list[int]:
    """Pids of every process whose network namespace is ``netns`` (``ip netns pids``, without a fork)."""
    try:
        st = os.stat(_NETNS_DIR / netns)
    except OSError:
        return []
    key = (st.st_dev, st.st_ino)
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue
        if (ns.st_dev, ns.st_ino) == key:
            pids.append(int(entry.name))
    return pids


def kill_netns_processes(netns: str, deadline_seconds: float = _KILL_ROUNDS_SECONDS) -> list[int]:
    """SIGKILL every process in ``netns`` until none is left (a dying process may
    have forked meanwhile); returns the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + deadline_seconds
    while True:
        pids = [p for p in netns_pids(netns) if p != os.getpid()]
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        if time.monotonic() > deadline:  # zombies of a parent that does not reap them stay listed
            return killed
        time.sleep(0.01)


def reap(record: Record) -> None:
    """Remove everything ``record`` names (each step tolerates a part already gone)."""
    for netns in record.netns:
        kill_netns_processes(netns)
    if record.root_link is not None:
        _quiet(["ip", "link", "del", record.root_link])
    for netns in record.netns:
        if (_NETNS_DIR / netns).exists():
            _quiet(["ip", "netns", "del", netns])
    shutil.rmtree(record.base_dir, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        record.path.unlink()


def sweep_stale() -> list[str]:
    """Reap the clusters of dead owners; returns what was removed (record ids and namespace names)."""
    removed: list[str] = []
    if not REGISTRY.is_dir() and not _NETNS_DIR.is_dir():
        return removed
    with registry_lock():
        described: set[str] = set()
        for path in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
            try:
                record = Record.read(path)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if record.owner_alive():
                described.update(record.netns)
                continue
            reap(record)
            removed.append(record.cluster_id)
        for entry in sorted(_NETNS_DIR.iterdir()) if _NETNS_DIR.is_dir() else []:
            match = _NAME_RE.match(entry.name)
            if match is None or entry.name in described or process_start(int(match.group(1))) is not None:
                continue
            kill_netns_processes(entry.name)
            _quiet(["ip", "netns", "del", entry.name])
            removed.append(entry.name)
    return removed


def _quiet(argv: list[str]) -> None:
    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def _watch(record_path: Path) -> None:
    """Block until the owner closes the pipe (or dies), then reap if the record is still there."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    if record_path.exists():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            reap(Record.read(record_path))


if __name__ == "__main__":
    _watch(Path(sys.argv[1]))
