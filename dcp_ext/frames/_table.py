"""Where an item's frames are: their spans, stored lengths and checksums.

:class:`FrameTable` answers which frames cover a raw byte range and where
each frame's stored bytes lie (its own data file, or for incremental saves an
earlier checkpoint's); :func:`checksum` is the frames' checksum (xxh3-64).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import xxhash

from ..format import check_descriptors
from ..metadata import StoredItem

__all__ = ["CHECKSUM", "checksum", "FrameSpan", "FrameTable", "frame_table"]

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
        file: The file holding the stored bytes: the item's own data file,
            or (incremental saves) a reference to an earlier checkpoint's
            (:func:`~dcp_ext.metadata.document.reference_name`).
    """

    index: int
    count: int
    raw_start: int
    raw_length: int
    stored_offset: int
    stored_length: int
    checksum: int | None
    file: str = ""

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
        if self._starts is None:
            stored_length = raw_length
            stored_start = raw_start
        else:
            stored_start = self._starts[k]
            stored_length = self._starts[k + 1] - stored_start
        crc = item.checksums[k] if item.checksums else None
        if item.frame_offsets:  # incremental saves: each frame where it lies, maybe in an earlier save's file
            source = item.frame_sources[k] if item.frame_sources else ""
            return FrameSpan(k, self.count, raw_start, raw_length, item.frame_offsets[k], stored_length, crc,
                             source or item.relative_path)
        stored_offset = item.offset + item.data_offset + stored_start
        return FrameSpan(k, self.count, raw_start, raw_length, stored_offset, stored_length, crc, item.relative_path)

    def covering(self, raw_start: int, raw_end: int) -> range:
        """Indices of the frames holding raw bytes ``[raw_start, raw_end)``."""
        if raw_end <= raw_start:
            return range(0)
        return range(raw_start // self.frame_size, -(-raw_end // self.frame_size))

    def __len__(self) -> int:
        return self.count


def frame_table(item: StoredItem, where: str) -> FrameTable:
    """The frames of ``item``, after checking that its codec chain is known.

    Raises:
        UnsupportedCodecError: A transform this dcp_ext cannot decode.
    """
    if item.indexed:
        raise RuntimeError(f"{where}: the frame index of this file was not read before its frames")
    if item.transforms:
        check_descriptors(item.transforms, where)
    return FrameTable(item)
