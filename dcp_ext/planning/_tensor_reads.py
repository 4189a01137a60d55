"""A loading rank's reads of one tensor, computed on the saved chunks' columns.

Version-3 metadata gives each tensor's saved chunks as a
:class:`~dcp_ext.metadata.chunk_columns.ChunkColumns` (two int64 arrays).
torch's ``create_read_items_for_chunk_list`` walks them one Python object at
a time: for a 405B model with Adam state saved by 8,192 ranks that is about
22 million chunks, built and compared on every loading rank. Here the overlap
of the rank's local chunks (usually one) with all saved chunks of a key is a
few numpy operations over the columns, and Python objects are built only for
the ``ReadItem`` objects the rank gets.

:func:`read_items_for_columns` returns exactly torch's ``ReadItem`` objects
(indexes with their hints, offsets, lengths, order);
:func:`match_chunk` finds the saved chunk equal to a local one (the
same-partition fast path); :class:`ChunkShapes` answers "what is the dtype
and shape of the chunk this read item reads from" without indexing every
chunk of the checkpoint.

All functions run on every loading rank, during ``create_local_plan``
(planning) and ``read_data`` (the reader's checks).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from ..metadata.chunk_columns import ChunkColumns

__all__ = ["ChunkShapes", "match_chunk", "read_items_for_columns"]


def read_items_for_columns(
    fqn: str, saved: ChunkColumns, local_chunks: Sequence[ChunkStorageMetadata]
) -> list[ReadItem]:
    """(every loading rank, planning) The reads that fill ``local_chunks`` from ``saved``.

    Equal to ``create_read_items_for_chunk_list(fqn, md, local_chunks)`` for
    ``md.chunks == saved``, item for item and in the same order: one
    ``ReadItem`` per (local chunk, saved chunk) pair that overlap in every
    dimension (a zero-size chunk strictly inside another counts, as in torch).

    Args:
        fqn: The key.
        saved: Its saved chunks.
        local_chunks: The chunks this rank holds (``_create_chunk_list``).

    Raises:
        ValueError: The local and saved chunks have different dimensions.
    """
    if not local_chunks or not len(saved):
        return []
    ndim = len(local_chunks[0].offsets)
    if saved.ndim != ndim:
        raise ValueError(f"{fqn!r}: local chunks have {ndim} dimensions, the saved chunks {saved.ndim}")
    count = len(local_chunks)
    if count == 1 and len(saved) == 1:  # one chunk each (an unsharded load): no arrays needed
        return _one_to_one(fqn, saved, local_chunks[0], ndim)
    local_offsets = np.array([tuple(c.offsets) for c in local_chunks], dtype=np.int64).reshape(count, ndim)
    local_ends = local_offsets + np.array([tuple(c.sizes) for c in local_chunks], dtype=np.int64).reshape(count, ndim)
    # Column by column: numpy reduces an (n, 2) array along its short axis
    # ~20x slower than it compares two length-n columns. Only the first
    # dimension is compared over every saved chunk; the others over the rows
    # still in play.
    sweep = _torch_sweeps() and ndim > 0
    sweep_dim: int | None = None

    def sweep_order(keys: list[np.ndarray]) -> np.ndarray:
        """The stable order of ``keys[sweep dimension]``. torch sweeps along
        the first dimension of the largest extent; finding it walks every
        saved chunk, so only when the dimensions' orders differ."""
        nonlocal sweep_dim
        orders = [np.argsort(k, kind="stable") for k in keys]
        if all(np.array_equal(orders[0], o) for o in orders[1:]):
            return orders[0]
        if sweep_dim is None:
            extents = [
                max(int((saved.offsets[:, d] + saved.sizes[:, d]).max()), int(local_ends[:, d].max()))
                for d in range(ndim)
            ]
            sweep_dim = extents.index(max(extents))
        return orders[sweep_dim]

    order: Sequence[int] = range(count)
    if sweep and count > 1:  # torch takes local chunks by start along the sweep dimension
        order = sweep_order([local_offsets[:, d] for d in range(ndim)]).tolist()
    items: list[ReadItem] = []
    for local in order:
        start, end = local_offsets[local], local_ends[local]
        hits: np.ndarray | None = None  # the rows overlapping in every dimension so far
        for d in range(ndim):
            if hits is None or len(hits) == len(saved):
                offsets_d = saved.offsets[:, d]
                hits = np.flatnonzero((start[d] < offsets_d + saved.sizes[:, d]) & (offsets_d < end[d]))
            else:
                offsets_d = saved.offsets[hits, d]
                hits = hits[(start[d] < offsets_d + saved.sizes[hits, d]) & (offsets_d < end[d])]
            if not len(hits):
                break
        if hits is None:  # a scalar: every saved chunk
            hits = np.arange(len(saved))
        if not len(hits):
            continue
        if sweep and len(hits) > 1:  # and saved chunks by end along it
            ends = saved.offsets[hits] + saved.sizes[hits]
            hits = hits[sweep_order([ends[:, d] for d in range(ndim)])]
        hit_offsets = saved.offsets[hits]
        hit_ends = hit_offsets + saved.sizes[hits]
        after = hit_offsets > start
        storage_offsets = np.where(after, 0, start - hit_offsets)
        dest_offsets = np.where(after, hit_offsets - start, 0)
        lengths = np.minimum(hit_ends, end) - np.maximum(hit_offsets, start)
        dest_index = MetadataIndex(fqn, local_chunks[local].offsets, local)
        for row, offsets, into, at, length in zip(
            hits.tolist(), hit_offsets.tolist(), dest_offsets.tolist(), storage_offsets.tolist(), lengths.tolist()
        ):
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=dest_index,
                    dest_offsets=torch.Size(into),
                    storage_index=MetadataIndex(fqn, offsets, row),
                    storage_offsets=torch.Size(at),
                    lengths=torch.Size(length),
                )
            )
    return items


def _one_to_one(fqn: str, saved: ChunkColumns, local: ChunkStorageMetadata, ndim: int) -> list[ReadItem]:
    """:func:`read_items_for_columns` for one local and one saved chunk (the same items, built directly)."""
    start, size = tuple(int(o) for o in local.offsets), tuple(int(n) for n in local.sizes)
    offsets = tuple(int(o) for o in saved.offsets[0].tolist())
    ends = tuple(int(o + n) for o, n in zip(offsets, saved.sizes[0].tolist()))
    lengths = []
    for d in range(ndim):
        lo, hi = max(start[d], offsets[d]), min(start[d] + size[d], ends[d])
        # Overlap as torch counts it: strict on both sides (a zero-size chunk inside the other counts).
        if not (start[d] < ends[d] and offsets[d] < start[d] + size[d]):
            return []
        lengths.append(hi - lo)
    return [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn, local.offsets, 0),
            dest_offsets=torch.Size(max(o - s, 0) for o, s in zip(offsets, start)),
            storage_index=MetadataIndex(fqn, offsets, 0),
            storage_offsets=torch.Size(max(s - o, 0) for o, s in zip(offsets, start)),
            lengths=torch.Size(lengths),
        )
    ]


@functools.cache
def _torch_sweeps() -> bool:
    """Whether the installed torch orders read items by its sweep line.

    torch's ``create_read_items_for_chunk_list`` took local chunks, then saved
    chunks, in list order until it became a sweep line (pytorch#169115,
    torch 2.10), which takes local chunks by start and saved chunks by end
    along the sweep dimension. The items are the same, the order is not; this
    asks torch once, on two local and two saved chunks whose orders differ.
    """
    def chunk(offset: int, size: int) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(torch.Size([offset]), torch.Size([size]))

    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), [chunk(2, 2), chunk(0, 2)])
    items = create_read_items_for_chunk_list("probe", md, [chunk(1, 3), chunk(0, 1)])
    return [(i.dest_index.index, i.storage_index.index) for i in items] != [(0, 0), (0, 1), (1, 1)]


def match_chunk(chunks: Sequence[ChunkStorageMetadata], offsets: Sequence[int], sizes: Sequence[int]) -> int | None:
    """(every loading rank, planning) The position of the saved chunk with
    these offsets and sizes (the first, if several), or ``None``.

    On :class:`ChunkColumns` this is one comparison of the columns; on a
    list, a walk through it.
    """
    offsets, sizes = tuple(offsets), tuple(sizes)
    if isinstance(chunks, ChunkColumns):
        if chunks.ndim != len(offsets) or not len(chunks):
            return None
        if not offsets:
            return 0
        found = np.flatnonzero(chunks.offsets[:, 0] == offsets[0])
        for d in range(len(offsets)):  # column by column (see read_items_for_columns)
            found = found[(chunks.offsets[found, d] == offsets[d]) & (chunks.sizes[found, d] == sizes[d])]
        return int(found[0]) if len(found) else None
    for row, chunk in enumerate(chunks):
        if tuple(chunk.offsets) == offsets and tuple(chunk.sizes) == sizes:
            return row
    return None


ChunkKey = tuple[str, tuple[int, ...]]
ChunkShape = tuple[torch.dtype, tuple[int, ...]]


class ChunkShapes(Mapping[ChunkKey, ChunkShape]):
    """``(key, chunk offsets) -> (dtype, chunk sizes)`` of a checkpoint's saved
    tensor chunks, looked up without indexing them all.

    :meth:`of` takes a read item's ``storage_index``: its ``index`` hint (the
    chunk's position, which DCP's and dcp_ext's planners set) is checked and
    used directly. A look-up without a usable hint indexes that key's chunks
    once. Iterating walks every chunk (tools only).

    Args:
        state_dict_metadata: ``Metadata.state_dict_metadata``.
    """

    def __init__(self, state_dict_metadata: Mapping[str, Any]) -> None:
        self._tensors = {k: v for k, v in state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self._rows: dict[str, dict[tuple[int, ...], int]] = {}

    def of(self, index: MetadataIndex) -> ChunkShape | None:
        """(every loading rank, reading) Dtype and sizes of the saved chunk
        ``index`` names, or ``None`` when there is none."""
        return self._find(index.fqn, tuple(index.offset or ()), index.index)

    def __getitem__(self, key: ChunkKey) -> ChunkShape:
        found = self._find(key[0], tuple(key[1]), None)
        if found is None:
            raise KeyError(key)
        return found

    def _find(self, fqn: str, offsets: tuple[int, ...], hint: int | None) -> ChunkShape | None:
        md = self._tensors.get(fqn)
        if md is None:
            return None
        chunks = md.chunks
        row = hint
        if isinstance(chunks, ChunkColumns):
            # On the arrays' rows: indexing the columns builds a
            # ChunkStorageMetadata of two torch.Size objects (measured: 4.3
            # against 1.5 us a read item, on every loading rank).
            if row is None or not 0 <= row < len(chunks) or tuple(chunks.offsets[row].tolist()) != offsets:
                row = self._row(fqn, chunks, offsets)
                if row is None:
                    return None
            return md.properties.dtype, tuple(chunks.sizes[row].tolist())
        if row is None or not 0 <= row < len(chunks) or tuple(chunks[row].offsets) != offsets:
            row = self._row(fqn, chunks, offsets)
            if row is None:
                return None
        return md.properties.dtype, tuple(int(s) for s in chunks[row].sizes)

    def _row(self, fqn: str, chunks: Sequence[ChunkStorageMetadata], offsets: tuple[int, ...]) -> int | None:
        """The row of ``fqn``'s chunk at ``offsets`` (its chunks indexed on first use)."""
        rows = self._rows.get(fqn)
        if rows is None:
            rows = self._rows[fqn] = _rows_by_offsets(chunks)
        return rows.get(offsets)

    def __iter__(self) -> Iterator[ChunkKey]:
        for fqn, md in self._tensors.items():
            chunks = md.chunks
            if isinstance(chunks, ChunkColumns):
                for offsets in chunks.offsets.tolist():
                    yield fqn, tuple(offsets)
            else:
                for chunk in chunks:
                    yield fqn, tuple(chunk.offsets)

    def __len__(self) -> int:
        return sum(len(md.chunks) for md in self._tensors.values())


def _rows_by_offsets(chunks: Sequence[ChunkStorageMetadata]) -> dict[tuple[int, ...], int]:
    """Each chunk's position by its offsets (the last, if several share them)."""
    if isinstance(chunks, ChunkColumns):
        return {tuple(o): row for row, o in enumerate(chunks.offsets.tolist())}
    return {tuple(c.offsets): row for row, c in enumerate(chunks)}
