"""Where every chunk of a checkpoint lives, as columns aligned with its metadata: :class:`StoredColumns`.

The ``storage_data`` of a save planned by
:class:`~dcp_ext.planners.LayoutSavePlanner` (gathered from the ranks' write
results by :func:`dcp_ext.planning.gather_stored`), from which version 3's
chunk table is written column by column (:func:`dcp_ext.metadata.encode_metadata`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from .chunk_columns import ChunkColumns, pack_array, unpack_array
from .document import FrameIndexRef, StoredItem

__all__ = ["ITEM_COLUMNS", "StoredColumns"]

#: A stored item's columns in :class:`StoredColumns` (and in version 3's chunk table).
ITEM_COLUMNS = ("file", "at", "length", "data_at", "data_length", "raw_length", "codec", "frame")


class StoredColumns(Mapping[MetadataIndex, StoredItem]):
    """Where every chunk of a checkpoint lives, as columns aligned with its metadata.

    Args:
        spans: Per key, in metadata order, its rows ``[start, stop)``.
        chunks: Per key, its chunks (the metadata's ``ChunkColumns``; ``None`` for bytes values).
        rows: ``(chunks, 8)`` int64 :data:`ITEM_COLUMNS`.
        files: Each data file: ``(name, size, frame index)``.
        codecs: Codec descriptors (``codec`` column ``k`` is ``codecs[k - 1]``).
    """

    def __init__(
        self,
        spans: dict[str, tuple[int, int]],
        chunks: dict[str, ChunkColumns | None],
        rows: np.ndarray,
        files: Sequence[tuple[str, int, FrameIndexRef]],
        codecs: Sequence[tuple[str, ...]],
    ) -> None:
        self.spans, self.chunks = spans, chunks
        self._rows: np.ndarray | None = rows
        self._packed = b""
        self._count = len(rows)
        self.files, self.codecs = list(files), list(codecs)
        self._row_of: dict[str, dict[tuple[int, ...], int]] = {}
        #: Incremental saves: stored bytes referred to per earlier checkpoint's file, over all ranks.
        self.references: dict[str, int] = {}

    @property
    def rows(self) -> np.ndarray:
        """``(chunks, 8)`` int64 :data:`ITEM_COLUMNS`, in the metadata's chunk order."""
        if self._rows is None:
            self._rows = unpack_array(self._packed, (self._count, len(ITEM_COLUMNS)))
            self._packed = b""
        return self._rows

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        span = self.spans.get(index.fqn)
        if span is None:
            raise KeyError(index)
        boxes = self.chunks.get(index.fqn)
        if boxes is None:
            if index.offset is not None:
                raise KeyError(index)
            return self.item(span[0])
        if index.offset is None:
            raise KeyError(index)
        rows = self._row_of.get(index.fqn)
        if rows is None:
            rows = self._row_of[index.fqn] = {tuple(o): k for k, o in enumerate(boxes.offsets.tolist())}
        found = rows.get(tuple(int(o) for o in index.offset))
        if found is None:
            raise KeyError(index)
        return self.item(span[0] + found)

    def item(self, row: int) -> StoredItem:
        """The ``StoredItem`` of one row."""
        file_id, at, length, data_at, data_length, raw_length, codec, frame = self.rows[row].tolist()
        name, _, ref = self.files[file_id]
        return StoredItem(
            name, at, length, data_at, data_length, raw_length, self.codecs[codec - 1] if codec else (),
            frame, indexed=True, frame_index=ref,
        )

    def _indexes(self, fqn: str) -> list[MetadataIndex]:
        boxes = self.chunks.get(fqn)
        return [MetadataIndex(fqn)] if boxes is None else [MetadataIndex(fqn, box) for box in boxes.offsets.tolist()]

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn in self.spans:
            yield from self._indexes(fqn)

    def __len__(self) -> int:
        return self._count

    def items(self) -> Iterator[tuple[MetadataIndex, StoredItem]]:  # type: ignore[override]
        """Every ``(index, item)``, built key by key (much faster than looking each up)."""
        for fqn, (a, b) in self.spans.items():
            yield from zip(self._indexes(fqn), self._items(a, b))

    def values(self) -> Iterator[StoredItem]:  # type: ignore[override]
        for a, b in self.spans.values():
            yield from self._items(a, b)

    def _items(self, a: int, b: int) -> list[StoredItem]:
        files, codecs = self.files, self.codecs
        return [
            StoredItem(files[f][0], at, length, data_at, data_length, raw_length, codecs[codec - 1] if codec else (),
                       frame, indexed=True, frame_index=files[f][2])
            for f, at, length, data_at, data_length, raw_length, codec, frame in self.rows[a:b].tolist()
        ]

    def __reduce__(self) -> tuple[Any, ...]:
        # dcp.save broadcasts the metadata to every rank: the columns go compressed.
        # The chunks' offsets are the metadata's ChunkColumns, pickled once with it.
        rows = self._packed if self._rows is None else pack_array(self._rows)
        return (_stored_columns, (self.spans, self.chunks, rows, self._count, self.files, self.codecs))


def _stored_columns(spans: dict[str, tuple[int, int]], chunks: dict[str, ChunkColumns | None], rows: bytes,
                    count: int, files: list[tuple[str, int, FrameIndexRef]], codecs: list[tuple[str, ...]]) -> StoredColumns:
    stored = StoredColumns(spans, chunks, np.empty((0, len(ITEM_COLUMNS)), dtype=np.int64), files, codecs)
    stored._rows, stored._packed, stored._count = None, rows, count  # unpacked when first used
    return stored
