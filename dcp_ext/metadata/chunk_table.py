"""The chunk table of a version-3 metadata document.

Version 2 described every stored chunk twice in JSON objects (its bounds
under its key, its location in ``items``): about 300 bytes per chunk, which at
a million chunks is a document every rank spends seconds parsing. Version 3
stores them as one table of 64-bit integers, column by column per key, zstd
compressed and base64 encoded in the document's ``chunk_table`` field; a key
entry says where its rows start (``table``: ``[first integer, rows]``).

A key of ``d`` dimensions with ``n`` chunks takes ``n * (2d + 8)`` integers,
as columns of ``n``: the chunk offsets (``d`` columns), chunk sizes (``d``),
then the stored item's ``file`` (index into the document's ``files``),
``at``, ``length``, ``data_at``, ``data_length``, ``raw_length`` (``-1``:
uncompressed), ``codec`` (``0``: none, else 1 + index into ``codecs``) and
``frame`` (raw bytes per frame). A bytes value is one row with ``d = 0``.
FSDP's columns are arithmetic or constant, so the table compresses to a few
bytes per chunk.

Decoding builds each chunk's ``ChunkStorageMetadata`` (planners need them all)
and a lazy :class:`ChunkLocations` mapping, whose ``StoredItem`` objects are
built only for the chunks a rank looks up.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import zlib

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from ..errors import CheckpointCorruptError, UnsupportedCodecError
from .document import MAX_FRAME_SIZE, StoredItem

__all__ = ["ChunkLocations", "TableWriter", "decode_table", "read_key_rows"]

_ITEM_COLUMNS = 8
_MAX_TABLE_BYTES = 1 << 34


class TableWriter:
    """Builds the chunk table key by key (the coordinator, at commit)."""

    def __init__(self, files: Mapping[str, int], codecs: dict[tuple[str, ...], int]) -> None:
        self._files = files
        self._codecs = codecs
        self._values = array("q")

    def add(self, offsets: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], items: Sequence[StoredItem]) -> list[int]:
        """Append one key's rows; returns its ``table`` entry ``[first, rows]``."""
        first, rows = len(self._values), len(items)
        ndim = len(offsets[0]) if offsets else 0
        values = self._values
        for d in range(ndim):
            values.extend([o[d] for o in offsets])
        for d in range(ndim):
            values.extend([s[d] for s in sizes])
        files, codecs = self._files, self._codecs
        values.extend([files[i.relative_path] for i in items])
        values.extend([i.offset for i in items])
        values.extend([i.length for i in items])
        values.extend([i.data_offset for i in items])
        values.extend([i.data_length for i in items])
        values.extend([i.raw_length for i in items])
        values.extend([codecs.setdefault(i.transforms, len(codecs) + 1) if i.transforms else 0 for i in items])
        values.extend([i.frame_size for i in items])
        return [first, rows]

    def finish(self) -> tuple[str, str, int]:
        """The ``chunk_table`` field (base64 of the compressed integers), its
        ``chunk_table_codec`` (``zstd``, or ``zlib`` without the zstandard
        package) and its raw bytes."""
        raw = self._values.tobytes() if _LITTLE else _swapped(self._values)
        try:
            import zstandard
        except ImportError:
            codec, packed = "zlib", zlib.compress(raw, 1)
        else:
            codec, packed = "zstd", zstandard.ZstdCompressor(level=3).compress(raw)
        return base64.b64encode(packed).decode("ascii"), codec, len(raw)


def decode_table(text: Any, codec: Any, raw_length: Any, where: str) -> array:  # type: ignore[type-arg]
    """The document's chunk table as 64-bit integers.

    Raises:
        CheckpointCorruptError: It is not valid base64 / zstd / zlib, or its size is wrong.
        UnsupportedCodecError: It is zstd-compressed and the zstandard package is missing.
    """
    if not isinstance(text, str) or not isinstance(raw_length, int) or not 0 <= raw_length <= _MAX_TABLE_BYTES:
        raise CheckpointCorruptError(f"{where}: its chunk table is missing or malformed", where)
    if raw_length % 8 or codec not in ("zstd", "zlib"):
        raise CheckpointCorruptError(f"{where}: its chunk table ({codec!r}, {raw_length} bytes) is malformed", where)
    try:
        packed = base64.b64decode(text, validate=True)
        if codec == "zlib":
            inflater = zlib.decompressobj()
            raw = inflater.decompress(packed, raw_length)
        else:
            try:
                import zstandard
            except ImportError as err:
                raise UnsupportedCodecError(
                    f"{where}: its chunk table is zstd-compressed and the zstandard package is not "
                    f"installed; pip install zstandard",
                    where,
                ) from err
            raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=raw_length)
    except UnsupportedCodecError:
        raise
    except Exception as err:  # ValueError (base64), zlib.error, zstandard.ZstdError
        raise CheckpointCorruptError(f"{where}: its chunk table cannot be decoded ({err})", where) from err
    if len(raw) != raw_length:
        raise CheckpointCorruptError(
            f"{where}: its chunk table holds {len(raw)} bytes, the document says {raw_length}", where
        )
    values = array("q")
    values.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        values.byteswap()
    return values


def read_key_rows(
    table: array, entry: Any, ndim: int, fqn: str, where: str  # type: ignore[type-arg]
) -> tuple[int, list[array], list[array], list[array]]:  # type: ignore[type-arg]
    """One key's rows: their count, offsets columns, sizes columns and item columns.

    Raises:
        CheckpointCorruptError: The ``table`` entry points outside the table.
    """
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(v, int) and v >= 0 for v in entry)):
        raise CheckpointCorruptError(f"{where}: key {fqn!r} has a malformed chunk table entry {entry!r}", where)
    first, rows = entry
    width = 2 * ndim + _ITEM_COLUMNS
    if first + rows * width > len(table):
        raise CheckpointCorruptError(f"{where}: key {fqn!r} points outside the chunk table", where)
    columns = [table[first + c * rows : first + (c + 1) * rows] for c in range(width)]
    return rows, columns[:ndim], columns[ndim : 2 * ndim], columns[2 * ndim :]


def chunks_of(
    rows: int, offsets: list[array], sizes: list[array], shape: Sequence[int], fqn: str, where: str  # type: ignore[type-arg]
) -> list[ChunkStorageMetadata]:
    """The ``ChunkStorageMetadata`` of one tensor's rows, checked to lie inside ``shape``.

    Raises:
        CheckpointCorruptError: A chunk lies outside the tensor.
    """
    ndim = len(shape)
    for d in range(ndim):
        if rows and (
            min(offsets[d]) < 0 or min(sizes[d]) < 0 or max(map(int.__add__, offsets[d], sizes[d])) > shape[d]
        ):
            raise CheckpointCorruptError(
                f"{where}: a chunk of {fqn!r} lies outside the tensor's size {list(shape)}", where
            )
    if ndim == 0:
        return [_SCALAR_CHUNK] * rows
    cache = _chunk_cache
    found = []
    for box in zip(zip(*(c.tolist() for c in offsets)), zip(*(c.tolist() for c in sizes))):
        chunk = cache.get(box)
        if chunk is None:
            chunk = cache[box] = ChunkStorageMetadata(_size(box[0]), _size(box[1]))
        found.append(chunk)
    return found


# Decoding shares equal chunk boxes (FSDP gives a parameter and its optimizer
# states the same ones) and equal sizes: building them is most of a decode.
# The cache lives for one decode (see ``chunk_box_cache``).
_chunk_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata] = {}
_size_cache: dict[tuple[int, ...], torch.Size] = {}
_SCALAR_CHUNK = ChunkStorageMetadata(torch.Size(()), torch.Size(()))


def _size(values: tuple[int, ...]) -> torch.Size:
    size = _size_cache.get(values)
    if size is None:
        size = _size_cache[values] = torch.Size(values)
    return size


def clear_chunk_cache() -> None:
    """Forget the boxes shared within one decode."""
    _chunk_cache.clear()
    _size_cache.clear()


class ChunkLocations(Mapping[MetadataIndex, StoredItem]):
    """Where each stored chunk lives, built item by item when first looked up.

    Keyed like DCP's ``Metadata.storage_data`` (``MetadataIndex`` of a key and
    chunk offsets; ``None`` offsets for bytes values). Items with frame tables
    (:meth:`attach`) replace the document's frameless ones.
    """

    def __init__(self, files: Sequence[str], codecs: Sequence[tuple[str, ...]], file_sizes: Sequence[int], where: str) -> None:
        self._files, self._codecs, self._sizes, self._where = files, codecs, file_sizes, where
        # fqn -> (is a tensor, offsets columns, item columns)
        self._keys: dict[str, tuple[bool, list[array], list[array]]] = {}  # type: ignore[type-arg]
        self._rows: dict[str, dict[tuple[int, ...], int]] = {}
        self._built: dict[tuple[str, int], StoredItem] = {}
        self._count = 0
        self.attached_files: set[str] = set()

    def add_key(self, fqn: str, tensor: bool, offsets: list[array], items: list[array]) -> None:  # type: ignore[type-arg]
        """Record one key's rows (offset columns and item columns)."""
        self._keys[fqn] = (tensor, offsets, items)
        self._count += len(items[0])

    @property
    def files(self) -> Sequence[str]:
        """The document's data files, in order (an item's ``file`` is a position here)."""
        return self._files

    def rows_in(self, file_ids: Collection[int]) -> dict[int, list[tuple[str, int]]]:
        """``(key, row)`` of every chunk stored in each of some files (by position in :attr:`files`)."""
        found: dict[int, list[tuple[str, int]]] = {f: [] for f in file_ids}
        if not found:
            return found
        wanted = torch.tensor(sorted(found), dtype=torch.int64)
        for fqn, (_, _, items) in self._keys.items():
            column = items[0]
            if not column:
                continue
            where = torch.frombuffer(column, dtype=torch.int64)
            hits = torch.isin(where, wanted).nonzero().flatten().tolist()
            for row in hits:
                found[column[row]].append((fqn, row))
        return found

    def item_at(self, fqn: str, row: int) -> StoredItem:
        """The item of one row (with frame tables, if attached)."""
        item = self._built.get((fqn, row))
        if item is None:
            item = self._built[(fqn, row)] = self._item(fqn, [c[row] for c in self._keys[fqn][2]])
        return item

    def attach(self, attached: Sequence[tuple[tuple[str, int], StoredItem]], name: str) -> None:
        """Replace one file's items by their versions with frame tables."""
        for row, item in attached:
            self._built[row] = item
        self.attached_files.add(name)

    def index_of(self, fqn: str, row: int) -> MetadataIndex:
        tensor, offsets, _ = self._keys[fqn]
        return MetadataIndex(fqn, [c[row] for c in offsets] if tensor else None)

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        fqn = index.fqn
        key = self._keys.get(fqn)
        if key is None:
            raise KeyError(index)
        tensor, offsets, _ = key
        if not tensor:
            if index.offset is not None:
                raise KeyError(index)
            return self.item_at(fqn, 0)
        if index.offset is None:
            raise KeyError(index)
        rows = self._rows.get(fqn)
        if rows is None:
            rows = self._rows[fqn] = {o: k for k, o in enumerate(zip(*offsets))} if offsets else {(): 0}
        row = rows.get(tuple(index.offset))
        if row is None:
            raise KeyError(index)
        return self.item_at(fqn, row)

    def _item(self, fqn: str, row: list[int]) -> StoredItem:
        where = self._where
        file_id, at, length, data_at, data_length, raw_length, codec, frame = row
        if not 0 <= file_id < len(self._files):
            raise CheckpointCorruptError(f"{where}: an item of {fqn!r} names file #{file_id}, which it does not list", where)
        if min(at, length, data_at, data_length) < 0 or data_at + data_length > length or at + length > self._sizes[file_id]:
            raise CheckpointCorruptError(
                f"{where}: item {fqn!r} lies outside file {self._files[file_id]!r} as recorded", where
            )
        if not 0 <= codec <= len(self._codecs) or (codec and raw_length < 0):
            raise CheckpointCorruptError(f"{where}: item {fqn!r} has an invalid codec #{codec}", where)
        if not 0 < frame <= MAX_FRAME_SIZE:
            raise CheckpointCorruptError(
                f"{where}: item {fqn!r} claims a frame size of {frame} bytes (at most {MAX_FRAME_SIZE})", where
            )
        return StoredItem(
            self._files[file_id], at, length, data_at, data_length,
            raw_length if codec else -1, self._codecs[codec - 1] if codec else (), frame, indexed=True,
        )

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, (tensor, offsets, items) in self._keys.items():
            for row in range(len(items[0])):
                yield MetadataIndex(fqn, [c[row] for c in offsets] if tensor else None)

    def __len__(self) -> int:
        return self._count


_LITTLE = array("H", [1]).tobytes() == b"\x01\x00"


def _swapped(values: array) -> bytes:  # type: ignore[type-arg]  # pragma: no cover
    copy = array(values.typecode, values)
    copy.byteswap()
    return copy.tobytes()
