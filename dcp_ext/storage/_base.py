"""The storage contract every backend implements.

A :class:`Store` is rooted at one directory-like location (a local directory,
an S3 prefix, an fsspec URL) and holds the files of one checkpoint. Names are
relative to the root and use ``/`` as separator.

Writes stream through an :class:`ObjectWriter`: nothing is visible under the
final name until :meth:`ObjectWriter.commit` returns, and by then the bytes
are durable (fsync'ed file, completed multipart upload). :meth:`ObjectWriter.abort`
leaves nothing behind that a reader could find.

Reads are batches of :class:`~dcp_ext.storage.ReadRequest` executed in
parallel, each landing directly in caller-owned memory.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from ..config import IOConfig
from ..errors import CheckpointCorruptError
from ._ranges import ReadRequest

__all__ = [
    "Store", "ObjectWriter", "IOStats", "IOStatsSnapshot", "IncompleteUpload", "TMP_MARK", "scatter",
    "request_views",
]

#: Marks temporary files (a write in progress, or left by a crash); a name
#: containing it is never a committed file. Every backend names its
#: temporaries ``{final name}{TMP_MARK}{random}``; cleanup deletes them.
TMP_MARK = ".dcp_ext-tmp-"


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload that was started and never completed or aborted
    (object stores only): invisible, but its parts are stored and billed.

    Attributes:
        name: The object's name relative to the store's root (may contain ``/``).
        upload_id: The storage's id of the upload.
        initiated: When it started (seconds since the epoch).
    """

    name: str
    upload_id: str
    initiated: float


@dataclass(frozen=True)
class IOStatsSnapshot:
    """Counters of one store at one moment (see :class:`IOStats`)."""

    bytes_read: int
    """Bytes of data files read through :meth:`Store.read` since the last reset."""
    read_requests: int
    """Ranged read requests made (after coalescing), one per request sent to the storage."""
    bytes_written: int
    """Bytes of data files committed through :class:`ObjectWriter`."""
    files_written: int
    """Data files committed through :class:`ObjectWriter`."""
    files_read: frozenset[str]
    """Names of the data files read from (relative to the store's root)."""


class IOStats:
    """Thread-safe counters of data moved by a store.

    Only data-file traffic made through :meth:`Store.read` and
    :class:`ObjectWriter` is counted; small metadata files are not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Set every counter back to zero (a benchmark calls it between rounds)."""
        with self._lock:
            self._bytes_read = 0
            self._read_requests = 0
            self._bytes_written = 0
            self._files_written = 0
            self._files_read: set[str] = set()

    def add_read(self, name: str, nbytes: int) -> None:
        """Count one ranged read of ``nbytes`` bytes of file ``name``.

        Called by the store's reading threads, on the rank that reads.
        """
        with self._lock:
            self._bytes_read += nbytes
            self._read_requests += 1
            self._files_read.add(name)

    def add_written_file(self, nbytes: int) -> None:
        """Count one committed data file of ``nbytes`` bytes (called by the writer that
        commits it)."""
        with self._lock:
            self._bytes_written += nbytes
            self._files_written += 1

    def snapshot(self) -> IOStatsSnapshot:
        """The counters now, consistent with each other (taken under the lock)."""
        with self._lock:
            return IOStatsSnapshot(
                self._bytes_read,
                self._read_requests,
                self._bytes_written,
                self._files_written,
                frozenset(self._files_read),
            )


def scatter(request: ReadRequest, data: memoryview) -> None:
    """Copy the bytes of a fetched, non-direct ``request`` into its targets."""
    for pos, dest in request.targets:
        dest[:] = data[pos : pos + dest.nbytes]


def request_views(request: ReadRequest) -> list[memoryview] | None:
    """Buffers that, filled in order, receive ``request``'s bytes: each target
    where its bytes go, and one throwaway scratch buffer reused for every hole.

    Returns ``None`` when targets overlap (the caller then reads into one
    buffer and uses :func:`scatter`).
    """
    targets = sorted(request.targets, key=lambda t: t[0])
    holes: list[tuple[int, int]] = []
    pos = 0
    for off, dest in targets:
        if off < pos:
            return None
        if off > pos:
            holes.append((len(holes), off - pos))
        pos = off + dest.nbytes
    if pos < request.length:
        holes.append((len(holes), request.length - pos))
    scratch = memoryview(bytearray(max((n for _, n in holes), default=0)))
    views: list[memoryview] = []
    pos = 0
    for off, dest in targets:
        if off > pos:
            views.append(scratch[: off - pos])
        views.append(dest)
        pos = off + dest.nbytes
    if pos < request.length:
        views.append(scratch[: request.length - pos])
    return views


class ObjectWriter(ABC):
    """A file being written: stream bytes in, then commit or abort.

    Used as a context manager, an exception inside the block aborts it.
    Writers are used by one thread at a time.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        """The file's final name, relative to the store's root (visible only after
        :meth:`commit`)."""
        self.position = 0
        """Bytes written so far, i.e. the offset the next :meth:`write` starts at."""

    @abstractmethod
    def write(self, data: memoryview | bytes | bytearray) -> None:
        """Append ``data``. May return before it is stored; errors surface at
        a later ``write`` or at ``commit``."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable and visible under its final name."""

    @abstractmethod
    def abort(self) -> None:
        """Discard everything written; safe to call more than once."""

    def __enter__(self) -> ObjectWriter:
        """The writer itself, for ``with store.open_writer(name) as w:``."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Abort the file if the block raised; otherwise do nothing.

        Leaving the block without an exception does not commit: call :meth:`commit` inside it.
        """
        if exc is not None:
            self.abort()


class Store(ABC):
    """One checkpoint directory on some storage.

    Args:
        url: The root, as the user gave it (used in messages).
        config: I/O tunables.
    """

    #: ``"local"``, ``"s3"`` or ``"fsspec"``; decides defaults such as the
    #: coalescing gap.
    kind: str = "fsspec"

    def __init__(self, url: str, config: IOConfig) -> None:
        self.url = url.rstrip("/") or url
        """The root as given, without a trailing ``/``; used in messages (see :meth:`describe`)."""
        self.config = config
        """The I/O tunables this store reads and writes with."""
        self.stats = IOStats()
        """Data-file traffic of this store in this process (:class:`IOStats`)."""

    # -- naming -----------------------------------------------------------
    def describe(self, name: str = "") -> str:
        """The full location of ``name`` for messages."""
        return f"{self.url}/{name}" if name else self.url

    @property
    def coalesce_gap(self) -> int:
        """Bytes between two ranged reads below which they are fetched as one request.

        ``IOConfig.coalesce_gap`` when set, else 64 KiB for local file systems and 1 MiB for object
        stores (which charge per request).
        """
        if self.config.coalesce_gap is not None:
            return self.config.coalesce_gap
        return 64 * 1024 if self.kind == "local" else 1024 * 1024

    # -- small files ------------------------------------------------------
    @abstractmethod
    def read_file(self, name: str) -> bytes:
        """Return a whole (small) file.

        Raises:
            FileNotFoundError: (a dcp_ext subclass) ``name`` does not exist.
        """

    @abstractmethod
    def write_file(self, name: str, data: bytes) -> None:
        """Atomically publish a small file: readers see the old or the new one."""

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create small file ``name`` with content ``data`` only if it does not
        exist; ``False`` if it does.

        Of concurrent callers exactly one gets ``True``, and the file appears
        with all of ``data`` at once: nobody ever reads it empty or partial.
        Local and shared POSIX file systems write a temporary file and
        ``link`` it into place; S3 uses a conditional ``If-None-Match: *``
        PUT. This default (other fsspec file systems) is a check then a
        write, which concurrent callers can race; backends override it with
        the best their storage offers.
        """
        if self.exists(name):
            return False
        self.write_file(name, data)
        return True

    def modified(self, name: str) -> float | None:
        """When file ``name`` last changed (seconds since the epoch), or ``None``
        if the storage does not say.

        Raises:
            FileNotFoundError: (a dcp_ext subclass) ``name`` does not exist.
        """
        return None

    def list_incomplete_uploads(self) -> list[IncompleteUpload]:
        """Multipart uploads under the root that never completed (object stores;
        other storage has none)."""
        return []

    def abort_upload(self, upload: IncompleteUpload) -> None:
        """Abort ``upload`` and free its stored parts."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads to abort")

    # -- data files -------------------------------------------------------
    @abstractmethod
    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        """Start streaming a data file (see :class:`ObjectWriter`).

        Args:
            name: File name under the root.
            size_hint: Expected size in bytes, if known (sizes S3 parts).
        """

    def read(self, requests: Sequence[ReadRequest]) -> None:
        """Run ranged reads in parallel; each fills its targets exactly, then
        its ``on_done`` callbacks run on the thread that read it.

        Raises:
            CheckpointCorruptError: A file ended before the requested range.
        """
        if requests:
            self._run_reads(requests)

    @abstractmethod
    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        """Backend part of :meth:`read`; calls :meth:`_finished` per request."""

    def _finished(self, request: ReadRequest) -> None:
        """(backends) A request's bytes are all in place."""
        self.stats.add_read(request.name, request.length)
        for callback in request.on_done:
            callback()

    def _short_read(self, name: str, offset: int, wanted: int, got: int) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{self.describe(name)} is shorter than the checkpoint metadata says: "
            f"bytes [{offset}, {offset + wanted}) were requested but only {got} "
            f"could be read. The file is truncated or was replaced; restore it "
            f"or load an older checkpoint.",
            self.describe(name),
        )

    # -- namespace --------------------------------------------------------
    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete file ``name``; a missing file is not an error."""

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the files directly under the root (empty if it has none)."""

    @abstractmethod
    def list_dirs(self) -> list[str]:
        """Names of the directories (prefixes) directly under the root."""

    def list_entries(self) -> tuple[list[str], list[str]]:
        """``(list_names(), list_dirs())``; one listing where the storage can."""
        return self.list_names(), self.list_dirs()

    def list_tree(self) -> list[str]:
        """Names of every file under the root, those in sub-directories included
        (``30/model_rank3.distcp``, see ``IOConfig.key_prefixes``)."""
        return self.list_names()

    def read_head(self, name: str, length: int) -> bytes:
        """Up to ``length`` bytes from the start of file ``name``."""
        data = self.read_range(name, 0, length, allow_short=True)
        return data

    def read_range(self, name: str, offset: int, length: int, allow_short: bool = False) -> bytes:
        """``length`` bytes at ``offset`` of file ``name`` (fewer at EOF if ``allow_short``)."""
        if allow_short:
            return self._read_range_short(name, offset, length)
        buffer = bytearray(length)
        if length:
            self.read([ReadRequest(name, offset, length, ((0, memoryview(buffer)),))])
        return bytes(buffer)

    def _read_range_short(self, name: str, offset: int, length: int) -> bytes:
        data = self.read_file(name)
        return data[offset : offset + length]

    def size(self, name: str) -> int:
        """Size of file ``name`` in bytes."""
        return len(self.read_file(name))

    @abstractmethod
    def remove_root_if_empty(self) -> None:
        """Remove the root directory if nothing is left in it (no-op on object stores)."""

    @abstractmethod
    def root_exists(self) -> bool:
        """Whether the root exists (a directory, or any object under a prefix).

        Raises:
            CheckpointNotFoundError: (subclass) the bucket does not exist.
            StoragePermissionError: the storage refused to tell.
        """

    @abstractmethod
    def ensure_root(self) -> None:
        """Create the root if the storage has directories; check it is writable."""
