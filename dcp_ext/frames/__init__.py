"""The stored-data format: frames of each item with their checksums, the frame encoder and decoder."""

from __future__ import annotations

from ._base_item import HASH_BYTES, BaseItem
from ._frames import (
    CHECKSUM,
    FrameEncoder,
    FrameReader,
    FrameSpan,
    FrameStats,
    FrameTable,
    FrameWork,
    ItemRead,
    checksum,
    checksum_fault,
    frame_fault,
    frame_table,
)

__all__ = [
    "BaseItem",
    "CHECKSUM",
    "FrameEncoder",
    "FrameReader",
    "FrameSpan",
    "FrameStats",
    "FrameTable",
    "FrameWork",
    "HASH_BYTES",
    "ItemRead",
    "checksum",
    "checksum_fault",
    "frame_fault",
    "frame_table",
]
