"""The frame index at the end of each data file (metadata version 3).

A data file's frame checksums (and a compressed item's frame lengths) are a
few bytes per MiB stored, but across thousands of ranks they are most of a
checkpoint's metadata. Version 3 keeps them out of the global document: each
data file ends with a small binary index of its own frames, and the global
document records where that index lies and its checksum. A rank reads only
the indexes of the files it reads, with one ranged read each.

Layout (little-endian)::

    b"DCPXFI" + version (u16 = 1)
    items (u32), frames (u64), compressed frames (u64)
    checksums: frames x u64       (xxh3-64 of each frame's stored bytes)
    lengths:   compressed frames x u32  (stored bytes of each compressed frame)
    xxh3-64 of everything above (u64)

Frames are listed item by item in the order the items lie in the file, each
item's frames in order; how many frames an item has follows from the global
document (its raw size and the frame size), so the index holds no per-item
record. Only compressed items have entries in ``lengths``.

Which ranks call what: the writer of a data file builds its index
(:func:`encode_frame_index`) and appends it; readers fetch and attach it
(:func:`attach_frame_index`) before reading the file's items.
"""

from __future__ import annotations

import dataclasses
import struct
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import CheckpointCorruptError
from .chunk_table import ChunkLocations
from .document import FrameIndexRef, StoredItem

__all__ = ["encode_frame_index", "frame_index_of", "attach_frame_index", "attach_frame_indexes", "frame_count", "MAX_INDEX_BYTES"]

_MAGIC = b"DCPXFI"
_VERSION = 1
_HEADER = struct.Struct("<6sHIQQ")
_TRAILER = struct.Struct("<Q")
#: A reader never allocates more than this for one file's index, whatever the metadata claims.
MAX_INDEX_BYTES = 1 << 32


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
    return frame_index_of(len(items), _little(sums), _little(lengths))


def frame_index_of(items: int, checksums: bytes, lengths: bytes = b"") -> bytes:
    """A file's index from its items' count and their frames' little-endian
    checksums (u64 each) and compressed frame lengths (u32 each), in file order."""
    if len(checksums) % 8 or len(lengths) % 4:
        raise ValueError("frame checksums are 8 bytes each and frame lengths 4 bytes each")
    data = _HEADER.pack(_MAGIC, _VERSION, items, len(checksums) // 8, len(lengths) // 4) + checksums + lengths
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
    try:
        magic, version, count, frames, compressed = _HEADER.unpack_from(data, 0)
        end = _HEADER.size + 8 * frames + 4 * compressed
        if magic != _MAGIC or version != _VERSION or end + _TRAILER.size != len(data):
            raise ValueError("not a version-1 frame index")
        (own,) = _TRAILER.unpack_from(data, end)
        if own != xxhash.xxh3_64_intdigest(data[:end]):
            raise ValueError("its own checksum does not match")
        if count != len(ordered):
            raise ValueError(f"it lists {count} items, the metadata {len(ordered)}")
        sums = array("Q")
        sums.frombytes(data[_HEADER.size : _HEADER.size + 8 * frames])
        lengths = array("I")
        lengths.frombytes(data[_HEADER.size + 8 * frames : end])
        if _BIG_ENDIAN:  # pragma: no cover - every supported platform is little-endian
            sums.byteswap()
            lengths.byteswap()
    except (struct.error, ValueError) as err:
        raise CheckpointCorruptError(f"{where}: its frame index is damaged ({err})", where) from err
    out: list[StoredItem] = []
    s = n = 0
    for item in ordered:
        k = frame_count(item)
        fields: dict[str, object] = {"checksums": tuple(sums[s : s + k]), "indexed": False}
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
        out.append(dataclasses.replace(item, **fields))  # type: ignore[arg-type]
    if s != frames or n != compressed:
        raise CheckpointCorruptError(
            f"{where}: its frame index holds {frames} frames ({compressed} compressed); the "
            f"metadata's items need {s} ({n})",
            where,
        )
    aligned: list[StoredItem] = [out[0]] * len(out)
    for position, k in enumerate(order):
        aligned[k] = out[position]
    return aligned


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
        return read(name, refs[name])

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


_BIG_ENDIAN = array("H", [1]).tobytes() != b"\x01\x00"


def _little(values: array) -> bytes:  # type: ignore[type-arg]
    if _BIG_ENDIAN:  # pragma: no cover
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()
