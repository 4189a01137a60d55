"""Writes version 3's chunk table from integer columns, compressing as it goes.

The table (see :mod:`dcp_ext.metadata.chunk_table` for its layout) holds, per
key, its chunks' offsets and sizes and their stored items' eight columns. At
tens of millions of chunks it is gigabytes of integers, so each key's block
goes straight into the compressor: the coordinator never holds the whole
uncompressed table.

Called by the coordinator only (from ``encode_metadata``).
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np

__all__ = ["TableEncoder"]

_ITEM_COLUMNS = 8


class TableEncoder:
    """Appends keys' rows to the compressed chunk table."""

    def __init__(self) -> None:
        self._compress: Any
        try:
            import zstandard
        except ImportError:
            self.codec = "zlib"
            self._compress = zlib.compressobj(1)
        else:
            self.codec = "zstd"
            self._compress = zstandard.ZstdCompressor(level=3).compressobj()
        self._parts: list[bytes] = []
        self._integers = 0

    def add(self, offsets: np.ndarray | None, sizes: np.ndarray | None, items: np.ndarray) -> list[int]:
        """Append one key's rows; returns its ``table`` entry ``[first, rows]``.

        Args:
            offsets: ``(rows, ndim)`` chunk offsets (``None`` for a bytes value).
            sizes: ``(rows, ndim)`` chunk sizes (``None`` for a bytes value).
            items: ``(rows, 8)`` stored-item columns.
        """
        rows = len(items)
        if items.shape != (rows, _ITEM_COLUMNS):
            raise ValueError(f"a key's stored items must be {_ITEM_COLUMNS} columns, not {items.shape}")
        blocks = [items]
        if offsets is not None and sizes is not None:
            if offsets.shape != sizes.shape or len(offsets) != rows:
                raise ValueError(f"a key's chunk offsets {offsets.shape}, sizes {sizes.shape} and items differ in rows")
            blocks = [offsets, sizes, items]
        first = self._integers
        block = np.concatenate([b.T for b in blocks], axis=0).astype("<i8", copy=False)
        self._parts.append(self._compress.compress(np.ascontiguousarray(block).tobytes()))
        self._integers += block.size
        return [first, rows]

    def finish(self) -> tuple[str, str, int]:
        """The ``chunk_table`` field (base64 of the compressed integers), its
        ``chunk_table_codec`` and its uncompressed bytes."""
        self._parts.append(self._compress.flush())
        packed = b"".join(self._parts)
        self._parts = []
        return base64.b64encode(packed).decode("ascii"), self.codec, self._integers * 8


