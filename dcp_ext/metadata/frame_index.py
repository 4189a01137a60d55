"""The frame index at the end of each data file (metadata version 3).

A data file's frame checksums (and a compressed item's frame lengths) are a
few bytes per MiB stored, but across thousands of ranks they are most of a
checkpoint's metadata. Version 3 keeps them out of the global document: each
data file ends with a small binary index of its own frames, and the global
document records where that index lies and its checksum. A rank reads only
the indexes of the files it reads, with one ranged read each.

Layout (little-endian)::

    b"DCPXFI" + version (u16 = 1 or 2)
    items (u32), frames (u64), compressed frames (u64)
    checksums: frames x u64       (xxh3-64 of each frame's stored bytes)
    lengths:   compressed frames x u32  (stored bytes of each compressed frame)
    version 2 only (incremental saves, :mod:`dcp_ext.incremental._save`):
      sources size (u32)
      hashes:  frames x 16 bytes  (xxh3-128 of each frame's raw bytes)
      source:  frames x u32       (0: this file; k: the k-th name in sources)
      offsets: frames x u64       (where the frame's stored bytes start in that file)
      sources: JSON list of reference names ("../step10_partial/model_rank0.distcp")
    xxh3-64 of everything above (u64)

Frames are listed item by item in the order the items lie in the file, each
item's frames in order; how many frames an item has follows from the global
document (its raw size and the frame size), so the index holds no per-item
record. Only compressed items have entries in ``lengths``. In version 2
every frame says where it lies, so a file may hold only the frames that
changed since the save it refers to.

Which ranks call what: the writer of a data file builds its index
(:func:`encode_frame_index`) and appends it; readers fetch and attach it
(:func:`attach_frame_index`) before reading the file's items.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import CheckpointCorruptError
from .chunk_table import ChunkLocations
from .document import FrameIndexRef, StoredItem, split_reference

__all__ = ["encode_frame_index", "frame_index_of", "attach_frame_index", "attach_frame_indexes", "frame_count", "MAX_INDEX_BYTES"]

_MAGIC = b"DCPXFI"
_VERSION = 1
_VERSION_INCREMENTAL = 2
_HEADER = struct.Struct("<6sHIQQ")
_SOURCES = struct.Struct("<I")
_HASH = 16
_TRAILER = struct.Struct("<Q")
#: Largest frame index a document may record for one file (checked on decode).
MAX_INDEX_BYTES = 1 << 32
# An index longer than this is read in steps of it: a local read allocates
# what it asks for before it finds the file shorter, so a document claiming
# a 4 GiB index in a 1 KB file must not make it ask for 4 GiB at once.
_READ_STEP = 4 << 20


def frame_count(item: StoredItem) -> int:
    """How many frames an item has (``0`` for items written without frames)."""
    if not item.frame_size:
        return 0
    return -(-item.raw_size // item.frame_size)


def encode_frame_index(items: Sequence[StoredItem]) -> bytes:
    """(each writer) The index of one file's items, given in file order with their frames."""
    sums = array("Q")
    lengths = array("I")
    for item in items:
        sums.extend(item.checksums)
        if item.transforms:
            lengths.extend(item.frame_lengths)
    if sums.itemsize != 8 or lengths.itemsize != 4:  # pragma: no cover - every supported platform
        raise RuntimeError("array item sizes differ from the index format")
    if not any(item.frame_offsets for item in items):
        return frame_index_of(len(items), _little(sums), _little(lengths))
    names: dict[str, int] = {}
    hashes = bytearray()
    source = array("I")
    offsets = array("Q")
    for item in items:
        count = frame_count(item)
        if len(item.frame_offsets) != count or len(item.frame_hashes) != _HASH * count:
            raise ValueError(f"an item of {item.relative_path!r} lacks frame offsets or hashes (incremental index)")
        hashes += item.frame_hashes
        offsets.extend(item.frame_offsets)
        sources = item.frame_sources or ("",) * count
        source.extend(names.setdefault(name, len(names) + 1) if name else 0 for name in sources)
    table = json.dumps(list(names), separators=(",", ":")).encode()
    extra = _SOURCES.pack(len(table)) + bytes(hashes) + _little(source) + _little(offsets) + table
    return _index(_VERSION_INCREMENTAL, len(items), _little(sums), _little(lengths), extra)


def frame_index_of(items: int, checksums: bytes, lengths: bytes = b"") -> bytes:
    """A file's index from its items' count and their frames' little-endian
    checksums (u64 each) and compressed frame lengths (u32 each), in file order."""
    return _index(_VERSION, items, checksums, lengths, b"")


def _index(version: int, items: int, checksums: bytes, lengths: bytes, extra: bytes) -> bytes:
    if len(checksums) % 8 or len(lengths) % 4:
        raise ValueError("frame checksums are 8 bytes each and frame lengths 4 bytes each")
    data = _HEADER.pack(_MAGIC, version, items, len(checksums) // 8, len(lengths) // 4) + checksums + lengths + extra
    return data + _TRAILER.pack(xxhash.xxh3_64_intdigest(data))


def attach_frame_index(
    items: Iterable[StoredItem], data: bytes, ref: FrameIndexRef, where: str
) -> list[StoredItem]:
    """(readers) One file's items, in file order, with their frame tables filled in.

    Args:
        items: The file's items as the global document describes them
            (``frame_size`` set, no checksums yet), in any order.
        data: The index's bytes, as read from the file.
        ref: Where the document says the index lies and its checksum.
        where: The file's location, for messages.

    Raises:
        CheckpointCorruptError: The index is damaged or does not match the
            document's items (its message names the file).
    """
    if len(data) < ref.length:
        raise CheckpointCorruptError(
            f"{where} is shorter than the checkpoint metadata says: its frame index should be "
            f"{ref.length} bytes at byte {ref.at}, {len(data)} are there (the file was truncated); "
            f"restore the file or load an earlier checkpoint",
            where,
        )
    if len(data) != ref.length or xxhash.xxh3_64_intdigest(data) != ref.xxh3:
        raise CheckpointCorruptError(
            f"{where}: its frame index ({ref.length} bytes at {ref.at}) is damaged or missing "
            f"(read {len(data)} bytes that do not match the checksum recorded in the metadata); "
            f"restore the file or load an earlier checkpoint",
            where,
        )
    given = list(items)
    order = sorted(range(len(given)), key=lambda k: given[k].offset)
    ordered = [given[k] for k in order]
    located: _Located | None = None
    try:
        magic, version, count, frames, compressed = _HEADER.unpack_from(data, 0)
        end = _HEADER.size + 8 * frames + 4 * compressed
        if magic != _MAGIC or version not in (_VERSION, _VERSION_INCREMENTAL):
            raise ValueError("not a version-1 or version-2 frame index")
        if end + _TRAILER.size > len(data):  # before any offset is derived from the counts
            raise ValueError(f"its header claims {frames} frames ({compressed} compressed), more than its "
                             f"{len(data)} bytes hold")
        if version == _VERSION_INCREMENTAL:
            located = _Located.parse(data, end, frames, ref.at, where)
            end = located.end
        if end + _TRAILER.size != len(data):
            raise ValueError(f"its sections end at byte {end}, not {len(data) - _TRAILER.size}")
        (own,) = _TRAILER.unpack_from(data, end)
        if own != xxhash.xxh3_64_intdigest(data[:end]):
            raise ValueError("its own checksum does not match")
        if count != len(ordered):
            raise ValueError(f"it lists {count} items, the metadata {len(ordered)}")
        sums = array("Q")
        sums.frombytes(data[_HEADER.size : _HEADER.size + 8 * frames])
        lengths = array("I")
        lengths.frombytes(data[_HEADER.size + 8 * frames : _HEADER.size + 8 * frames + 4 * compressed])
        if _BIG_ENDIAN:  # pragma: no cover - every supported platform is little-endian
            sums.byteswap()
            lengths.byteswap()
    except (struct.error, ValueError, OverflowError) as err:
        raise CheckpointCorruptError(f"{where}: its frame index is damaged ({err})", where) from err
    out: list[StoredItem] = []
    s = n = 0
    for item in ordered:
        k = frame_count(item)
        fields: dict[str, object] = {"checksums": tuple(sums[s : s + k]), "indexed": False}
        if located is not None:
            fields.update(located.fields(s, k))
        s += k
        if item.transforms:
            frame_lengths = tuple(lengths[n : n + k])
            n += k
            if sum(frame_lengths) != item.data_length:
                raise CheckpointCorruptError(
                    f"{where}: its frame index gives an item at byte {item.offset} {sum(frame_lengths)} "
                    f"stored bytes, the metadata {item.data_length}",
                    where,
                )
            fields["frame_lengths"] = frame_lengths
        out.append(_replaced(item, fields))
    if s != frames or n != compressed:
        raise CheckpointCorruptError(
            f"{where}: its frame index holds {frames} frames ({compressed} compressed); the "
            f"metadata's items need {s} ({n})",
            where,
        )
    aligned: list[StoredItem] = list(out)
    for position, k in enumerate(order):
        aligned[k] = out[position]
    return aligned


_ITEM_FIELDS = frozenset(f.name for f in dataclasses.fields(StoredItem))


def _replaced(item: StoredItem, fields: dict[str, object]) -> StoredItem:
    """``dataclasses.replace(item, **fields)`` without a frozen dataclass's
    ``__init__``, which sets every field through ``object.__setattr__``
    (measured: 1.3 against 10 us an item, for every item a load reads)."""
    if not fields.keys() <= _ITEM_FIELDS:
        raise TypeError(f"StoredItem has no field {sorted(fields.keys() - _ITEM_FIELDS)}")
    copy = object.__new__(StoredItem)
    state = copy.__dict__
    state.update(item.__dict__)
    state.update(fields)
    return copy


@dataclasses.dataclass(frozen=True)
class _Located:
    """Version 2's sections: each frame's raw hash and where its stored bytes are."""

    hashes: bytes
    source: array  # type: ignore[type-arg]
    offsets: array  # type: ignore[type-arg]
    names: tuple[str, ...]
    end: int

    @classmethod
    def parse(cls, data: bytes, at: int, frames: int, data_end: int, where: str) -> _Located:
        (table_bytes,) = _SOURCES.unpack_from(data, at)
        at += _SOURCES.size
        hashes = data[at : at + _HASH * frames]
        at += _HASH * frames
        source = array("I")
        source.frombytes(data[at : at + 4 * frames])
        at += 4 * frames
        offsets = array("Q")
        offsets.frombytes(data[at : at + 8 * frames])
        at += 8 * frames
        if len(hashes) != _HASH * frames or len(offsets) != frames:
            raise ValueError("its frame locations are cut short")
        try:
            names = json.loads(data[at : at + table_bytes])
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            detail = "nested too deeply" if isinstance(err, RecursionError) else str(err)
            raise ValueError(f"its table of referenced files is unreadable ({detail})") from err
        if not isinstance(names, list):
            raise ValueError("its table of referenced files is not a list")
        for name in names:
            split_reference(name, where)
        if _BIG_ENDIAN:  # pragma: no cover
            source.byteswap()
            offsets.byteswap()
        if frames and max(source) > len(names):
            raise ValueError("a frame names a referenced file the index does not list")
        for k in range(frames):
            if source[k] == 0 and offsets[k] >= data_end:
                raise ValueError(f"frame {k} lies at byte {offsets[k]}, past the file's data ({data_end} bytes)")
        return cls(hashes, source, offsets, tuple(names), at + table_bytes)

    def fields(self, first: int, count: int) -> dict[str, object]:
        """One item's ``frame_hashes``, ``frame_offsets`` and ``frame_sources``."""
        names = ("", *self.names)
        return {
            "frame_hashes": self.hashes[_HASH * first : _HASH * (first + count)],
            "frame_offsets": tuple(self.offsets[first : first + count]),
            "frame_sources": tuple(names[i] for i in self.source[first : first + count]),
        }


def attach_frame_indexes(
    locations: ChunkLocations,
    names: Collection[str],
    refs: Mapping[str, FrameIndexRef],
    read: Callable[[str, FrameIndexRef], bytes],
    describe: Callable[[str], str],
    threads: int = 8,
) -> None:
    """(readers) Read the frame indexes of some files and attach them to their items.

    Args:
        locations: The decoded document's items.
        names: Files whose items are about to be read (already attached ones are skipped).
        refs: Where each file's index lies (``DecodedMetadata.frame_indexes``).
        read: Reads ``ref.length`` bytes at ``ref.at`` of a file.
        describe: A file's location, for messages.
        threads: Files read at once.

    Raises:
        CheckpointCorruptError: An index is damaged, or a file has none.
    """
    pending = [n for n in names if n not in locations.attached_files]
    if not pending:
        return
    ids = {name: k for k, name in enumerate(locations.files)}
    for name in pending:
        if name not in refs or name not in ids:
            raise CheckpointCorruptError(f"{describe(name)}: the metadata records no frame index for it", describe(name))
    rows = locations.rows_in([ids[n] for n in pending])

    def fetch(name: str) -> bytes:
        return read_in_steps(read, name, refs[name])

    if len(pending) == 1:
        blobs = [fetch(pending[0])]
    else:
        with ThreadPoolExecutor(min(threads, len(pending)), thread_name_prefix="dcp_ext-index") as pool:
            blobs = list(pool.map(fetch, pending))
    for name, data in zip(pending, blobs):
        file_rows = rows[ids[name]]
        items = [locations.item_at(*row) for row in file_rows]
        full = attach_frame_index(items, data, refs[name], describe(name))
        locations.attach(list(zip(file_rows, full)), name)


def read_in_steps(read: Callable[[str, FrameIndexRef], bytes], name: str, ref: FrameIndexRef,
                  step: int = _READ_STEP) -> bytes:
    """``read(name, ref)``, in reads of at most ``step`` bytes, stopping at
    the first short one: memory follows the bytes the file really has, not
    the length the metadata claims (issue 32, finding 6)."""
    if ref.length <= step:
        return read(name, ref)
    parts: list[bytes] = []
    at, left = ref.at, ref.length
    while left:
        part = read(name, dataclasses.replace(ref, at=at, length=min(step, left)))
        parts.append(part)
        if len(part) < min(step, left):
            break
        at += len(part)
        left -= len(part)
    return b"".join(parts)


_BIG_ENDIAN = array("H", [1]).tobytes() != b"\x01\x00"


def _little(values: array) -> bytes:  # type: ignore[type-arg]
    if _BIG_ENDIAN:  # pragma: no cover
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()
