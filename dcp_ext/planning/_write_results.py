"""What each rank reports after writing its data, as tables instead of objects.

In a ``dcp.save`` every rank returns its ``WriteResult`` list and the
coordinator unpickles all of them to write the metadata. One result per
item (a ``StoredItem`` and a ``MetadataIndex``, some 600 bytes in memory) is
millions of objects at a few thousand ranks. Here a rank reports one
:class:`RankWriteResults`: its files with their frame indexes, its codecs,
and one zlib-compressed row of nine integers per item. The coordinator
(:func:`gather_stored`) lines the rows up with the checkpoint's chunks by the
:class:`~dcp_ext.planning._global_plan.ChunkWriters` its planning recorded, giving
:class:`~dcp_ext.metadata.stored_columns.StoredColumns`, from which the metadata's chunk table is written
column by column, and which is also the ``storage_data`` the save returns
(a read-only mapping, ``StoredItem`` built on access, pickled as arrays).

Used for metadata version 3 when the save was planned by
:class:`~dcp_ext.planners.LayoutSavePlanner`; otherwise the writer reports
one ``WriteResult`` per item as DCP does.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import PlanMismatchError
from ..metadata.chunk_columns import ChunkColumns, as_columns
from ..metadata.document import FrameIndexRef, StoredItem
from ..metadata.stored_columns import ITEM_COLUMNS, StoredColumns
from ._global_plan import ChunkWriters

__all__ = [
    "RESULTS_INDEX",
    "RankWriteResults",
    "pack_results",
    "gather_stored",
    "collect_stored",
]

#: The index of the one ``WriteResult`` a rank returns with a :class:`RankWriteResults`.
RESULTS_INDEX = MetadataIndex("dcp_ext write results")
_ROW = 1 + len(ITEM_COLUMNS)  # the item's position in the rank's final plan, then ITEM_COLUMNS


@dataclasses.dataclass(frozen=True)
class RankWriteResults:
    """One rank's write results.

    Attributes:
        files: Each data file it wrote, with where its frame index lies.
        codecs: The codec transform descriptors its rows use (``codec`` column
            ``k`` means ``codecs[k - 1]``, ``0`` none).
        rows: zlib-compressed int64 rows: the item's position in the rank's
            final plan, then :data:`ITEM_COLUMNS` (``file`` indexes ``files``).
        count: Rows.
        references: Incremental saves: each earlier checkpoint's file its
            frames refer to, with the stored bytes referred to.
    """

    files: tuple[tuple[str, FrameIndexRef], ...]
    codecs: tuple[tuple[str, ...], ...]
    rows: bytes
    count: int
    references: tuple[tuple[str, int], ...] = ()

    def row_array(self) -> np.ndarray:
        """The rows as an ``(count, 9)`` int64 array.

        Raises:
            ValueError: They do not decompress to ``count`` rows.
        """
        try:
            raw = zlib.decompress(self.rows)
        except zlib.error as err:
            raise ValueError(f"a rank's write results are corrupt: {err}") from err
        rows = np.frombuffer(raw, dtype=np.int64)
        if rows.size != self.count * _ROW:
            raise ValueError(f"a rank's write results hold {rows.size} integers for {self.count} rows")
        return rows.reshape(self.count, _ROW)


def pack_results(
    positions: Sequence[int], stored: Sequence[StoredItem], references: Mapping[str, int] | None = None
) -> list[WriteResult]:
    """(each rank) Its write results as the one ``WriteResult`` the coordinator expects.

    Args:
        positions: Each stored item's position in the rank's final plan.
        stored: Where each went (version 3: frame tables in the files' indexes).
        references: Incremental saves: bytes referred to per earlier checkpoint's file.

    Raises:
        ValueError: An item has no frame index (it was not written for version 3).
    """
    files: dict[str, int] = {}
    refs: list[tuple[str, FrameIndexRef]] = []
    codecs: dict[tuple[str, ...], int] = {}
    rows = np.empty((len(stored), _ROW), dtype=np.int64)
    for i, (position, item) in enumerate(zip(positions, stored, strict=True)):
        file_id = files.get(item.relative_path)
        if file_id is None:
            if item.frame_index is None:
                raise ValueError(f"item in {item.relative_path!r} has no frame index (version 3 needs one)")
            file_id = files[item.relative_path] = len(refs)
            refs.append((item.relative_path, item.frame_index))
        codec = codecs.setdefault(item.transforms, len(codecs) + 1) if item.transforms else 0
        rows[i] = (
            position, file_id, item.offset, item.length, item.data_offset, item.data_length,
            item.raw_length if item.transforms else -1, codec, item.frame_size,
        )
    results = RankWriteResults(
        files=tuple(refs),
        codecs=tuple(c for c, _ in sorted(codecs.items(), key=lambda kv: kv[1])),
        rows=zlib.compress(rows.tobytes(), 1),
        count=len(stored),
        references=tuple(sorted((references or {}).items())),
    )
    return [WriteResult(index=RESULTS_INDEX, size_in_bytes=sum(s.length for s in stored), storage_data=results)]


def is_packed(results: Sequence[Sequence[WriteResult]]) -> bool:
    """Whether every rank reported a :class:`RankWriteResults`."""
    return bool(results) and all(
        len(r) == 1 and isinstance(r[0].storage_data, RankWriteResults) for r in results
    )


def gather_stored(
    writers: ChunkWriters, chunks: dict[str, ChunkColumns | None], results: Sequence[Sequence[WriteResult]]
) -> StoredColumns:
    """(coordinator) The ranks' packed results lined up with the metadata's chunks.

    Args:
        writers: Which rank's item each chunk is (from the global plan).
        chunks: Per key, its chunks (``None`` for bytes values).
        results: Every rank's results (each one :class:`RankWriteResults`).

    Raises:
        ValueError: A rank's results are malformed, or lack a chunk the plan gave it.
    """
    world = len(results)
    packed = [r[0].storage_data for r in results]
    counts = np.array([p.count for p in packed], dtype=np.int64)
    base = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(counts, out=base[1:])
    files: list[tuple[str, int, FrameIndexRef]] = []
    codecs: dict[tuple[str, ...], int] = {}
    every = np.empty((int(base[-1]), _ROW), dtype=np.int64)
    for rank, part in enumerate(packed):
        rows = part.row_array()
        if rows.size:
            # Line rows up by their item's position in the final plan.
            order = np.argsort(rows[:, 0], kind="stable")
            rows = rows[order]
            if not np.array_equal(rows[:, 0], np.arange(part.count)):
                raise ValueError(f"rank {rank}'s write results do not number its items 0..{part.count - 1}")
            if int(rows[:, 1].min()) < 0 or int(rows[:, 1].max()) >= len(part.files):
                raise ValueError(f"rank {rank}'s write results name a file it does not list")
            rows[:, 1] += len(files)
            if part.codecs:
                lookup = np.array([0] + [codecs.setdefault(c, len(codecs) + 1) for c in part.codecs], dtype=np.int64)
                if int(rows[:, 7].max()) >= len(lookup) or int(rows[:, 7].min()) < 0:
                    raise ValueError(f"rank {rank}'s write results name a codec it does not list")
                rows[:, 7] = lookup[rows[:, 7]]
            every[base[rank] : base[rank + 1]] = rows
        files.extend((name, ref.at + ref.length, ref) for name, ref in part.files)
    ranks, positions = writers.ranks, writers.positions
    if len(ranks) and (int(positions.max(initial=0)) < 0 or bool((positions >= counts[ranks]).any())):
        bad = int(np.flatnonzero(positions >= counts[ranks])[0])
        raise ValueError(f"rank {int(ranks[bad])} reported no write result for its item #{int(positions[bad])}")
    rows = every[base[ranks] + positions, 1:]
    del every
    stored = StoredColumns(
        writers.spans, chunks, rows, files, [c for c, _ in sorted(codecs.items(), key=lambda kv: kv[1])]
    )
    for part in packed:
        for name, nbytes in part.references:
            stored.references[name] = stored.references.get(name, 0) + nbytes
    return stored


def collect_stored(
    metadata: Metadata, results: Sequence[Sequence[WriteResult]]
) -> StoredColumns | dict[MetadataIndex, StoredItem]:
    """(coordinator, ``CheckpointWriter.finish``) Where every chunk went:
    lined up with the planned chunks when the ranks packed their results,
    else one entry per result, keyed by its index.

    Raises:
        ValueError: The ranks packed their results but the metadata does not
            record which rank wrote which chunk, or a rank's results are malformed.
    """
    if not is_packed(results):
        items: dict[MetadataIndex, StoredItem] = {}
        for rank_results in results:
            for result in rank_results:
                items[result.index] = result.storage_data
        _check_item_sizes(metadata, items)
        return items
    writers = metadata.storage_data
    if not isinstance(writers, ChunkWriters):
        raise ValueError(
            "the ranks packed their write results but the metadata does not say which rank "
            "wrote which chunk; was the save planned by dcp_ext's LayoutSavePlanner?"
        )
    chunks: dict[str, ChunkColumns | None] = {
        fqn: as_columns(md.chunks, len(md.size)) if isinstance(md, TensorStorageMetadata) else None
        for fqn, md in metadata.state_dict_metadata.items()
    }
    stored = gather_stored(writers, chunks, results)
    _check_raw_sizes(metadata, stored)
    return stored


def _check_item_sizes(metadata: Metadata, items: Mapping[MetadataIndex, StoredItem]) -> None:
    """:func:`_check_raw_sizes` for results reported one item at a time."""
    by_offsets: dict[str, dict[tuple[int, ...], Any]] = {}
    for index, item in items.items():
        md = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(md, TensorStorageMetadata) or not isinstance(item, StoredItem) or index.offset is None:
            continue
        offsets = tuple(index.offset)
        known = by_offsets.get(index.fqn)
        if known is None:
            known = by_offsets[index.fqn] = {tuple(c.offsets): c for c in md.chunks}
        chunk = known.get(offsets)
        if chunk is None:
            continue  # a result the metadata has no chunk for: the commit's own checks refuse it
        expected = math.prod(chunk.sizes) * torch.empty((), dtype=md.properties.dtype).element_size()
        got = item.raw_length if item.transforms else item.data_length
        if got != expected:
            raise PlanMismatchError(
                f"tensor {index.fqn!r}, chunk at offsets {offsets}: a rank stored {got} bytes, but the metadata "
                f"records {md.properties.dtype} of shape {tuple(chunk.sizes)} ({expected} bytes); nothing was committed"
            )


def _check_raw_sizes(metadata: Metadata, stored: StoredColumns) -> None:
    """(coordinator, before the commit) Every tensor chunk holds the raw bytes
    its metadata entry describes: elements of the chunk's shape times the
    recorded dtype's size. A rank that stored another dtype or shape than
    the plan's (a stale cached plan) is caught here at the latest.

    Raises:
        PlanMismatchError: Naming the first key and chunk that differ.
    """
    rows = stored.rows
    if not len(rows):
        return
    raw = np.where(rows[:, 5] >= 0, rows[:, 5], rows[:, 4])
    for fqn, (start, stop) in stored.spans.items():
        boxes = stored.chunks.get(fqn)
        md = metadata.state_dict_metadata.get(fqn)
        if boxes is None or not isinstance(md, TensorStorageMetadata):
            continue
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        expected = np.prod(boxes.sizes, axis=1, dtype=np.int64) * itemsize if len(boxes) else np.zeros(0, np.int64)
        got = raw[start:stop]
        if got.shape == expected.shape and bool((got == expected).all()):
            continue
        bad = int(np.flatnonzero(got != expected)[0]) if got.shape == expected.shape else 0
        found = int(got[bad]) if bad < len(got) else None
        raise PlanMismatchError(
            f"tensor {fqn!r}, chunk at offsets {tuple(boxes.offsets[bad].tolist())}: a rank stored {found} bytes, "
            f"but the metadata records {md.properties.dtype} of shape {tuple(boxes.sizes[bad].tolist())} "
            f"({int(expected[bad])} bytes); nothing was committed"
        )
