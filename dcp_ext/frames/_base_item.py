"""What an incremental save knows of one item's frames in its base: :class:`BaseItem`.

Built by :func:`dcp_ext.incremental.read_base` from the base's frame indexes,
handed to :class:`~dcp_ext.frames.FrameEncoder`, which refers to a frame
instead of writing it when its raw hash matches.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HASH_BYTES", "BaseItem"]

#: Bytes of a frame's content hash (xxh3-128 of its raw bytes).
HASH_BYTES = 16


@dataclass(frozen=True)
class BaseItem:
    """One stored item of the base checkpoint, as the next save compares with it.

    Attributes:
        frame_size: Raw bytes per frame.
        transforms: Its codec's transform descriptors (``()``: raw).
        raw_size: Raw bytes of the item.
        hashes: xxh3-128 of each frame's raw bytes (16 bytes each).
        checksums: xxh3-64 of each frame's stored bytes.
        lengths: Stored bytes of each frame.
        offsets: Where each frame's stored bytes start in the file holding them.
        sources: That file, as a reference name from a sibling checkpoint.
    """

    frame_size: int
    transforms: tuple[str, ...]
    raw_size: int
    hashes: bytes
    checksums: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    sources: tuple[str, ...]

    def matches(self, frame_size: int, transforms: tuple[str, ...], raw_size: int) -> bool:
        """Whether frames written with these settings line up with this item's."""
        return (self.frame_size, self.transforms, self.raw_size) == (frame_size, transforms, raw_size)

    def hash_of(self, k: int) -> bytes:
        return self.hashes[HASH_BYTES * k : HASH_BYTES * (k + 1)]
