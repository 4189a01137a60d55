"""The file objects :mod:`dcp_ext.integrations.torch_checkpointing` hands torch_checkpointing.

torch_checkpointing writes with ``torch.save(data, stream)`` (or
``stream.write(buffer)``) inside ``with storage.stream_write(path) as stream``
and reads with ``torch.load(stream)``, ``stream.read()`` and, for its mmap
fills and resharding reads, ``seek`` + ``readinto`` on streams of their own
(one per thread). These adapt dcp_ext's store primitives to those calls:

* :class:`StoreWriteStream`: an :class:`~dcp_ext.storage.ObjectWriter` as a
  raw binary stream: ``close`` commits (the file appears whole, durable),
  leaving the ``with`` block by an exception aborts (nothing appears).
* :class:`StoreRangeReader`: a seekable stream whose every ``readinto`` is
  one batch of ranged reads straight into the caller's buffer (no copy),
  split into ``read_request_size`` requests that the store runs in parallel.
* :func:`read_whole`: a whole file by the same parallel ranged reads, as a
  seekable stream over memory (no second copy, unlike ``io.BytesIO(data)``).
"""

from __future__ import annotations

import io
from types import TracebackType
from typing import Any

from dcp_ext.storage import ObjectWriter, ReadRequest, Store

__all__ = ["StoreWriteStream", "StoreRangeReader", "read_whole"]


class StoreWriteStream(io.RawIOBase):
    """(one thread) A file being written; committed by ``close``."""

    def __init__(self, writer: ObjectWriter) -> None:
        super().__init__()
        self._writer = writer
        self._finished = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._writer.write(view)
        return view.nbytes

    def abort(self) -> None:
        """Discard what was written; the stream is closed."""
        if not self._finished:
            self._finished = True
            self._writer.abort()
        super().close()

    def close(self) -> None:
        if not self._finished and not self.closed:
            self._finished = True
            try:
                self._writer.commit()
            finally:
                super().close()

    def __del__(self) -> None:
        # Dropped without close() (an error outside a with block): nothing of it may appear.
        self.abort()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            self.abort()
            return
        self.close()


class StoreRangeReader(io.RawIOBase):
    """(one thread) A seekable read-only view of file ``name`` of ``store``,
    ``size`` bytes long (known by the caller or probed)."""

    def __init__(self, store: Store, name: str, size: int) -> None:
        super().__init__()
        self._store = store
        self._name = name
        self._size = size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset} in {self._store.describe(self._name)}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self._size - self._pos))
        if n:
            _read_into(self._store, self._name, self._pos, view[:n])
        self._pos += n
        return n


class _MemoryReader(io.RawIOBase):
    """A seekable read-only stream over a buffer (not copied)."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._data = memoryview(data)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._data.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self._data.nbytes - self._pos))
        view[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


def _read_into(store: Store, name: str, offset: int, view: memoryview) -> None:
    """Fill ``view`` from ``offset`` of ``name``: one request per
    ``read_request_size``, run in parallel by the store.

    Raises:
        CheckpointCorruptError: The file ends first.
    """
    step = store.config.read_request_size
    store.read([ReadRequest(name, offset + pos, min(step, view.nbytes - pos), ((0, view[pos:pos + step]),))
                for pos in range(0, view.nbytes, step)])


def read_whole(store: Store, name: str, size: int) -> io.RawIOBase:
    """File ``name`` (``size`` bytes) read into memory, as a seekable stream."""
    data = bytearray(size)
    if size:
        _read_into(store, name, 0, memoryview(data))
    return _MemoryReader(data)
