"""Frames: the unit in which stored data is compressed, checksummed and verified.

Every stored item's raw data (a tensor chunk's bytes, or a bytes object) is cut
into frames of ``frame_size`` raw bytes (the last one shorter). Each frame's
*stored* bytes carry an xxh3-64 checksum computed while writing. Uncompressed
frames are stored as they are, back to back, so frame ``k`` of an item is at
``data start + k * frame_size``; compressed frames have their stored lengths
recorded, and their positions are the running sum. Pure logic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import xxhash

from ._metadata_format import StoredItem

__all__ = ["CHECKSUM", "checksum", "FrameSpan", "FrameTable"]

CHECKSUM = "xxh3-64"


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum of stored bytes (xxh3-64 as an unsigned integer)."""
    return int(xxhash.xxh3_64_intdigest(data))


@dataclass(frozen=True, slots=True)
class FrameSpan:
    """One frame of a stored item.

    Attributes:
        index: Position of the frame in its item.
        count: Frames in the item.
        raw_start: Offset of its first raw byte within the item's raw data.
        raw_length: Raw bytes it holds once decoded.
        stored_offset: Absolute byte offset of its stored bytes in the file.
        stored_length: Stored bytes.
        checksum: Checksum of the stored bytes, or ``None`` (checkpoints
            written before checksums existed).
    """

    index: int
    count: int
    raw_start: int
    raw_length: int
    stored_offset: int
    stored_length: int
    checksum: int | None

    @property
    def raw_end(self) -> int:
        return self.raw_start + self.raw_length


class FrameTable:
    """Where the frames of one stored item are, and which cover a raw range."""

    __slots__ = ("item", "raw_size", "frame_size", "count", "_starts")

    def __init__(self, item: StoredItem) -> None:
        self.item = item
        self.raw_size = item.raw_size
        self.frame_size = item.frame_size or max(self.raw_size, 1)
        if item.transforms:
            self.count = len(item.frame_lengths)
            self._starts: list[int] | None = [0, *accumulate(item.frame_lengths)]
        else:
            self.count = -(-self.raw_size // self.frame_size)
            self._starts = None

    def frame(self, k: int) -> FrameSpan:
        """Frame ``k`` (0-based)."""
        item = self.item
        raw_start = k * self.frame_size
        raw_length = min(self.frame_size, self.raw_size - raw_start)
        base = item.offset + item.data_offset
        if self._starts is None:
            stored_offset, stored_length = base + raw_start, raw_length
        else:
            stored_offset = base + self._starts[k]
            stored_length = self._starts[k + 1] - self._starts[k]
        crc = item.checksums[k] if item.checksums else None
        return FrameSpan(k, self.count, raw_start, raw_length, stored_offset, stored_length, crc)

    def covering(self, raw_start: int, raw_end: int) -> range:
        """Indices of the frames holding raw bytes ``[raw_start, raw_end)``."""
        if raw_end <= raw_start:
            return range(0)
        return range(raw_start // self.frame_size, -(-raw_end // self.frame_size))

    def __len__(self) -> int:
        return self.count

