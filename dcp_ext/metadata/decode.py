"""Reading dcp_ext's metadata document: parse, validate, rebuild DCP's ``Metadata``.

Every field is checked before use (sizes, offsets, file names, frame tables),
so a damaged or hostile document fails with ``CheckpointCorruptError``
instead of an odd error or a read outside the checkpoint. The format itself is
described in :mod:`dcp_ext.metadata.document`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorruptError, UnsupportedCodecError
from ..format import decode_tree, dtype_from_name, parse_stored_json
from .chunk_table import (
    ChunkLocations,
    columns_of,
    decode_table,
    key_width,
    key_rows,
    table_entry,
)
from .document import (
    DCP_VERSION,
    FORMAT,
    INCREMENTAL_VERSION,
    MAX_FRAME_SIZE,
    READABLE_VERSIONS,
    FrameIndexRef,
    StoredItem,
    check_integrity,
    split_reference,
    validate_file_name,
)
from .frame_index import MAX_INDEX_BYTES

__all__ = [
    "DecodedMetadata", "IncrementalSection", "decode_metadata", "read_created", "read_leading_field",
    "read_incremental_section",
]

# Every size, offset and count is a 64-bit integer where it is used (numpy
# columns, file offsets): a larger one (JSON has no limit) must be refused
# here, not overflow later (issue 32, finding 7: 10**400).
_INT_LIMIT = 1 << 63
#: Latest commit time accepted (year 5138): ``ls`` formats it as a date.
MAX_CREATED = 1e11
# What a malformed document raises while it is walked, besides our own errors.
_HEX16 = re.compile(r"[0-9a-f]{16}")
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError)


def _int_list(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _INT_LIMIT for v in value
    ):
        raise CheckpointCorruptError(f"{where}: {what} must be a list of non-negative 64-bit integers", where)
    return value


def _nonneg(value: Any, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _INT_LIMIT:
        raise CheckpointCorruptError(
            f"{where}: {what} must be a non-negative 64-bit integer, got {_short(value)}", where
        )
    return value


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length a message can hold (a hostile value may be 10**400)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 80 else text[:77] + "..."


def _world_size(doc: dict[str, Any], where: str) -> int:
    """The document's ``world_size`` (``0`` when absent: early documents)."""
    return _nonneg(doc.get("world_size", 0), "world_size", where)


def _created(doc: dict[str, Any], where: str) -> float:
    """The document's ``created`` time (``0.0`` when absent), a finite number of seconds."""
    value = doc.get("created")
    if value is None:
        return 0.0
    if not _is_time(value):
        raise CheckpointCorruptError(
            f"{where}: created must be a commit time in seconds since the epoch, got {_short(value)}", where
        )
    return float(value)


def _is_time(value: Any) -> bool:
    """Whether ``value`` is a number that a commit time can be: finite, 0 to :data:`MAX_CREATED`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int) and not 0 <= value <= MAX_CREATED:
        return False  # also keeps float() from overflowing on 10**400
    return math.isfinite(value) and 0 <= value <= MAX_CREATED


@dataclass(frozen=True)
class DecodedMetadata:
    """What :func:`decode_metadata` returns.

    Attributes:
        metadata: DCP's metadata; its ``storage_data`` maps each chunk to its
            :class:`StoredItem` (version 3: a lazy :class:`ChunkLocations`
            whose items get their frame tables from :func:`attach_frame_indexes`,
            and each tensor's ``chunks`` is a :class:`ChunkColumns`).
        files: Size of each data file.
        world_size: Ranks that saved.
        created: Commit time.
        frame_indexes: Version 3: where each file's frame index lies.
        incremental: Version 4 (incremental saves): the save it built on,
            how many saves since a self-contained one, and the earlier
            checkpoints' data files its frames refer to.
    """

    metadata: Metadata
    files: dict[str, int]
    world_size: int
    created: float = 0.0
    frame_indexes: dict[str, FrameIndexRef] = field(default_factory=dict)
    incremental: IncrementalSection | None = None


@dataclass(frozen=True)
class IncrementalSection:
    """The ``incremental`` section of a version-4 document.

    Attributes:
        base: Tag of the checkpoint the save compared its frames with
            (``None``: the save wrote every frame, recording hashes only).
        chain: Saves since the last self-contained one (``0``: self-contained).
        references: Each earlier checkpoint's data file some frames are stored
            in (a :func:`~dcp_ext.metadata.document.reference_name`), with the
            stored bytes referred to.
        sizes: The size of those files, where the save knew it (documents
            written before sizes were recorded have none).
    """

    base: str | None
    chain: int
    references: dict[str, int]
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def referenced_bytes(self) -> int:
        """Stored bytes of earlier checkpoints' files that this checkpoint's frames refer to, in
        all."""
        return sum(self.references.values())

    @property
    def unused_bytes(self) -> int:
        """Bytes of the referenced files (those of known size) that no frame
        of this checkpoint uses: what retention could free once no kept
        checkpoint refers to those files."""
        return sum(max(0, size - self.references[name]) for name, size in self.sizes.items() if name in self.references)


def decode_metadata(data: bytes, where: str) -> DecodedMetadata:
    """Parse and validate dcp_ext's JSON metadata.

    Args:
        data: The file's bytes.
        where: The file's location, for messages.

    Raises:
        CheckpointCorruptError: The document is not valid dcp_ext metadata.
    """
    verified = check_integrity(data, where)
    doc = parse_stored_json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where} is not dcp_ext metadata", where)
    version = doc.get("version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"{where} has metadata version {version!r}; this dcp_ext reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Upgrade dcp_ext to load it.",
            where,
        )
    if version >= 2 and not verified:
        # Every version-2 document ends with its checksum: a missing one
        # means the field itself was damaged (e.g. a flipped byte in its name).
        raise CheckpointCorruptError(
            f"{where} is damaged: its integrity checksum is missing. Restore the file or load "
            f"an earlier checkpoint.",
            where,
        )
    if version >= 3:
        try:
            decoded = _decode_v3(doc, where)
            if version == INCREMENTAL_VERSION:
                decoded = replace(decoded, incremental=_incremental_section(doc.get("incremental"), where))
            return decoded
        except (CheckpointCorruptError, UnsupportedCodecError):
            raise
        except _MALFORMED as err:
            raise _malformed(err, where) from err
    try:
        state_dict_metadata: dict[str, Any] = {}
        for fqn, entry in doc["state_dict"].items():
            kind = entry["kind"]
            if kind == "bytes":
                state_dict_metadata[fqn] = BytesStorageMetadata()
                continue
            if kind != "tensor":
                raise CheckpointCorruptError(f"{where}: key {fqn!r} has unknown kind {kind!r}", where)
            size = _int_list(entry["size"], f"size of {fqn!r}", where)
            chunks = []
            for chunk in entry["chunks"]:
                offsets = _int_list(chunk["offsets"], f"chunk offsets of {fqn!r}", where)
                sizes = _int_list(chunk["sizes"], f"chunk sizes of {fqn!r}", where)
                if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > n for o, s, n in zip(offsets, sizes, size)
                ):
                    raise CheckpointCorruptError(
                        f"{where}: a chunk of {fqn!r} (offsets {offsets}, sizes {sizes}) "
                        f"lies outside the tensor's size {size}",
                        where,
                    )
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            try:
                dtype = dtype_from_name(entry["dtype"])
            except ValueError as err:
                raise CheckpointCorruptError(f"{where}: key {fqn!r}: {err}", where) from err
            state_dict_metadata[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype, requires_grad=bool(entry.get("requires_grad", False))),
                size=torch.Size(size),
                chunks=chunks,
            )
        files = {
            validate_file_name(name, where): _nonneg(size, f"size of {name!r}", where)
            for name, size in doc["files"].items()
        }
        storage: dict[MetadataIndex, StoredItem] = {}
        for record in doc["items"]:
            fqn = record["fqn"]
            if fqn not in state_dict_metadata:
                raise CheckpointCorruptError(f"{where}: item for unknown key {fqn!r}", where)
            offset = record["offset"]
            index = MetadataIndex(fqn, None if offset is None else _int_list(offset, f"offset of {fqn!r}", where))
            name = validate_file_name(record["file"], where)
            item = StoredItem(
                name,
                _nonneg(record["at"], "item offset", where),
                _nonneg(record["length"], "item length", where),
                _nonneg(record["data_at"], "data offset", where),
                _nonneg(record["data_length"], "data length", where),
            )
            item = _decode_frames(record, item, fqn, where)
            if item.data_offset + item.data_length > item.length:
                raise CheckpointCorruptError(
                    f"{where}: item {fqn!r} claims data outside its own byte range", where
                )
            if name not in files or item.offset + item.length > files[name]:
                raise CheckpointCorruptError(
                    f"{where}: item {fqn!r} lies outside file {name!r} as recorded", where
                )
            storage[index] = item
        metadata = _metadata(doc, state_dict_metadata, storage)
        world_size = _world_size(doc, where)
        created = _created(doc, where)
    except CheckpointCorruptError:
        raise
    except _MALFORMED as err:
        raise _malformed(err, where) from err
    return DecodedMetadata(metadata, files, world_size, created)


def _malformed(err: BaseException, where: str) -> CheckpointCorruptError:
    """The error for a document whose structure broke a decoder (``err``)."""
    detail = "nested too deeply" if isinstance(err, RecursionError) else f"{type(err).__name__}: {str(err)[:200]}"
    return CheckpointCorruptError(f"{where} is malformed ({detail}); the metadata file is damaged", where)


def _metadata(doc: dict[str, Any], state_dict_metadata: dict[str, Any], storage: Any) -> Metadata:
    meta_in = doc.get("storage_meta")
    storage_meta = (
        None
        if meta_in is None
        else StorageMeta(
            checkpoint_id=meta_in.get("checkpoint_id"),
            save_id=meta_in.get("save_id"),
            modules=list(meta_in.get("modules") or []),
        )
    )
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=decode_tree(doc.get("planner_data")),
        storage_data=storage,
        storage_meta=storage_meta,
        version=str(doc.get("dcp_version", DCP_VERSION)),
    )


def _decode_v3(doc: dict[str, Any], where: str) -> DecodedMetadata:
    """A version-3 document: files with their frame indexes, codecs, the chunk table."""
    names: list[str] = []
    sizes: list[int] = []
    indexes: dict[str, FrameIndexRef] = {}
    for entry in doc["files"]:
        if not isinstance(entry, list) or len(entry) != 5:
            raise CheckpointCorruptError(f"{where}: malformed file entry {_short(entry)}", where)
        name = validate_file_name(entry[0], where)
        size = _nonneg(entry[1], f"size of {name!r}", where)
        at = _nonneg(entry[2], f"frame index offset of {name!r}", where)
        length = _nonneg(entry[3], f"frame index length of {name!r}", where)
        digest = entry[4]
        if at + length != size or not isinstance(digest, str) or not _HEX16.fullmatch(digest):
            raise CheckpointCorruptError(f"{where}: file {name!r} has a malformed frame index entry", where)
        if length > MAX_INDEX_BYTES:
            raise CheckpointCorruptError(
                f"{where}: file {name!r} claims a frame index of {length} bytes (at most {MAX_INDEX_BYTES})", where
            )
        if name in indexes:
            raise CheckpointCorruptError(f"{where}: file {name!r} is listed twice", where)
        names.append(name)
        sizes.append(size)
        indexes[name] = FrameIndexRef(at, length, int(digest, 16))
    codecs = []
    for codec in doc["codecs"]:
        if not isinstance(codec, list) or not codec or not all(isinstance(c, str) for c in codec):
            raise CheckpointCorruptError(f"{where}: invalid codec {_short(codec)}", where)
        codecs.append(tuple(codec))
    keys, extent = _key_entries(doc["state_dict"], where)
    table = decode_table(doc["chunk_table"], doc.get("chunk_table_codec"), doc["chunk_table_bytes"], where,
                         needed=extent)
    locations = ChunkLocations(names, codecs, sizes, where, incremental=doc.get("version") == INCREMENTAL_VERSION)
    state_dict_metadata: dict[str, Any] = {}
    for fqn, entry in doc["state_dict"].items():
        kind = entry["kind"]
        key = keys[fqn]
        if kind == "bytes":
            rows, no_offsets, _, columns = key_rows(table, key.first, key.rows, 0, fqn, where)
            if rows != 1:
                raise CheckpointCorruptError(f"{where}: bytes value {fqn!r} has {rows} chunks", where)
            state_dict_metadata[fqn] = BytesStorageMetadata()
            locations.add_key(fqn, False, no_offsets, columns)
            continue
        if kind != "tensor":
            raise CheckpointCorruptError(f"{where}: key {fqn!r} has unknown kind {kind!r}", where)
        shape = key.shape
        _, offsets, chunk_sizes, columns = key_rows(table, key.first, key.rows, len(shape), fqn, where)
        try:
            dtype = dtype_from_name(entry["dtype"])
        except ValueError as err:
            raise CheckpointCorruptError(f"{where}: key {fqn!r}: {err}", where) from err
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=bool(entry.get("requires_grad", False))),
            size=torch.Size(shape),
            # Columns, not objects: a loading rank plans on the arrays (dcp_ext.planning._tensor_reads).
            chunks=columns_of(offsets, chunk_sizes, shape, fqn, where),  # type: ignore[arg-type]
        )
        locations.add_key(fqn, True, offsets, columns)
    metadata = _metadata(doc, state_dict_metadata, locations)
    files = dict(zip(names, sizes))
    return DecodedMetadata(metadata, files, _world_size(doc, where), _created(doc, where), indexes)


class _KeyEntry(NamedTuple):
    """A key's entry in a version-3 document, checked: its tensor's shape
    (``[]`` for anything but a tensor) and its rows of the chunk table."""

    shape: list[int]
    first: int
    rows: int


def _key_entries(state_dict: Any, where: str) -> tuple[dict[str, _KeyEntry], int]:
    """Each key's shape and rows, and the integers of the chunk table they
    span, from the document alone: the declared table size is checked against
    it before anything is decompressed, so a small document cannot make a
    reader allocate a table its keys do not use."""
    if not isinstance(state_dict, dict):
        raise CheckpointCorruptError(f"{where}: its state_dict is not an object", where)
    keys: dict[str, _KeyEntry] = {}
    end = 0
    for fqn, entry in state_dict.items():
        if not isinstance(entry, dict):
            raise CheckpointCorruptError(f"{where}: key {fqn!r} has a malformed entry", where)
        tensor = entry.get("kind") == "tensor"
        shape = _int_list(entry.get("size"), f"size of {fqn!r}", where) if tensor else []
        first, rows = table_entry(entry.get("table"), fqn, where)
        if not tensor and rows != 1:
            raise CheckpointCorruptError(f"{where}: bytes value {fqn!r} has {rows} chunks", where)
        end = max(end, first + rows * key_width(len(shape)))
        keys[fqn] = _KeyEntry(shape, first, rows)
    return keys, end


def read_incremental_section(data: bytes, where: str) -> IncrementalSection | None:
    """The ``incremental`` section of a metadata document (``None`` for any
    other version), without decoding the rest: what retention needs to know
    of every kept checkpoint.

    Raises:
        CheckpointCorruptError: The document is damaged.
    """
    check_integrity(data, where)
    doc = parse_stored_json(data, where)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where} is not dcp_ext metadata", where)
    if doc.get("version") != INCREMENTAL_VERSION:
        return None
    try:
        return _incremental_section(doc.get("incremental"), where)
    except CheckpointCorruptError:
        raise
    except _MALFORMED as err:
        raise _malformed(err, where) from err


def _incremental_section(section: Any, where: str) -> IncrementalSection:
    """A version-4 document's ``incremental`` section, checked."""
    if not isinstance(section, dict):
        raise CheckpointCorruptError(f"{where}: version 4 metadata without a valid incremental section", where)
    base = section.get("base")
    if base is not None and not isinstance(base, str):
        raise CheckpointCorruptError(f"{where}: incremental base {base!r} is not a tag", where)
    chain = _nonneg(section.get("chain"), "incremental chain", where)
    references: dict[str, int] = {}
    for entry in section.get("references", []):
        if not isinstance(entry, list) or len(entry) != 2:
            raise CheckpointCorruptError(f"{where}: malformed incremental reference {entry!r}", where)
        split_reference(entry[0], where)
        references[entry[0]] = _nonneg(entry[1], f"bytes referenced in {entry[0]!r}", where)
    sizes: dict[str, int] = {}
    for entry in section.get("sizes", []):
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] not in references:
            raise CheckpointCorruptError(f"{where}: malformed referenced file size {entry!r}", where)
        sizes[entry[0]] = _nonneg(entry[1], f"size of {entry[0]!r}", where)
    return IncrementalSection(base, chain, references, sizes)


def _decode_frames(record: dict[str, Any], base: StoredItem, fqn: str, where: str) -> StoredItem:
    """The frame fields of an item record, checked for consistency."""
    codec = record.get("codec")
    frame_size = record.get("frame")
    if codec is None and frame_size is None:
        return base
    what = f"item {fqn!r}"
    transforms: tuple[str, ...] = ()
    raw_length = -1
    if codec is not None:
        if not isinstance(codec, list) or not codec or not all(isinstance(c, str) for c in codec):
            raise CheckpointCorruptError(f"{where}: {what} has an invalid codec {codec!r}", where)
        transforms = tuple(codec)
        raw_length = _nonneg(record.get("raw_length"), f"raw length of {fqn!r}", where)
    frame_size = _nonneg(frame_size, f"frame size of {fqn!r}", where)
    if not 0 < frame_size <= MAX_FRAME_SIZE:
        raise CheckpointCorruptError(
            f"{where}: {what} claims a frame size of {frame_size} bytes (at most {MAX_FRAME_SIZE})", where
        )
    raw_size = base.data_length if raw_length < 0 else raw_length
    count = -(-raw_size // frame_size)
    lengths: tuple[int, ...] = ()
    if transforms:
        lengths = tuple(_int_list(record.get("frames"), f"frame lengths of {fqn!r}", where))
        if len(lengths) != count or sum(lengths) != base.data_length:
            raise CheckpointCorruptError(
                f"{where}: {what} records {len(lengths)} frames of {sum(lengths)} bytes; "
                f"{raw_size} raw bytes in frames of {frame_size} need {count} frames "
                f"and its data is {base.data_length} bytes",
                where,
            )
    sums = record.get("xxh3")
    if not isinstance(sums, list) or len(sums) != count:
        raise CheckpointCorruptError(
            f"{where}: {what} needs {count} frame checksums, has "
            f"{len(sums) if isinstance(sums, list) else sums!r}",
            where,
        )
    try:
        checksums = tuple(int(c, 16) for c in sums if isinstance(c, str) and len(c) == 16)
    except ValueError:
        checksums = ()
    if len(checksums) != count:
        raise CheckpointCorruptError(f"{where}: {what} has malformed checksums", where)
    return StoredItem(
        base.relative_path,
        base.offset,
        base.length,
        base.data_offset,
        base.data_length,
        raw_length,
        transforms,
        frame_size,
        lengths,
        checksums,
    )


def read_created(head: bytes) -> float | None:
    """The commit time (``created``) from the first bytes of a metadata document.

    The document's leading keys come in a fixed order with ``created`` among
    the first, so listing a root reads a few hundred bytes per checkpoint
    instead of whole documents (see :func:`read_leading_field`).

    Args:
        head: The document's first bytes (or all of it).

    Returns:
        ``created`` in seconds since the epoch; ``None`` if ``head`` ends
        before it, it is not a number, or ``head`` is not the start of a JSON
        object.
    """
    value = read_leading_field(head, "created")
    # NaN, Infinity or 10**400 in a sealed document must not break listing a
    # whole root (sorting by NaN, float() overflowing): such a time is unknown.
    return float(value) if _is_time(value) else None


def read_leading_field(head: bytes, name: str) -> Any:
    """The value of the top-level member ``name`` from the first bytes of a
    metadata document (``format``, ``version``, ``created`` lead it).

    Walks the document's leading ``"key": value`` members one by one as JSON
    (a nested value is parsed whole, so a ``name`` inside one is never
    mistaken for the field).

    Returns:
        The value; ``None`` if ``head`` ends before it or is not the start of
        a JSON object. Non-JSON constants (``NaN``, ``Infinity``) come back as
        the floats Python reads; callers check the value's type and range.
    """
    text = head.decode("utf-8", errors="ignore")  # the cut may split a character
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if not text.startswith("{", pos):
        return None
    pos += 1
    try:
        while True:
            pos = _skip_space(text, pos)
            if not text.startswith('"', pos):
                return None  # the end of the object, or not JSON
            key, pos = decoder.raw_decode(text, pos)
            pos = _skip_space(text, pos)
            if not text.startswith(":", pos):
                return None
            value, pos = decoder.raw_decode(text, _skip_space(text, pos + 1))
            pos = _skip_space(text, pos)
            if not text.startswith((",", "}"), pos):
                return None  # the head may end inside this value (a cut number parses)
            if key == name:
                return value
            if text.startswith("}", pos):
                return None
            pos += 1
    except (ValueError, RecursionError):
        return None  # the head ends inside this member, or it is not JSON (or nested too deeply)


def _skip_space(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not JSON whitespace."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
