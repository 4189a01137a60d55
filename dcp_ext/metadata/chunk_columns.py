"""A tensor's stored chunks as two integer arrays instead of a list of objects.

DCP describes every stored chunk of a tensor by a ``ChunkStorageMetadata``
(two ``torch.Size`` objects): about 400 bytes each. A 405B model with Adam
state saved by 8,192 ranks has over 20 million chunks, which as objects
outgrow any coordinator's memory. :class:`ChunkColumns` holds them as two
``(n, ndim)`` int64 arrays (16 bytes per dimension per chunk) and is used
where DCP expects ``TensorStorageMetadata.chunks``: it is a read-only
sequence whose items are ``ChunkStorageMetadata`` built on access, so DCP's
own code keeps working, while dcp_ext's planners and metadata encoder work on
the arrays directly. A tensor of at most :data:`KEPT_CHUNKS` chunks keeps the
objects once built (torch's ``create_read_items_for_chunk_list`` walks a
tensor's chunks three times and indexes them again: building them afresh
each time cost about 12 us a tensor, 4 ms a load of 355 tensors); like the
arrays, they are read-only by convention.

It pickles as the arrays' bytes, so a ``Metadata`` holding it travels
between ranks compactly; it never goes into torch's own ``.metadata`` pickle
(:func:`dcp_ext.metadata.to_torch_metadata` writes plain lists).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

__all__ = ["ChunkColumns", "KEPT_CHUNKS", "as_columns", "pack_array", "unpack_array"]

#: Tensors with at most this many chunks keep their ``ChunkStorageMetadata``
#: objects once built (a few KiB each); larger ones build them on each access.
KEPT_CHUNKS = 64


class ChunkColumns(Sequence[ChunkStorageMetadata]):
    """One tensor's chunks: ``offsets[i]`` and ``sizes[i]`` bound chunk ``i``.

    Args:
        offsets: ``(n, ndim)`` integer array of chunk offsets.
        sizes: ``(n, ndim)`` integer array of chunk sizes.

    Raises:
        ValueError: The arrays are not two-dimensional of one shape.
    """

    __slots__ = ("_offsets", "_sizes", "_packed", "_shape", "_kept")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        # Views are kept as they are (a decoded table's columns are not row-major): no copy.
        offsets = np.asarray(offsets, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        if offsets.ndim != 2 or offsets.shape != sizes.shape:
            raise ValueError(
                f"chunk offsets {offsets.shape} and sizes {sizes.shape} must be two arrays of shape (chunks, ndim)"
            )
        offsets = offsets.view()  # read-only views: the caller's arrays keep their flags
        sizes = sizes.view()
        offsets.flags.writeable = False
        sizes.flags.writeable = False
        self._offsets: np.ndarray | None = offsets
        self._sizes: np.ndarray | None = sizes
        self._packed: bytes | None = None
        self._shape: tuple[int, int] = (int(offsets.shape[0]), int(offsets.shape[1]))
        self._kept: tuple[ChunkStorageMetadata, ...] | None = None

    @classmethod
    def _unpickled(cls, rows: int, ndim: int, packed: bytes) -> ChunkColumns:
        """Columns whose arrays are unpacked when first used: every rank
        receives the metadata ``dcp.save`` broadcasts, few look at its chunks."""
        self = cls.__new__(cls)
        self._offsets = self._sizes = None
        self._packed = packed
        self._shape = (rows, ndim)
        self._kept = None
        return self

    def _unpack(self) -> None:
        assert self._packed is not None
        rows, ndim = self._shape
        both = unpack_array(self._packed, (rows, 2 * ndim))
        offsets, sizes = np.ascontiguousarray(both[:, :ndim]), np.ascontiguousarray(both[:, ndim:])
        offsets.flags.writeable = False
        sizes.flags.writeable = False
        self._offsets, self._sizes, self._packed = offsets, sizes, None

    @property
    def offsets(self) -> np.ndarray:
        """``(n, ndim)`` int64 chunk offsets (read-only)."""
        if self._offsets is None:
            self._unpack()
        assert self._offsets is not None
        return self._offsets

    @property
    def sizes(self) -> np.ndarray:
        """``(n, ndim)`` int64 chunk sizes (read-only)."""
        if self._sizes is None:
            self._unpack()
        assert self._sizes is not None
        return self._sizes

    @classmethod
    def of(cls, chunks: Iterable[ChunkStorageMetadata], ndim: int) -> ChunkColumns:
        """Columns holding ``chunks`` (each of ``ndim`` dimensions)."""
        if isinstance(chunks, ChunkColumns):
            return chunks
        listed = list(chunks)
        offsets = np.array([list(c.offsets) for c in listed], dtype=np.int64).reshape(len(listed), ndim)
        sizes = np.array([list(c.sizes) for c in listed], dtype=np.int64).reshape(len(listed), ndim)
        return cls(offsets, sizes)

    @property
    def ndim(self) -> int:
        """Dimensions of the tensor."""
        return self._shape[1]

    def __len__(self) -> int:
        return self._shape[0]

    @overload
    def __getitem__(self, index: int) -> ChunkStorageMetadata: ...

    @overload
    def __getitem__(self, index: slice) -> ChunkColumns: ...

    def __getitem__(self, index: int | slice) -> ChunkStorageMetadata | ChunkColumns:
        if isinstance(index, slice):
            return ChunkColumns(self.offsets[index], self.sizes[index])
        kept = self._kept_chunks()
        if kept is not None:
            return kept[index]
        return ChunkStorageMetadata(
            torch.Size(self.offsets[index].tolist()), torch.Size(self.sizes[index].tolist())
        )

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        kept = self._kept_chunks()
        if kept is not None:
            return iter(kept)
        return self._built()

    def _built(self) -> Iterator[ChunkStorageMetadata]:
        for offsets, sizes in zip(self.offsets.tolist(), self.sizes.tolist()):
            yield ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def _kept_chunks(self) -> tuple[ChunkStorageMetadata, ...] | None:
        """The chunk objects, built once, for a tensor of at most :data:`KEPT_CHUNKS` chunks."""
        if self._kept is None and self._shape[0] <= KEPT_CHUNKS:
            self._kept = tuple(self._built())
        return self._kept

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkColumns):
            return bool(np.array_equal(self.offsets, other.offsets) and np.array_equal(self.sizes, other.sizes))
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ChunkColumns({len(self)} chunks of {self.ndim} dimensions)"

    def __reduce__(self) -> tuple[Any, ...]:
        # dcp.save broadcasts the metadata holding these to every rank: compressed,
        # and unpacked on a rank only when used.
        packed = self._packed
        if packed is None:
            packed = pack_array(np.concatenate([self.offsets, self.sizes], axis=1))
        return (ChunkColumns._unpickled, (len(self), self.ndim, packed))


def pack_array(values: np.ndarray) -> bytes:
    """An int64 array's little-endian bytes, zstd-compressed (fast: level 1)."""
    import zstandard

    return zstandard.ZstdCompressor(level=1).compress(np.ascontiguousarray(values, dtype="<i8").tobytes())


def unpack_array(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The array :func:`pack_array` packed, writable, of ``shape``."""
    import zstandard

    size = 8 * int(np.prod(shape))
    return np.frombuffer(zstandard.ZstdDecompressor().decompress(data, max_output_size=size), dtype="<i8").reshape(shape).astype(np.int64)


def as_columns(chunks: Sequence[ChunkStorageMetadata], ndim: int) -> ChunkColumns:
    """``chunks`` as columns (itself when it already is)."""
    return ChunkColumns.of(chunks, ndim)
