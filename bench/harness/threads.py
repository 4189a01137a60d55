"""Where a process's CPU goes, per thread and by role (``bench.blocking``, ``bench.gpu``).

Linux only: every thread's CPU time is read from ``/proc/self/task/<tid>/schedstat``
(nanoseconds on the CPU, exact) and named by its Python thread (``threading``'s
``native_id``) or, for native threads (torch's intra-op pool, gloo), by
``/proc/self/task/<tid>/comm``.

A :class:`ThreadCpu` takes exact readings of every live thread at the
boundaries of the phases it is told about (``mark("steps")``, ``mark("drain")``,
``stop()``), and a sampler thread reads them every ``interval`` seconds in
between, so that a thread that ends inside a phase (DCP's upload thread ends with
each save) is counted up to its last sample. What ended unseen is not lost from
the totals: the process's own CPU clock (``CLOCK_PROCESS_CPUTIME_ID``, every
thread that ever ran) is read at the same boundaries, and the difference is
reported as ``exited (unattributed)``.

Roles (:func:`role_of`): ``training`` is the main thread and the native threads
that existed when the first phase began (intra-op pool, gloo); ``bench`` is the
harness's own threads (this sampler, the RSS sampler); ``dcp_ext:<part>`` is
dcp_ext's threads by name (``dcp_ext-stage`` → ``dcp_ext:stage``); torch's DCP
threads are ``torch:upload`` (``AsyncCheckpointExecutor``, DCP's upload
thread, which for dcp_ext's writer runs dcp_ext's ``write_data``) and
``torch:stager`` (``DefaultStager``'s unnamed ``ThreadPoolExecutor``);
``fsspec`` is s3fs's event loop; native threads started during a phase are
``native (new)`` (OpenMP teams of copy threads, for instance).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field

__all__ = ["ThreadCpu", "role_of", "CHECKPOINT_ROLES", "is_checkpoint_role"]

_TASKS = "/proc/self/task"
_DIGITS = re.compile(r"[-_]\d+$")


def _cpu_ns(tid: int) -> int | None:
    try:
        with open(f"{_TASKS}/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # the thread ended meanwhile


def _comm(tid: int) -> str:
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def role_of(name: str | None, native_at_start: bool, main: bool, bench: bool) -> str:
    """The role a thread's CPU is reported under (see the module docstring).

    Args:
        name: Its Python thread name, ``None`` for a native thread.
        native_at_start: A native thread that existed when accounting began.
        main: The process's main thread.
        bench: One of the harness's own threads.
    """
    if bench:
        return "bench"
    if main:
        return "training"
    if name is None:
        return "training" if native_at_start else "native (new)"
    if name.startswith("dcp_ext-"):
        return "dcp_ext:" + _DIGITS.sub("", name.removeprefix("dcp_ext-"))
    if name.startswith("AsyncCheckpointExecutor"):
        return "torch:upload"
    if name.startswith("ThreadPoolExecutor-"):
        return "torch:stager"
    if name.startswith("fsspecIO"):
        return "fsspec"
    return "other:" + _DIGITS.sub("", name.split(" ")[0])


#: Roles counted as the checkpoint's CPU (everything but training, the bench and other).
CHECKPOINT_ROLES = ("dcp_ext:", "torch:", "fsspec", "native (new)", "exited (unattributed)")


def is_checkpoint_role(role: str) -> bool:
    return role.startswith(CHECKPOINT_ROLES)


@dataclass
class _Seen:
    name: str | None
    role: str
    last: int = 0  # ns at the latest reading
    at_mark: int = 0  # ns at the start of the current phase


@dataclass
class PhaseCpu:
    """CPU seconds of one phase, per role, and the process's total."""

    by_role: dict[str, float] = field(default_factory=dict)
    process: float = 0.0
    wall: float = 0.0


class ThreadCpu:
    """Per-role CPU seconds of this process over named phases.

    Use: ``cpu = ThreadCpu(bench_threads=[...]); cpu.mark("steps"); ...;
    cpu.mark("drain"); ...; cpu.stop()``; then :attr:`phases`.

    Args:
        interval: Seconds between samples of threads that may end.
        bench_threads: The harness's threads (their CPU is reported as ``bench``).
    """

    def __init__(self, interval: float = 0.025, bench_threads: list[threading.Thread] | None = None) -> None:
        self._interval = interval
        self._bench = list(bench_threads or [])
        self._seen: dict[int, _Seen] = {}
        self._native_at_start: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._phase: str | None = None
        self._phase_started = 0.0
        self._process_at_mark = 0.0
        self.phases: dict[str, PhaseCpu] = {}

    def _names(self) -> dict[int, str]:
        return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}

    def _read(self, names: dict[int, str], first: bool = False) -> None:
        """Update every live thread's reading (the lock held)."""
        bench = {t.native_id for t in self._bench if t.native_id is not None}
        if self._thread is not None and self._thread.native_id is not None:
            bench.add(self._thread.native_id)
        main = threading.main_thread().native_id
        for entry in os.listdir(_TASKS):
            tid = int(entry)
            ns = _cpu_ns(tid)
            if ns is None:
                continue
            seen = self._seen.get(tid)
            if seen is not None and seen.name is None and tid in names:  # named after its first reading
                seen.name = names[tid]
                seen.role = role_of(seen.name, False, tid == main, tid in bench)
            if seen is None:
                name = names.get(tid)
                if first and name is None:
                    self._native_at_start.add(tid)
                role = role_of(name, tid in self._native_at_start, tid == main, tid in bench)
                # A thread first seen after the start began inside this phase: all its CPU counts.
                seen = self._seen[tid] = _Seen(name, role, ns, ns if first else 0)
            seen.last = ns

    def _close_phase(self) -> None:
        if self._phase is None:
            return
        process = time.process_time()
        out = PhaseCpu(process=process - self._process_at_mark, wall=time.perf_counter() - self._phase_started)
        for seen in self._seen.values():
            delta = (seen.last - seen.at_mark) / 1e9
            if delta > 0:
                out.by_role[seen.role] = out.by_role.get(seen.role, 0.0) + delta
        accounted = sum(out.by_role.values())
        if out.process - accounted > 0.0005:
            out.by_role["exited (unattributed)"] = out.process - accounted
        self.phases[self._phase] = out

    def mark(self, phase: str) -> None:
        """End the current phase (if any) with exact readings and start ``phase``."""
        with self._lock:
            self._read(self._names(), first=not self._seen)
            self._close_phase()
            for seen in self._seen.values():
                seen.at_mark = seen.last
            self._phase = phase
            self._phase_started = time.perf_counter()
            self._process_at_mark = time.process_time()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            names = self._names()
            with self._lock:
                self._read(names)

    def stop(self) -> dict[str, PhaseCpu]:
        """End the current phase; the phases."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._read(self._names())
            self._close_phase()
            self._phase = None
        return self.phases

    def threads(self) -> list[tuple[int, str, str]]:
        """(tid, name, role) of every thread seen (native threads by their ``comm``)."""
        return [(tid, s.name or f"<{_comm(tid)}>", s.role) for tid, s in sorted(self._seen.items())]
