"""Checkpoint metadata on storage: dcp_ext's JSON document and torch's pickle.

dcp_ext's own metadata is ``dcp_ext.metadata.json``, a plain JSON document, so
loading a checkpoint never unpickles anything. It is written last and is the
commit marker of a checkpoint. Layout (version 2)::

    {
      "format": "dcp_ext", "version": 2, "dcp_version": "1.0.0",
      "torch_version": "2.13.0", "byteorder": "little", "created": 1763766000.0,
      "storage_meta": {"checkpoint_id": "...", "save_id": "...", "modules": []},
      "planner_data": <tagged JSON, see _encode_value>,
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
(written just before the JSON) when no item is compressed. Reading a checkpoint that has only the pickle
(written by torch's own writers) goes through :func:`load_torch_metadata`, a
restricted unpickler that admits DCP's metadata classes and nothing else.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ._compat import _StorageInfo
from ._torch_format import dtype_from_name, dtype_name
from .errors import CheckpointCorruptError

__all__ = [
    "METADATA_FILE",
    "TORCH_METADATA_FILE",
    "FORMAT_VERSION",
    "StoredItem",
    "encode_metadata",
    "decode_metadata",
    "to_torch_metadata",
    "load_torch_metadata",
    "validate_file_name",
    "read_created",
]

METADATA_FILE = "dcp_ext.metadata.json"
TORCH_METADATA_FILE = ".metadata"
FORMAT = "dcp_ext"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)
DCP_VERSION = "1.0.0"

# Largest frame a writer produces (IOConfig.frame_size's bound): a reader
# never allocates more than this for one frame, whatever metadata claims.
MAX_FRAME_SIZE = 256 * 1024 * 1024

# The metadata's own checksum: the last field, over the document with it zeroed.
_INTEGRITY_PLACEHOLDER = "xxh3-64:" + "0" * 16
_INTEGRITY_RE = re.compile(rb'"integrity":"(xxh3-64:[0-9a-f]{16})"\}$')

# Relative names only: no absolute paths, no "..", no empty parts, no NUL.
_NAME_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._\-]{0,254}$")


def validate_file_name(name: object, where: str) -> str:
    """Check that a data-file name from metadata stays inside the checkpoint.

    Raises:
        CheckpointCorruptError: ``name`` is absolute, has ``..`` or odd characters.
    """
    if not isinstance(name, str) or not name or len(name) > 1024:
        raise CheckpointCorruptError(f"{where}: invalid data file name {name!r}", where)
    for part in name.split("/"):
        if not _NAME_PART.match(part) or part in (".", ".."):
            raise CheckpointCorruptError(
                f"{where}: data file name {name!r} is not a plain relative name; "
                f"refusing to read outside the checkpoint",
                where,
            )
    return name


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

    @property
    def raw_size(self) -> int:
        """Bytes of raw data the item decodes to."""
        return self.data_length if self.raw_length < 0 else self.raw_length

    def to_torch(self) -> _StorageInfo:
        """The torch ``_StorageInfo`` that torch's readers understand."""
        return _StorageInfo(self.relative_path, self.offset, self.length)


# -- tagged JSON for planner_data -----------------------------------------------
def _encode_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"__float__": repr(value)}
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode_value(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where}: planner_data dict keys must be strings")
        return {"__dict__": {k: _encode_value(v, where) for k, v in value.items()}}
    raise TypeError(
        f"{where}: planner_data holds a {type(value).__name__}, which dcp_ext's "
        f"JSON metadata cannot store; use strings, numbers, lists, tuples and dicts"
    )


def _decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_decode_value(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: _decode_value(v) for k, v in value["__dict__"].items()}
        if "__float__" in value:
            return float(value["__float__"])
        raise ValueError(f"unknown tagged value {sorted(value)}")
    return value


# -- writing ----------------------------------------------------------------------
def encode_metadata(
    metadata: Metadata,
    items: dict[MetadataIndex, StoredItem],
    *,
    world_size: int,
) -> bytes:
    """Serialize ``metadata`` and where its items live as dcp_ext's JSON."""
    where = METADATA_FILE
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
    storage_meta = metadata.storage_meta
    document = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dcp_version": DCP_VERSION,
        "torch_version": torch.__version__.split("+")[0],
        "byteorder": "little",
        "created": time.time(),
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
        "planner_data": _encode_value(metadata.planner_data, where),
        "checksum": "xxh3-64",
        "state_dict": state_dict,
        "items": records,
        "files": files,
    }
    return seal(document)


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


def to_torch_metadata(metadata: Metadata, items: dict[MetadataIndex, StoredItem]) -> bytes:
    """Torch's pickled ``.metadata`` for the same checkpoint (interop only)."""
    torch_md = Metadata(
        state_dict_metadata=metadata.state_dict_metadata,
        planner_data=metadata.planner_data,
        storage_data={index: item.to_torch() for index, item in items.items()},
        storage_meta=metadata.storage_meta,
        version=DCP_VERSION,
    )
    return pickle.dumps(torch_md)


# -- reading ----------------------------------------------------------------------
def _int_list(value: Any, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise CheckpointCorruptError(f"{where}: {what} must be a list of non-negative integers", where)
    return value


def _nonneg(value: Any, what: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointCorruptError(f"{where}: {what} must be a non-negative integer, got {value!r}", where)
    return value


@dataclass(frozen=True)
class DecodedMetadata:
    """What :func:`decode_metadata` returns."""

    metadata: Metadata
    files: dict[str, int]
    world_size: int
    created: float = 0.0


def decode_metadata(data: bytes, where: str) -> DecodedMetadata:
    """Parse and validate dcp_ext's JSON metadata.

    Args:
        data: The file's bytes.
        where: The file's location, for messages.

    Raises:
        CheckpointCorruptError: The document is not valid dcp_ext metadata.
    """
    verified = check_integrity(data, where)
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(
            f"{where} is not valid JSON ({err}); the metadata file is damaged", where
        ) from err
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where} is not dcp_ext metadata", where)
    version = doc.get("version")
    if version not in _READABLE_VERSIONS:
        raise CheckpointCorruptError(
            f"{where} has metadata version {version!r}; this dcp_ext reads versions "
            f"{', '.join(map(str, _READABLE_VERSIONS))}. Upgrade dcp_ext to load it.",
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
        metadata = Metadata(
            state_dict_metadata=state_dict_metadata,
            planner_data=_decode_value(doc.get("planner_data")),
            storage_data=storage,
            storage_meta=storage_meta,
            version=str(doc.get("dcp_version", DCP_VERSION)),
        )
        world_size = int(doc.get("world_size", 0))
        created = float(doc.get("created", 0) or 0)
    except CheckpointCorruptError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointCorruptError(
            f"{where} is malformed ({type(err).__name__}: {err}); the metadata file is damaged",
            where,
        ) from err
    return DecodedMetadata(metadata, files, world_size, created)


def read_created(head: bytes) -> float | None:
    """The commit time (``created``) from the first bytes of a metadata document.

    The document's leading keys come in a fixed order with ``created`` among
    the first, so listing a root reads a few hundred bytes per checkpoint
    instead of whole documents. Parses the leading ``"key":value`` pairs one
    by one; ``None`` if ``created`` is not in ``head`` or ``head`` is not
    the start of a dcp_ext document.
    """
    try:
        text = head.decode("utf-8", errors="ignore")
    except ValueError:
        return None
    decoder = json.JSONDecoder()
    pos = text.find("{") + 1
    if pos <= 0:
        return None
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            key, pos = decoder.raw_decode(text, pos)
            while pos < len(text) and text[pos] in " \t\r\n:":
                pos += 1
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None  # the head ends inside this pair, or it is not JSON
        if key == "created":
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# -- torch's pickle, restricted -------------------------------------------------
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointCorruptError(
            f"{self.where} refers to {module}.{name}, which is not part of DCP "
            f"metadata; refusing to unpickle it (it could run code). Load this "
            f"checkpoint only if you trust its source, with torch's own reader.",
            self.where,
        )


def load_torch_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle torch's ``.metadata`` admitting only DCP metadata classes.

    Raises:
        CheckpointCorruptError: The pickle is damaged or names any other class
            or function (nothing from it is executed).
    """
    try:
        metadata = _RestrictedUnpickler(data, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:
        raise CheckpointCorruptError(
            f"{where} cannot be read as DCP metadata ({type(err).__name__}: {err}); "
            f"the metadata file is damaged",
            where,
        ) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where} does not hold DCP metadata", where)
    return metadata
