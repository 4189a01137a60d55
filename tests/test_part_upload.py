"""The upload-in-parts skeleton the object stores share (``dcp_ext.storage._part_upload``).

S3, GCS and Azure each run it against real servers in the store contract
suite and their own tests; these check what those cannot see: the parts a
writer hands out and their order, what a failure leaves of the store's buffer
pool (every buffer back, no sending thread left) and what an abort removes.
The writer here keeps its parts in a dict, as a store would keep objects.
"""

from __future__ import annotations

import random
import threading

import pytest

from dcp_ext.storage import IOStats
from dcp_ext.storage._part_upload import PartBuffers, PartUploadWriter

PART = 1024


class _DictWriter(PartUploadWriter):
    """Parts into ``self.parts``; ``fail_at`` makes that part's send raise, ``max_parts`` refuses more."""

    def __init__(self, buffers: PartBuffers, fail_at: int | None = None, max_parts: int = 1000) -> None:
        super().__init__("file.bin", buffers, PART, 3, IOStats(), "test-put")
        self.parts: dict[int, bytes] = {}
        self.whole: bytes | None = None
        self.object: bytes | None = None
        self.discarded = 0
        self.fail_at = fail_at
        self.max_parts = max_parts
        self.threads: set[str] = set()

    def _before_part(self, index: int) -> None:
        if index >= self.max_parts:
            raise ValueError(f"file.bin needs more than {self.max_parts} parts")

    def _send_part(self, index: int, buffer: bytearray, length: int) -> None:
        self.threads.add(threading.current_thread().name)
        if index == self.fail_at:
            raise OSError(f"part {index} of file.bin: connection reset")
        self.parts[index] = bytes(memoryview(buffer)[:length])

    def _complete(self) -> None:
        self.object = b"".join(self.parts[i] for i in range(len(self.parts)))

    def _put_whole(self, body: memoryview) -> None:
        self.whole = bytes(body)

    def _discard(self) -> None:
        self.discarded += 1
        self.parts.clear()


def _write_in_pieces(writer: PartUploadWriter, data: bytes, seed: int) -> None:
    rng, at = random.Random(seed), 0
    while at < len(data):
        step = rng.choice([1, 7, 100, PART - 1, PART, PART + 1, 3 * PART])
        writer.write(memoryview(data)[at : at + step])
        at += step


def _pool_is_empty(buffers: PartBuffers) -> bool:
    return buffers._allocated == 0 and buffers._users == 0 and not buffers._free


def test_parts_in_order_a_short_last_part_and_a_small_file_in_one_request() -> None:
    buffers = PartBuffers(4)
    data = random.Random(0).randbytes(10 * PART + 123)
    writer = _DictWriter(buffers)
    _write_in_pieces(writer, data, seed=1)
    writer.commit()
    assert writer.object == data and writer.whole is None
    assert [len(writer.parts[i]) for i in range(11)] == [PART] * 10 + [123]
    assert writer.position == len(data) and writer.discarded == 0
    assert writer.threads and all(name.startswith("test-put") for name in writer.threads)

    small = _DictWriter(buffers)
    small.write(b"x" * (PART - 1))
    small.commit()
    assert small.whole == b"x" * (PART - 1) and small.parts == {} and small.threads == set()
    empty = _DictWriter(buffers)
    empty.commit()
    assert empty.whole == b""
    assert _pool_is_empty(buffers)


def test_a_failed_part_fails_the_file_and_every_buffer_comes_back() -> None:
    buffers = PartBuffers(4)
    writer = _DictWriter(buffers, fail_at=3)
    data = bytes(20 * PART)
    with pytest.raises(OSError, match="part 3 of file.bin: connection reset"):
        with writer:  # the error surfaces at a later write or at the commit; leaving the block aborts
            _write_in_pieces(writer, data, seed=2)
            writer.commit()
    assert writer.discarded == 1 and writer.parts == {} and writer.object is None
    assert writer._pool is None and _pool_is_empty(buffers)
    writer.abort()  # again: nothing more
    assert writer.discarded == 1


def test_a_refused_part_gives_its_buffer_back() -> None:
    buffers = PartBuffers(2)
    writer = _DictWriter(buffers, max_parts=2)
    with pytest.raises(ValueError, match="file.bin needs more than 2 parts"):
        with writer:
            writer.write(bytes(5 * PART))
    assert writer.discarded == 1 and _pool_is_empty(buffers)
    # The pool of 2 buffers serves the next file in full: none was lost.
    next_file = _DictWriter(buffers)
    next_file.write(bytes(6 * PART))
    next_file.commit()
    assert next_file.object == bytes(6 * PART) and _pool_is_empty(buffers)
