"""Uploads in parts, shared by the object stores (S3 parts, GCS parts, Azure blocks).

* :class:`PartBuffers`: the part buffers of one store, at most ``limit`` at a
  time, shared by every file it writes at once.
* :class:`PartUploadWriter`: a file copied into those buffers and sent a part
  at a time by a pool of threads; the first failed part fails the file. A
  store's writer says how a part is sent, how the sent parts become the
  object, how a file smaller than one part is written, and what an abort
  removes.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ._base import IOStats, ObjectWriter

__all__ = ["PartBuffers", "PartUploadWriter"]


class PartBuffers:
    """Part buffers shared by every writer of one store: at most ``limit``
    allocated at a time, reused from part to part and from file to file, and
    dropped when the last writer is done with them.

    A writer asks for a buffer only after sending its full one, so a writer
    waiting here holds none, and the buffers it waits for are either parts in
    flight or other writers' buffers being filled: both come back.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._cond = threading.Condition()
        self._free: list[bytearray] = []
        self._allocated = 0
        self._users = 0

    def join(self) -> None:
        with self._cond:
            self._users += 1

    def leave(self) -> None:
        with self._cond:
            self._users -= 1
            if self._users == 0:
                self._allocated -= len(self._free)
                self._free.clear()

    def get(self, size: int) -> bytearray:
        with self._cond:
            while True:
                if self._free:
                    buffer = self._free.pop()
                    if len(buffer) == size:
                        return buffer
                    self._allocated -= 1  # another file's part size: drop it
                    continue
                if self._allocated < self._limit:
                    self._allocated += 1
                    break
                self._cond.wait()
        try:
            return bytearray(size)
        except BaseException:
            with self._cond:
                self._allocated -= 1
                self._cond.notify()
            raise

    def put(self, buffer: bytearray) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()


class PartUploadWriter(ObjectWriter):
    """A file written in parts of ``part_size`` from a store's pooled buffers,
    at most ``max_in_flight`` parts sent at once.

    Parts are numbered from 0 in the order they are written. A subclass
    implements :meth:`_send_part` (a worker thread sends part ``index``),
    :meth:`_complete` (the parts become the object), :meth:`_put_whole` (a
    file that never filled a part) and :meth:`_discard` (an abort removes
    what was sent); :meth:`_before_part`, :meth:`_part_sent` (writing
    thread) and :meth:`_part_stored` (worker) are optional hooks.

    Args:
        name: The file's name in its store.
        buffers: The store's :class:`PartBuffers`.
        part_size: Bytes per part (the last one may be shorter).
        max_in_flight: Threads sending parts.
        stats: The store's I/O counters (a committed file is counted).
        thread_name: Prefix of the sending threads' names.
    """

    def __init__(self, name: str, buffers: PartBuffers, part_size: int, max_in_flight: int, stats: IOStats,
                 thread_name: str) -> None:
        super().__init__(name)
        self._buffers = buffers
        self._buffers.join()
        self._part_size = part_size
        self._max_in_flight = max_in_flight
        self._stats = stats
        self._thread_name = thread_name
        self._left_pool = False
        self._buffer: bytearray | None = None
        self._filled = 0
        self._parts = 0  # parts handed to the pool
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._error: BaseException | None = None
        self._stopping = False  # aborting: a subclass starts no new work (GCS: no more folds)
        self._lock = threading.Lock()
        self._done = False

    # -- what a store's writer implements ----------------------------------------------------
    def _before_part(self, index: int) -> None:
        """(writing thread) Part ``index`` is about to be sent; raise to refuse it."""

    @abstractmethod
    def _send_part(self, index: int, buffer: bytearray, length: int) -> None:
        """(worker thread) Store ``buffer[:length]`` as part ``index``."""

    def _part_sent(self, index: int) -> None:
        """(writing thread) Part ``index`` was handed to the pool."""

    def _part_stored(self, index: int) -> None:
        """(worker thread) Part ``index`` was stored."""

    @abstractmethod
    def _complete(self) -> None:
        """(writing thread) Every part is stored: make them the object."""

    @abstractmethod
    def _put_whole(self, body: memoryview) -> None:
        """(writing thread) Write the file, smaller than one part, in one request."""

    @abstractmethod
    def _discard(self) -> None:
        """(writing thread) Remove what an aborted upload sent (every task is done)."""

    # -- writing -----------------------------------------------------------------------------
    def write(self, data: memoryview | bytes | bytearray) -> None:
        self._raise_if_failed()
        view = memoryview(data).cast("B")
        self.position += view.nbytes
        while view.nbytes:
            if self._buffer is None:
                self._buffer = self._buffers.get(self._part_size)
                self._filled = 0
            take = min(view.nbytes, self._part_size - self._filled)
            self._buffer[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_size:
                buffer, self._buffer, self._filled = self._buffer, None, 0
                self._send(buffer, self._part_size)

    def _raise_if_failed(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = err

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future[None]:
        """Run ``fn(*args)`` on the pool (tasks may submit tasks); :meth:`_wait` waits for all."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_in_flight, thread_name_prefix=self._thread_name)
            future: Future[None] = self._pool.submit(fn, *args)
            self._futures.append(future)
        return future

    def _send(self, buffer: bytearray, length: int) -> None:
        """Send ``buffer[:length]`` as the next part; the buffer goes back to the pool once sent."""
        try:
            self._raise_if_failed()
            self._before_part(self._parts)
        except BaseException:
            self._buffers.put(buffer)  # ours now: the pool must get it back
            raise
        with self._lock:
            index = self._parts
            self._parts += 1
        future = self._submit(self._run_part, index, buffer, length)
        # A part cancelled before it ran gives its buffer back here.
        future.add_done_callback(lambda f: self._buffers.put(buffer) if f.cancelled() else None)
        self._part_sent(index)

    def _run_part(self, index: int, buffer: bytearray, length: int) -> None:
        try:
            self._raise_if_failed()  # another part failed for good: this upload is lost anyway
            self._send_part(index, buffer, length)
        except BaseException as err:
            self._fail(err)
            raise
        finally:
            self._buffers.put(buffer)
        self._part_stored(index)

    def _wait(self) -> None:
        """Wait for every task, those that tasks submitted included (errors stay in ``_error``)."""
        while True:
            with self._lock:
                pending = [f for f in self._futures if not f.done()]
            if not pending:
                break
            wait(pending)
        with self._lock:
            self._futures.clear()  # done futures keep their callbacks, and those their part buffers

    # -- commit / abort ----------------------------------------------------------------------
    def commit(self) -> None:
        try:
            if self._parts == 0:
                body = memoryview(self._buffer)[: self._filled] if self._buffer is not None else memoryview(b"")
                self._put_whole(body)
            else:
                if self._filled:
                    buffer, self._buffer, length, self._filled = self._buffer, None, self._filled, 0
                    assert buffer is not None
                    self._send(buffer, length)
                self._wait()
                self._raise_if_failed()
                self._complete()
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._release()
        self._stats.add_written_file(self.position)

    def _release(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._left_pool:
            return
        self._left_pool = True
        if self._buffer is not None:
            self._buffers.put(self._buffer)
            self._buffer = None
        self._buffers.leave()

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with self._lock:
            self._stopping = True
            futures = list(self._futures)
        for future in futures:
            future.cancel()
        self._wait()
        self._release()
        self._discard()
