"""dcp_ext's metadata document: its format, writing it, and its integrity.

dcp_ext's own metadata is ``dcp_ext.metadata.json``, a plain JSON document, so
loading a checkpoint never unpickles anything. It is written last and is the
commit marker of a checkpoint. Layout (version 2)::

    {
      "format": "dcp_ext", "version": 2, "dcp_version": "1.0.0",
      "torch_version": "2.13.0", "byteorder": "little", "created": 1763766000.0,
      "storage_meta": {"checkpoint_id": "...", "save_id": "...", "modules": []},
      "planner_data": <a dcp_ext.tagged_json tree>,
      "state_dict": {
        "model.weight": {"kind": "tensor", "dtype": "bfloat16", "size": [4, 8],
                         "requires_grad": false,
                         "chunks": [{"offsets": [0, 0], "sizes": [2, 8]}, ...]},
        "step": {"kind": "bytes"}
      },
      "checksum": "xxh3-64",
      "items": [
        {"fqn": "model.weight", "offset": [0, 0], "file": "__0_0.distcp",
         "at": 0, "length": 1800, "data_at": 704, "data_length": 32,
         "frame": 4194304, "xxh3": ["9f86d081884c7d65"]},
        {"fqn": "model.bias", "offset": [0], "file": "__0_0.distcp",
         "at": 1800, "length": 41, "data_at": 0, "data_length": 41,
         "raw_length": 64, "codec": ["bytegroup.2/1", "zstd/1"],
         "frame": 4194304, "frames": [41], "xxh3": ["2c26b46b68ffc68f"]},
        ...
      ],
      "files": {"__0_0.distcp": 123456, ...},
      "integrity": "xxh3-64:5d5b09e5ef8b4c1a"
    }

``items`` says where each stored chunk lives: ``length`` bytes at ``at`` of
``file``; the item's data is the ``data_length`` bytes starting ``data_at``
bytes into the item. Uncompressed tensors store their raw row-major
little-endian bytes there, inside a ``torch.save`` envelope that keeps
torch's readers working. Compressed items (``codec`` present: transforms
applied left to right, see :mod:`dcp_ext.codecs`) store ``raw_length`` raw
bytes as independent frames of ``frame`` raw bytes each (the last shorter),
``frames`` giving each frame's stored length. Every frame's stored bytes have
an xxh3-64 checksum in ``xxh3`` (16 hex digits, in frame order; an
uncompressed item's frames are ``frame`` bytes of its data each). ``files``
gives each data file's size, so truncation is detected before any read.
``integrity``, always the last field, is the xxh3-64 of the document's bytes
with its own 16 hex digits replaced by zeros: any damage to the metadata is
detected before it is parsed.
Version 1 documents (no ``frame``/``xxh3``/``codec``) are read as
uncompressed data without checksums.

For interoperability the writer also stores torch's pickled ``.metadata``
(written just before the JSON) when no item is compressed. Reading a
checkpoint that has only the pickle (written by torch's own writers) goes
through :func:`dcp_ext.metadata.torch_pickle.load_torch_metadata`, a
restricted unpickler that admits DCP's metadata classes and nothing else.
Reading this document is :mod:`dcp_ext.metadata.decode`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from .._compat import _StorageInfo
from .._torch_format import dtype_name
from .._names import validate_name_part, validate_relative_name
from ..errors import CheckpointCorruptError
from ..tagged_json import UnsupportedValueError, encode_tree
from .chunk_columns import as_columns

__all__ = [
    "METADATA_FILE",
    "TORCH_METADATA_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "INCREMENTAL_VERSION",
    "READABLE_VERSIONS",
    "DCP_VERSION",
    "MAX_FRAME_SIZE",
    "StoredItem",
    "validate_file_name",
    "REFERENCE_PREFIX",
    "reference_name",
    "split_reference",
    "encode_metadata",
    "seal",
    "check_integrity",
    "chunk_shapes",
]

METADATA_FILE = "dcp_ext.metadata.json"
TORCH_METADATA_FILE = ".metadata"
FORMAT = "dcp_ext"
FORMAT_VERSION = 3
#: Version 3 plus an ``incremental`` section (:mod:`dcp_ext.incremental`):
#: written by incremental saves only, so older readers refuse them clearly.
INCREMENTAL_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
DCP_VERSION = "1.0.0"

# Largest frame a writer produces (IOConfig.frame_size's bound): a reader
# never allocates more than this for one frame, whatever metadata claims.
MAX_FRAME_SIZE = 256 * 1024 * 1024

# The metadata's own checksum: the last field, over the document with it zeroed.
_INTEGRITY_PLACEHOLDER = "xxh3-64:" + "0" * 16
_INTEGRITY_RE = re.compile(rb'"integrity":"(xxh3-64:[0-9a-f]{16})"\}$')

#: Data-file names from metadata: the one validator of names read from storage.
validate_file_name = validate_relative_name


#: How a frame stored in another checkpoint's data file is named: relative to
#: the checkpoint's own directory, in a sibling directory under the same root.
REFERENCE_PREFIX = "../"


def reference_name(directory: str, file: str) -> str:
    """The name of ``file`` in the sibling checkpoint directory ``directory``
    (an incremental save's reference to an earlier save's data file)."""
    return f"{REFERENCE_PREFIX}{directory}/{file}"


def split_reference(name: str, where: str) -> tuple[str, str]:
    """``(directory, file)`` of a :func:`reference_name`, both checked to be
    plain relative names (the directory one path component).

    Raises:
        CheckpointCorruptError: ``name`` is not a well-formed reference.
    """
    if not isinstance(name, str) or not name.startswith(REFERENCE_PREFIX):
        raise CheckpointCorruptError(f"{where}: {name!r} is not a reference to another checkpoint's file", where)
    directory, _, file = name[len(REFERENCE_PREFIX):].partition("/")
    if not directory:
        raise CheckpointCorruptError(
            f"{where}: reference {name!r} names no plain sibling checkpoint directory; refusing to read it", where
        )
    return validate_name_part(directory, where, "referenced checkpoint directory"), validate_file_name(file, where)


@dataclass(frozen=True)
class FrameIndexRef:
    """Where a data file's frame index lies and what it hashes to (version 3).

    Attributes:
        at: Byte offset of the index in the file.
        length: Its bytes.
        xxh3: xxh3-64 of its bytes.
    """

    at: int
    length: int
    xxh3: int


@dataclass(frozen=True)
class StoredItem:
    """Where one stored chunk (a tensor shard or a bytes object) lives.

    This is the ``storage_data`` of dcp_ext's ``WriteResult`` and of the
    metadata its reader returns.

    Attributes:
        relative_path: Data file name, relative to the checkpoint.
        offset: Byte offset of the item in the file.
        length: Bytes of the whole item (envelope included).
        data_offset: Where the data starts, relative to ``offset``.
        data_length: Bytes of stored data (compressed size when compressed).
        raw_length: Bytes of raw data once decoded; ``-1`` for uncompressed
            items, whose raw data is their stored data.
        transforms: Codec transform descriptors (``()``: uncompressed).
        frame_size: Raw bytes per frame; ``0`` for items written without
            frames (metadata version 1).
        frame_lengths: Stored bytes of each frame of a compressed item.
        checksums: xxh3-64 of each frame's stored bytes.
        indexed: The frame lengths and checksums are in the file's frame
            index (:mod:`dcp_ext.metadata.frame_index`) and not attached yet.
        frame_index: On a writer's results: its file's frame index.
        frame_hashes: Incremental saves: xxh3-128 of each frame's raw
            bytes, 16 bytes each (big-endian digests), in frame order; what
            the next incremental save compares its frames with.
        frame_offsets: Incremental saves: each frame's stored offset in the
            file that holds it. Empty: frames lie back to back from
            ``offset + data_offset`` (every other checkpoint).
        frame_sources: With ``frame_offsets``: which file holds each frame,
            ``""`` for ``relative_path`` itself, else a reference to a data
            file of an earlier checkpoint under the same root
            (:func:`reference_name`: ``"../step10_partial/model_rank0.distcp"``).
    """

    relative_path: str
    offset: int
    length: int
    data_offset: int
    data_length: int
    raw_length: int = -1
    transforms: tuple[str, ...] = ()
    frame_size: int = 0
    frame_lengths: tuple[int, ...] = ()
    checksums: tuple[int, ...] = ()
    indexed: bool = False
    frame_index: FrameIndexRef | None = None
    frame_hashes: bytes = b""
    frame_offsets: tuple[int, ...] = ()
    frame_sources: tuple[str, ...] = ()

    @property
    def raw_size(self) -> int:
        """Bytes of raw data the item decodes to."""
        return self.data_length if self.raw_length < 0 else self.raw_length

    @property
    def references(self) -> bool:
        """Whether some of its frames are stored in an earlier checkpoint's file."""
        return any(self.frame_sources)

    def to_torch(self) -> _StorageInfo:
        """The torch ``_StorageInfo`` that torch's readers understand."""
        return _StorageInfo(self.relative_path, self.offset, self.length)


def _encode_planner_data(value: Any, where: str) -> Any:
    """DCP's ``planner_data`` as a tagged JSON tree (no extra leaf types).

    Raises:
        TypeError: A value JSON cannot store, or a dict with non-string keys.
    """
    try:
        return encode_tree(value)
    except UnsupportedValueError as err:
        if err.bad_key:
            raise TypeError(f"{where}: planner_data dict keys must be strings") from None
        raise TypeError(
            f"{where}: planner_data holds a {type(err.value).__name__}, which dcp_ext's "
            f"JSON metadata cannot store; use strings, numbers, lists, tuples and dicts"
        ) from None


def encode_metadata(
    metadata: Metadata,
    items: Mapping[MetadataIndex, StoredItem],
    *,
    world_size: int,
    version: int = FORMAT_VERSION,
    incremental: dict[str, Any] | None = None,
    created: float | None = None,
) -> bytes:
    """Serialize ``metadata`` and where its items live as dcp_ext's JSON.

    Args:
        metadata: The checkpoint's metadata (from the global plan).
        items: Where each chunk went (the writers' results).
        world_size: Ranks that saved.
        version: ``3`` (items' frame tables in their files' frame indexes,
            a compact chunk table) or ``2`` (everything in the document;
            the items must carry their frame tables).
        incremental: An incremental save's section (``base``, ``chain``,
            ``references``: see :mod:`dcp_ext.incremental`); the document is
            then version 4 (version 3 with this section).
        created: The commit time to record (default: now). A copy of a
            checkpoint written elsewhere first (a tiered save's drain)
            keeps the time of the original save.
    """
    if incremental is not None:
        if version != 3:
            raise ValueError("incremental saves write metadata version 3 (with an incremental section)")
        return _encode_v3(metadata, items, world_size, incremental, created)
    if version == 3:
        return _encode_v3(metadata, items, world_size, created=created)
    if version != 2:
        raise ValueError(f"dcp_ext writes metadata versions 2 and 3, not {version!r}")
    state_dict: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            state_dict[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "size": [int(s) for s in md.size],
                "requires_grad": bool(md.properties.requires_grad),
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in md.chunks
                ],
            }
        else:
            state_dict[fqn] = {"kind": "bytes"}
    files: dict[str, int] = {}
    records = []
    for index, item in sorted(
        items.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)
    ):
        records.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else [int(o) for o in index.offset],
                "file": item.relative_path,
                "at": item.offset,
                "length": item.length,
                "data_at": item.data_offset,
                "data_length": item.data_length,
                **_frame_fields(item),
            }
        )
        files[item.relative_path] = max(files.get(item.relative_path, 0), item.offset + item.length)
    document = _header(metadata, world_size, 2, created)
    document.update({"state_dict": state_dict, "items": records, "files": files})
    return seal(document)


def _header(metadata: Metadata, world_size: int, version: int, created: float | None = None) -> dict[str, Any]:
    """The document's leading fields (``created`` among the first: see ``read_created``)."""
    storage_meta = metadata.storage_meta
    return {
        "format": FORMAT,
        "version": version,
        "dcp_version": DCP_VERSION,
        "torch_version": torch.__version__.split("+")[0],
        "byteorder": "little",
        "created": time.time() if created is None else created,
        "world_size": world_size,
        "storage_meta": None
        if storage_meta is None
        else {
            "checkpoint_id": None
            if storage_meta.checkpoint_id is None
            else str(storage_meta.checkpoint_id),
            "save_id": storage_meta.save_id,
            "modules": list(storage_meta.modules or []),
        },
        "planner_data": _encode_planner_data(metadata.planner_data, METADATA_FILE),
        "checksum": "xxh3-64",
    }


def _encode_v3(
    metadata: Metadata, items: Mapping[MetadataIndex, StoredItem], world_size: int,
    incremental: dict[str, Any] | None = None, created: float | None = None,
) -> bytes:
    """Version 3: a chunk table (:mod:`~dcp_ext.metadata.chunk_table`) and, per file, its frame index."""
    from ..write_results import StoredColumns
    from .table_encode import TableEncoder

    stored = items if isinstance(items, StoredColumns) else _stored_columns(metadata, items)
    table = TableEncoder()
    state_dict: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        a, b = stored.spans[fqn]
        if isinstance(md, TensorStorageMetadata):
            chunks = as_columns(md.chunks, len(md.size))
            state_dict[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(md.properties.dtype),
                "size": [int(s) for s in md.size],
                "requires_grad": bool(md.properties.requires_grad),
                "table": table.add(chunks.offsets, chunks.sizes, stored.rows[a:b]),
            }
        else:
            state_dict[fqn] = {"kind": "bytes", "table": table.add(None, None, stored.rows[a:b])}
    chunk_table, table_codec, raw_bytes = table.finish()
    document = _header(metadata, world_size, 3 if incremental is None else INCREMENTAL_VERSION, created)
    if incremental is not None:
        document["incremental"] = incremental
    document.update({
        "files": [[name, size, ref.at, ref.length, f"{ref.xxh3:016x}"] for name, size, ref in stored.files],
        "codecs": [list(c) for c in stored.codecs],
        "state_dict": state_dict,
        "chunk_table": chunk_table,
        "chunk_table_codec": table_codec,
        "chunk_table_bytes": raw_bytes,
    })
    return seal(document)


def _stored_columns(metadata: Metadata, items: Mapping[MetadataIndex, StoredItem]) -> Any:
    """One ``WriteResult`` per item (writers not planned by dcp_ext's planner)
    as :class:`~dcp_ext.write_results.StoredColumns`, in the metadata's chunk order."""
    import numpy as np

    from ..write_results import StoredColumns

    where = METADATA_FILE
    files: dict[str, tuple[str, int, FrameIndexRef]] = {}
    codecs: dict[tuple[str, ...], int] = {}
    # (key, offsets) tuples hash in C; MetadataIndex hashes in Python.
    by_box = {(index.fqn, index.offset): item for index, item in items.items()}
    spans: dict[str, tuple[int, int]] = {}
    offsets: dict[str, Any] = {}
    rows: list[tuple[int, ...]] = []
    file_ids: dict[str, int] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            columns = as_columns(md.chunks, len(md.size))
            try:
                found = [by_box[(fqn, torch.Size(o))] for o in columns.offsets.tolist()]
            except KeyError as err:
                raise ValueError(f"{where}: no writer reported where a chunk of {fqn!r} went") from err
            offsets[fqn] = columns
        else:
            one = by_box.get((fqn, None))
            if one is None:
                raise ValueError(f"{where}: no writer reported where {fqn!r} went")
            found, offsets[fqn] = [one], None
        spans[fqn] = (len(rows), len(rows) + len(found))
        for item in found:
            file_id = file_ids.get(item.relative_path)
            if file_id is None:
                ref = item.frame_index
                if ref is None:
                    raise ValueError(f"{where}: item in {item.relative_path!r} has no frame index (version 3 needs one)")
                file_id = file_ids[item.relative_path] = len(files)
                files[item.relative_path] = (item.relative_path, ref.at + ref.length, ref)
            codec = codecs.setdefault(item.transforms, len(codecs) + 1) if item.transforms else 0
            rows.append((file_id, item.offset, item.length, item.data_offset, item.data_length,
                         item.raw_length if item.transforms else -1, codec, item.frame_size))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 8)
    return StoredColumns(spans, offsets, table, list(files.values()),
                         [c for c, _ in sorted(codecs.items(), key=lambda kv: kv[1])])


def seal(document: dict[str, Any]) -> bytes:
    """Serialize a metadata document with its ``integrity`` checksum last."""
    document = {k: v for k, v in document.items() if k != "integrity"}
    document["integrity"] = _INTEGRITY_PLACEHOLDER
    data = json.dumps(document, separators=(",", ":")).encode()
    digest = f"xxh3-64:{xxhash.xxh3_64_intdigest(data):016x}".encode()
    return data.replace(_INTEGRITY_PLACEHOLDER.encode(), digest)


def chunk_shapes(metadata: Metadata) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    """``(key, chunk offsets) -> (dtype, chunk sizes)`` for every stored tensor chunk."""
    shapes = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for chunk in md.chunks:
                shapes[(fqn, tuple(chunk.offsets))] = (md.properties.dtype, tuple(int(s) for s in chunk.sizes))
    return shapes


def check_integrity(data: bytes, where: str) -> bool:
    """Check the document's own checksum (the ``integrity`` field: xxh3-64 of
    the document with that field's digest zeroed). Documents written before
    the field existed pass.

    Raises:
        CheckpointCorruptError: The bytes changed after they were written.
    """
    found = _INTEGRITY_RE.search(data)
    if found is None:
        if b'"integrity"' in data:
            raise CheckpointCorruptError(f"{where} is damaged: its integrity field is unreadable", where)
        return False
    zeroed = data[: found.start(1)] + _INTEGRITY_PLACEHOLDER.encode() + data[found.end(1) :]
    actual = f"xxh3-64:{xxhash.xxh3_64_intdigest(zeroed):016x}".encode()
    if actual != found.group(1):
        raise CheckpointCorruptError(
            f"{where} is damaged: its checksum does not match its contents (recorded "
            f"{found.group(1).decode(errors='replace')}, computed {actual.decode()}). Restore the "
            f"file or load an earlier checkpoint.",
            where,
        )
    return True


def _frame_fields(item: StoredItem) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if item.transforms:
        fields["raw_length"] = item.raw_length
        fields["codec"] = list(item.transforms)
    if item.frame_size:
        fields["frame"] = item.frame_size
        if item.transforms:
            fields["frames"] = list(item.frame_lengths)
        fields["xxh3"] = [f"{c:016x}" for c in item.checksums]
    return fields
