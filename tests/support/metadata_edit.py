"""Editing a checkpoint's JSON metadata in tests, the way an attacker (or a
buggy tool) would: change the document, then recompute its ``integrity``
checksum (which guards against damage, not against deliberate edits), so the
reader's other checks are what the test exercises."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_ext.metadata import seal as sign

__all__ = ["sign", "edit_metadata"]


def edit_metadata(path: Path, change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Apply ``change`` to the document at ``path`` (in place) and re-sign it."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_bytes(sign(doc))
    return doc


def stored_items(where: Any) -> dict[str, dict[str, Any]]:
    """Each stored item of a checkpoint (any metadata version) as the fields
    tests look at, by key: ``codec``, ``xxh3``, ``frames``, ``at``, ``data_at``,
    ``data_length``, ``file``.

    Args:
        where: A checkpoint directory, or a dcp_ext store opened on one.
    """
    from dcp_ext.metadata import METADATA_FILE, decode_metadata
    from dcp_ext.metadata.chunk_table import ChunkLocations
    from dcp_ext.metadata.frame_index import attach_frame_indexes
    from dcp_ext.storage import open_store
    from dcp_ext.config import IOConfig

    store = open_store(str(where), IOConfig(), {}) if isinstance(where, (str, Path)) else where
    decoded = decode_metadata(store.read_file(METADATA_FILE), "metadata")
    locations = decoded.metadata.storage_data
    if isinstance(locations, ChunkLocations):
        attach_frame_indexes(locations, list(decoded.frame_indexes), decoded.frame_indexes,
                             lambda n, r: store.read_range(n, r.at, r.length), store.describe)
    return {
        index.fqn: {"codec": list(item.transforms) or None, "xxh3": list(item.checksums),
                    "frames": list(item.frame_lengths), "at": item.offset, "data_at": item.data_offset,
                    "data_length": item.data_length, "file": item.relative_path}
        for index, item in locations.items()
    }
