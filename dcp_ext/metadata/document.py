"""dcp_ext's metadata document: its format, the items it records, and its integrity (writing it: :mod:`.encode`).

dcp_ext's own metadata is ``dcp_ext.metadata.json``, a plain JSON document, so
loading a checkpoint never unpickles anything. It is written last and is the
commit marker of a checkpoint. Layout (version 2)::

    {
      "format": "dcp_ext", "version": 2, "dcp_version": "1.0.0",
      "torch_version": "2.13.0", "byteorder": "little", "created": 1763766000.0,
      "storage_meta": {"checkpoint_id": "...", "save_id": "...", "modules": []},
      "planner_data": <a dcp_ext.format._tagged_json tree>,
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
applied left to right, see :mod:`dcp_ext.format._codecs`) store ``raw_length`` raw
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
(written just after the JSON) when no item is compressed. Reading a
checkpoint that has only the pickle (written by torch's own writers) goes
through :func:`dcp_ext.metadata.torch_pickle.load_torch_metadata`, a
restricted unpickler that admits DCP's metadata classes and nothing else.
Reading this document is :mod:`dcp_ext.metadata.decode`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .._runtime import _StorageInfo, validate_name_part, validate_relative_name
from ..errors import CheckpointCorruptError

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
    "seal",
    "check_integrity",
    "chunk_shapes",
]

METADATA_FILE = "dcp_ext.metadata.json"
"""dcp_ext's metadata document in each checkpoint directory (JSON); the coordinator writes it
after every rank's data is durable: its presence commits the checkpoint."""
TORCH_METADATA_FILE = ".metadata"
"""torch's pickled metadata file, written after dcp_ext's (the commit marker torch's tools look
for)."""
FORMAT = "dcp_ext"
FORMAT_VERSION = 3
"""The version of the metadata document saves write by default (``IOConfig.metadata_version``)."""
#: Version 3 plus an ``incremental`` section (:mod:`dcp_ext.incremental._save`):
#: written by incremental saves only, so older readers refuse them clearly.
INCREMENTAL_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
DCP_VERSION = "1.0.0"

# Largest frame a writer produces (IOConfig.frame_size's bound): a reader
# never allocates more than this for one frame, whatever metadata claims.
MAX_FRAME_SIZE = 256 * 1024 * 1024
"""Largest frame a writer produces (``IOConfig.frame_size``'s bound): a reader never allocates
more than this for one frame, whatever the metadata claims."""

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
