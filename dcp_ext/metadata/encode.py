"""Writing dcp_ext's metadata document (:func:`encode_metadata`); its format is in :mod:`.document`."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..format import UnsupportedValueError, dtype_name, encode_tree
from .chunk_columns import as_columns
from .document import (
    DCP_VERSION,
    FORMAT,
    FORMAT_VERSION,
    INCREMENTAL_VERSION,
    METADATA_FILE,
    FrameIndexRef,
    StoredItem,
    seal,
)
from .stored_columns import StoredColumns
from .table_encode import TableEncoder

__all__ = ["encode_metadata"]


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
            ``references``: see :mod:`dcp_ext.incremental._save`); the document is
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
    as :class:`~dcp_ext.metadata.stored_columns.StoredColumns`, in the metadata's chunk order."""
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
