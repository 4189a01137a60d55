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
bytes per chunk. The coordinator writes it with
:class:`~dcp_ext.metadata.table_encode.TableEncoder`.

Decoding keeps the table as one int64 array: each tensor's chunks become a
:class:`~dcp_ext.metadata.chunk_columns.ChunkColumns` over its columns
(:func:`columns_of`, bounds checked on the arrays), and a lazy
:class:`ChunkLocations` mapping builds ``StoredItem`` objects only for the
chunks a rank looks up. No per-chunk Python object is built on decode: at 22
million chunks (405B with Adam state saved by 8,192 ranks) they would cost
every loading rank gigabytes and minutes.
"""

from __future__ import annotations

import base64
import zlib
from array import array
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..errors import CheckpointCorruptError, UnsupportedCodecError
from .chunk_columns import ChunkColumns
from .document import MAX_FRAME_SIZE, StoredItem

__all__ = ["ChunkLocations", "KeyTotals", "columns_of", "decode_table", "key_rows", "table_entry", "key_width"]

_ITEM_COLUMNS = 8
# Keys with at most this many chunks have their bounds checked in Python.
_FEW_ROWS = 8
#: Largest chunk table a reader decodes (about 150 million chunks).
MAX_TABLE_BYTES = 1 << 34


def key_width(ndim: int) -> int:
    """Integers per row of a key of ``ndim`` dimensions (``0``: a bytes value)."""
    return 2 * ndim + _ITEM_COLUMNS


def table_entry(entry: Any, fqn: str, where: str) -> tuple[int, int]:
    """A key's ``table`` entry ``[first integer, rows]``, checked.

    Raises:
        CheckpointCorruptError: It is not two non-negative 64-bit integers.
    """
    if not (isinstance(entry, list) and len(entry) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in entry
    )):
        raise CheckpointCorruptError(f"{where}: key {fqn!r} has a malformed chunk table entry {entry!r}", where)
    return entry[0], entry[1]


def decode_table(text: Any, codec: Any, raw_length: Any, where: str, needed: int | None = None) -> np.ndarray:
    """The document's chunk table as 64-bit integers (a read-only array over
    the decompressed bytes: no copy).

    Nothing larger than the declared ``raw_length`` is ever allocated: a
    zstd frame that declares another size is refused before it is
    decompressed (python-zstandard allocates a frame's declared size whatever
    ``max_output_size`` says: a 65 KiB document once cost 1.5 GiB, issue 32).

    Args:
        text, codec, raw_length: The document's ``chunk_table``,
            ``chunk_table_codec`` and ``chunk_table_bytes``.
        where: The document, for messages.
        needed: Integers the document's keys' rows span; the declared size
            must be exactly that (checked before anything is decoded).

    Raises:
        CheckpointCorruptError: It is not valid base64 / zstd / zlib, or its size is wrong.
        UnsupportedCodecError: It is zstd-compressed and the zstandard package is missing.
    """
    if not isinstance(text, str) or isinstance(raw_length, bool) or not isinstance(raw_length, int) \
            or not 0 <= raw_length <= MAX_TABLE_BYTES:
        raise CheckpointCorruptError(
            f"{where}: its chunk table is missing or malformed (chunk_table_bytes must be 0 to {MAX_TABLE_BYTES})", where
        )
    if raw_length % 8 or codec not in ("zstd", "zlib"):
        raise CheckpointCorruptError(f"{where}: its chunk table ({codec!r}, {raw_length} bytes) is malformed", where)
    if needed is not None and raw_length != 8 * needed:
        raise CheckpointCorruptError(
            f"{where}: chunk_table_bytes says {raw_length} bytes, but its keys' rows span {8 * needed}", where
        )
    try:
        packed = base64.b64decode(text, validate=True)
        if codec == "zlib":
            inflater = zlib.decompressobj()
            # Never more than raw_length (0 would mean "no limit" to zlib).
            raw = inflater.decompress(packed, raw_length) if raw_length else b""
        else:
            try:
                import zstandard
            except ImportError as err:
                raise UnsupportedCodecError(
                    f"{where}: its chunk table is zstd-compressed and the zstandard package is not "
                    f"installed; pip install zstandard",
                    where,
                ) from err
            declared = zstandard.frame_content_size(packed)  # -1: not recorded (TableEncoder streams)
            if declared not in (-1, raw_length):
                raise CheckpointCorruptError(
                    f"{where}: its chunk table's zstd frame declares {declared} bytes, chunk_table_bytes "
                    f"{raw_length}; refusing to decompress it",
                    where,
                )
            raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=raw_length)
    except (UnsupportedCodecError, CheckpointCorruptError):
        raise
    except Exception as err:  # ValueError (base64), zlib.error, zstandard.ZstdError
        raise CheckpointCorruptError(f"{where}: its chunk table cannot be decoded ({err})", where) from err
    if len(raw) != raw_length:
        raise CheckpointCorruptError(
            f"{where}: its chunk table holds {len(raw)} bytes, the document says {raw_length}", where
        )
    values = np.frombuffer(raw, dtype="<i8")
    return values if _LITTLE else values.astype(np.int64)


def key_rows(
    table: np.ndarray, first: int, rows: int, ndim: int, fqn: str, where: str
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """One key's rows, from its ``table`` entry ``[first, rows]`` (checked by
    :func:`table_entry`): their count, and its offsets, sizes and item columns
    as ``(ndim, rows)``, ``(ndim, rows)`` and ``(8, rows)`` views of the table.

    Raises:
        CheckpointCorruptError: The rows lie outside the table.
    """
    width = key_width(ndim)
    if first + rows * width > len(table):
        raise CheckpointCorruptError(f"{where}: key {fqn!r} points outside the chunk table", where)
    block = table[first : first + rows * width].reshape(width, rows)
    return rows, block[:ndim], block[ndim : 2 * ndim], block[2 * ndim :]


def columns_of(
    offsets: np.ndarray, sizes: np.ndarray, shape: Sequence[int], fqn: str, where: str
) -> ChunkColumns:
    """One tensor's chunks from its ``(ndim, rows)`` offsets and sizes columns,
    checked to lie inside ``shape`` (on the arrays, not chunk by chunk).

    Raises:
        CheckpointCorruptError: A chunk lies outside the tensor.
    """
    if any(n >= 1 << 63 for n in shape):
        raise CheckpointCorruptError(f"{where}: key {fqn!r} has an impossible size {list(shape)}", where)
    if 0 < offsets.shape[1] <= _FEW_ROWS and len(shape):
        # A few chunks (most tensors): Python integers, no overflow to guard
        # against, and no numpy call (each costs microseconds; a document
        # has a key per tensor).
        for n, chunk_offsets, chunk_sizes in zip(shape, offsets.tolist(), sizes.tolist()):
            for o, z in zip(chunk_offsets, chunk_sizes):
                if o < 0 or z < 0 or o + z > n:
                    raise CheckpointCorruptError(
                        f"{where}: a chunk of {fqn!r} lies outside the tensor's size {list(shape)}", where
                    )
    elif offsets.shape[1] and len(shape):
        limit = np.array(shape, dtype=np.int64).reshape(-1, 1)
        # ``offsets > limit - sizes``, not ``offsets + sizes > limit``: a
        # hostile table's huge values must not overflow into passing.
        if offsets.min() < 0 or sizes.min() < 0 or bool((offsets > limit - sizes).any()):
            raise CheckpointCorruptError(
                f"{where}: a chunk of {fqn!r} lies outside the tensor's size {list(shape)}", where
            )
    return ChunkColumns(offsets.T, sizes.T)


class KeyTotals(NamedTuple):
    """One key's items summed (:meth:`ChunkLocations.totals`)."""

    chunks: int
    data_bytes: int
    raw_bytes: int
    codecs: tuple[tuple[str, ...], ...]


# Sums of a key's lengths stay exact in int64 below this per item (2^48 B = 256 TiB).
_MAX_ITEM_BYTES = 1 << 48


class ChunkLocations(Mapping[MetadataIndex, StoredItem]):
    """Where each stored chunk lives, built item by item when first looked up.

    Keyed like DCP's ``Metadata.storage_data`` (``MetadataIndex`` of a key and
    chunk offsets; ``None`` offsets for bytes values). A look-up whose
    ``index`` hint (the chunk's row, which DCP's and dcp_ext's load planners
    set) names a row with those offsets costs one row's comparison; any other
    look-up indexes that key's rows once. Items with frame tables
    (:meth:`attach`) replace the document's frameless ones.

    With ``incremental`` (version-4 documents) an item's ``data_length`` counts
    the stored bytes of all its frames, some of which may lie in earlier
    checkpoints' files (the frame index says where); only the item's own
    ``length`` bytes must lie in its file.
    """

    def __init__(
        self, files: Sequence[str], codecs: Sequence[tuple[str, ...]], file_sizes: Sequence[int], where: str,
        incremental: bool = False,
    ) -> None:
        self._files, self._codecs, self._sizes, self._where = files, codecs, file_sizes, where
        self.incremental = incremental
        # fqn -> (is a tensor, offsets columns (ndim, rows), item columns (8, rows))
        self._keys: dict[str, tuple[bool, np.ndarray, np.ndarray]] = {}
        self._rows: dict[str, dict[tuple[int, ...], int]] = {}
        self._built: dict[tuple[str, int], StoredItem] = {}
        self._count = 0
        self.attached_files: set[str] = set()

    def add_key(self, fqn: str, tensor: bool, offsets: np.ndarray, items: np.ndarray) -> None:
        """Record one key's rows: its ``(ndim, rows)`` offsets and ``(8, rows)`` item columns."""
        self._keys[fqn] = (tensor, offsets, items)
        self._count += items.shape[1]

    @property
    def files(self) -> Sequence[str]:
        """The document's data files, in order (an item's ``file`` is a position here)."""
        return self._files

    def rows_in(self, file_ids: Collection[int]) -> dict[int, list[tuple[str, int]]]:
        """``(key, row)`` of every chunk stored in each of some files (by position in :attr:`files`)."""
        found: dict[int, list[tuple[str, int]]] = {f: [] for f in file_ids}
        if not found:
            return found
        wanted = np.array(sorted(found), dtype=np.int64)
        every = len(wanted) >= len(self._files)  # all files: every row, no test needed
        for fqn, (_, _, items) in self._keys.items():
            column = items[0]
            if every:
                for row, file_id in enumerate(column.tolist()):
                    found[file_id].append((fqn, row))
                continue
            # One file (a rank reading its own): an equality test costs a tenth of isin.
            hits = np.flatnonzero(column == wanted[0] if len(wanted) == 1 else np.isin(column, wanted))
            for row, file_id in zip(hits.tolist(), column[hits].tolist()):
                found[file_id].append((fqn, row))
        return found

    def totals(self) -> dict[str, KeyTotals]:
        """Per key: its chunks, stored data bytes, raw bytes and codecs, summed
        on the columns without building items (tools: ``inspect``, ``ls``).

        Raises:
            CheckpointCorruptError: A length or codec is impossible.
        """
        found: dict[str, KeyTotals] = {}
        for fqn, (_, _, items) in self._keys.items():
            data_length, raw_length, codec = items[4], items[5], items[6]
            raw = np.where(codec > 0, raw_length, data_length)
            if len(codec) and (
                min(data_length.min(), raw.min(), codec.min()) < 0
                or max(data_length.max(), raw.max()) >= _MAX_ITEM_BYTES
                or codec.max() > len(self._codecs)
            ):
                raise CheckpointCorruptError(f"{self._where}: an item of {fqn!r} has an impossible length or codec",
                                             self._where)
            codecs = tuple(self._codecs[c - 1] if c else () for c in np.unique(codec).tolist())
            found[fqn] = KeyTotals(len(codec), int(data_length.sum()), int(raw.sum()), codecs)
        return found

    def item_at(self, fqn: str, row: int) -> StoredItem:
        """The item of one row (with frame tables, if attached).

        Safe from two threads (a read-once load looks items up from its
        reading thread and its exchanging thread): an item built from the
        columns while :meth:`attach` stored this row's attached version never
        replaces it (``setdefault`` is one atomic step).
        """
        item = self._built.get((fqn, row))
        if item is None:
            item = self._built.setdefault((fqn, row), self._item(fqn, self._keys[fqn][2][:, row].tolist()))
        return item

    def attach(self, attached: Sequence[tuple[tuple[str, int], StoredItem]], name: str) -> None:
        """Replace one file's items by their versions with frame tables."""
        for row, item in attached:
            self._built[row] = item
        self.attached_files.add(name)

    def index_of(self, fqn: str, row: int) -> MetadataIndex:
        tensor, offsets, _ = self._keys[fqn]
        return MetadataIndex(fqn, offsets[:, row].tolist(), row) if tensor else MetadataIndex(fqn)

    def __getitem__(self, index: MetadataIndex) -> StoredItem:
        fqn = index.fqn
        key = self._keys.get(fqn)
        if key is None:
            raise KeyError(index)
        tensor, offsets, items = key
        if not tensor:
            if index.offset is not None:
                raise KeyError(index)
            return self.item_at(fqn, 0)
        if index.offset is None:
            raise KeyError(index)
        wanted = tuple(index.offset)
        row = index.index
        if not (isinstance(row, int) and 0 <= row < items.shape[1] and tuple(offsets[:, row].tolist()) == wanted):
            rows = self._rows.get(fqn)
            if rows is None:
                rows = self._rows[fqn] = (
                    {tuple(o): k for k, o in enumerate(offsets.T.tolist())} if len(offsets) else {(): 0}
                )
            row = rows.get(wanted)
            if row is None:
                raise KeyError(index)
        return self.item_at(fqn, row)

    def _item(self, fqn: str, row: list[int]) -> StoredItem:
        where = self._where
        file_id, at, length, data_at, data_length, raw_length, codec, frame = row
        if not 0 <= file_id < len(self._files):
            raise CheckpointCorruptError(f"{where}: an item of {fqn!r} names file #{file_id}, which it does not list", where)
        own_data = data_at if self.incremental else data_at + data_length
        if min(at, length, data_at, data_length) < 0 or own_data > length or at + length > self._sizes[file_id]:
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
            if tensor:
                for row, chunk_offsets in enumerate(offsets.T.tolist()):
                    yield MetadataIndex(fqn, chunk_offsets, row)
            else:
                for _ in range(items.shape[1]):
                    yield MetadataIndex(fqn)

    def __len__(self) -> int:
        return self._count


_LITTLE = array("H", [1]).tobytes() == b"\x01\x00"


def _swapped(values: array) -> bytes:  # type: ignore[type-arg]  # pragma: no cover
    copy = array(values.typecode, values)
    copy.byteswap()
    return copy.tobytes()
