"""The part buffers of the object stores' uploads (S3 parts, GCS parts, Azure blocks)."""

from __future__ import annotations

import threading

__all__ = ["PartBuffers"]


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
