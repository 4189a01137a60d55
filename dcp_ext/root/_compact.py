"""Rewrite an incremental checkpoint self-contained: :func:`compact`.

An incremental checkpoint (:mod:`dcp_ext.incremental._save`) refers to frames stored
in earlier checkpoints' data files. :func:`compact` copies those frames into
new data files of the checkpoint itself, checking each frame's checksum on the
way, and then commits a new metadata document that names the new files and
refers to nothing. The files it replaced are deleted unless another committed
checkpoint refers to them (those are removed by a later leftover pass once
nothing does); earlier checkpoints' files that only this one used become
unreferenced and are removed by the next retention pass or save
(``CheckpointRoot.sweep_retired``).

Crash safety: the new files get new names, and the old document stays the
commit until the new one replaces it in one write, so a crash at any point
leaves the checkpoint loadable (at worst with unused new files beside it).

Which ranks call what: one process. Within a root, call it through
:meth:`dcp_ext.root.CheckpointRoot.compact` (the manager's ``compact``, the
CLI's ``dcp-ext compact``), which takes the checkpoint's save lock, refuses
while a save builds on it, and keeps every replaced file that another
checkpoint refers to.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex

from .._runtime import crash_point
from ..config import IOConfig
from ..dcp_io import CheckpointReader
from ..errors import ChecksumMismatchError
from ..frames import checksum, frame_table
from ..layout import DATA_SUFFIX
from ..metadata import METADATA_FILE, StoredItem, encode_metadata
from ..metadata.chunk_table import ChunkLocations
from ..metadata.document import FrameIndexRef
from ..metadata.frame_index import attach_frame_indexes, encode_frame_index
from ..storage import Location, Piece, Store, plan_requests
from ._verify import read_own_metadata

__all__ = ["compact", "CompactReport"]

# Stored bytes copied per read batch.
_BATCH_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class CompactReport:
    """What :func:`compact` did.

    Attributes:
        path: The checkpoint.
        rewritten: ``(old name, new name)`` of each data file rewritten.
        copied_bytes: Stored bytes copied from earlier checkpoints' files.
        kept_old: Replaced files kept because another checkpoint refers to them.
    """

    path: str
    rewritten: tuple[tuple[str, str], ...] = ()
    copied_bytes: int = 0
    kept_old: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        """Whether any data file was rewritten (``False`` for a checkpoint that refers to no other)."""
        return bool(self.rewritten)


def compact(
    path: str | os.PathLike[str] | Location,
    *,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    referenced_elsewhere: set[str] | None = None,
    before_write: Callable[[], None] | None = None,
) -> CompactReport:
    """Make the checkpoint at ``path`` self-contained (see the module docstring).

    Args:
        path: The checkpoint directory (``ROOT/{tag}_partial``).
        storage_options: fsspec/s3fs options.
        config: I/O tunables.
        referenced_elsewhere: This checkpoint's data file names that other
            checkpoints refer to (kept after the rewrite); the manager passes
            them. ``None``: keep every replaced file (the caller cannot tell).
        before_write: Called before the first new file is written, when
            there is something to rewrite (the root marks the directory as
            holding strays, so that a kill mid-way is cleaned up).

    Returns:
        What was rewritten; nothing for a checkpoint that refers to no other.

    Raises:
        ChecksumMismatchError: A frame to copy is damaged (nothing is committed).
        CheckpointCorruptError: The metadata, an index or a file is damaged or missing.
    """
    location = Location.of(path, storage_options, config)
    config = location.config
    store = location.open()
    decoded = read_own_metadata(location, store)
    section = decoded.incremental
    locations = decoded.metadata.storage_data
    if section is None or not section.references or not isinstance(locations, ChunkLocations):
        return CompactReport(store.url)
    reader = CheckpointReader(location, store=store)
    attach_frame_indexes(
        locations, list(decoded.files), decoded.frame_indexes,
        lambda name, ref: store.read_range(name, ref.at, ref.length, allow_short=True), store.describe,
        config.max_concurrency,
    )
    by_file: dict[str, list[tuple[MetadataIndex, StoredItem]]] = {}
    for index in locations:
        item = locations[index]
        by_file.setdefault(item.relative_path, []).append((index, item))
    if before_write is not None:
        before_write()
    stamp = uuid.uuid4().hex[:8]
    items: dict[MetadataIndex, StoredItem] = {}
    rewritten: list[tuple[str, str]] = []
    copied = 0
    for name, entries in by_file.items():
        entries.sort(key=lambda e: e[1].offset)
        if not any(item.references for _, item in entries):
            ref = decoded.frame_indexes[name]
            items.update((index, dataclasses.replace(item, frame_index=ref)) for index, item in entries)
            continue
        new_name = name.removesuffix(DATA_SUFFIX) + f"-c{stamp}{DATA_SUFFIX}"
        written, nbytes = _rewrite(reader, store, new_name, entries)
        items.update(written)
        copied += nbytes
        rewritten.append((name, new_name))
    crash_point("mid_compact")
    document = encode_metadata(
        decoded.metadata, items, world_size=decoded.world_size, version=3,
        incremental={"base": None, "chain": 0, "references": []},
    )
    store.write_file(METADATA_FILE, document)  # the commit
    keep = referenced_elsewhere if referenced_elsewhere is not None else {old for old, _ in rewritten}
    kept = []
    for old, _ in rewritten:
        if old in keep:
            kept.append(old)
        else:
            store.delete(old)
    return CompactReport(store.url, tuple(rewritten), copied, tuple(kept))


def _copy_frames(
    reader: CheckpointReader, store: Store, writer: Any, index: MetadataIndex, item: StoredItem
) -> tuple[list[int], int]:
    """Append every frame of ``item`` to ``writer``, checked, in batches of
    at most ``_BATCH_BYTES``; where each now starts, and the bytes copied
    from other checkpoints' files."""
    table = frame_table(item, reader.describe(item.relative_path))
    frames = [table.frame(k) for k in range(len(table))]
    offsets: list[int] = []
    copied = 0
    first = 0
    while first < len(frames):
        last, size = first, 0
        while last < len(frames) and (last == first or size + frames[last].stored_length <= _BATCH_BYTES):
            size += frames[last].stored_length
            last += 1
        batch = [(f, memoryview(bytearray(f.stored_length))) for f in frames[first:last]]
        pieces = [Piece(f.file, f.stored_offset, buf) for f, buf in batch]
        reader.read_requests(plan_requests(pieces, gap=store.coalesce_gap, max_request=reader.config.read_request_size))
        for frame, buf in batch:
            if frame.checksum is not None and checksum(buf) != frame.checksum:
                where = reader.describe(frame.file)
                raise ChecksumMismatchError(
                    f"{where}: bytes [{frame.stored_offset}, {frame.stored_offset + frame.stored_length}) fail "
                    f"their checksum; they hold frame {frame.index + 1} of {frame.count} of {index.fqn!r}. "
                    f"Nothing was compacted; restore the file first",
                    where,
                )
            offsets.append(writer.position)
            writer.write(buf)
            if frame.file != item.relative_path:
                copied += frame.stored_length
        first = last
    return offsets, copied


def _rewrite(
    reader: CheckpointReader, store: Store, name: str, entries: list[tuple[MetadataIndex, StoredItem]]
) -> tuple[dict[MetadataIndex, StoredItem], int]:
    """Write one data file holding every frame of ``entries`` (in order), its
    frame index at the end; the items as they now lie, and the bytes copied
    from other checkpoints' files."""
    out: dict[MetadataIndex, StoredItem] = {}
    stored: list[tuple[MetadataIndex, StoredItem]] = []
    copied = 0
    with store.open_writer(name, size_hint=sum(item.data_length for _, item in entries)) as writer:
        for index, item in entries:
            start = writer.position
            offsets, nbytes = _copy_frames(reader, store, writer, index, item)
            copied += nbytes
            stored.append((index, dataclasses.replace(
                item, relative_path=name, offset=start, length=writer.position - start, data_offset=0,
                frame_offsets=tuple(offsets), frame_sources=(), indexed=False, frame_index=None,
            )))
        index_bytes = encode_frame_index([item for _, item in stored])
        ref = FrameIndexRef(writer.position, len(index_bytes), xxhash.xxh3_64_intdigest(index_bytes))
        writer.write(index_bytes)
        writer.commit()
    for index, item in stored:
        out[index] = dataclasses.replace(item, frame_lengths=(), checksums=(), frame_hashes=b"",
                                         frame_offsets=(), indexed=True, frame_index=ref)
    return out, copied
