"""Checking a whole checkpoint: :func:`verify`.

Loads verify the frames they read; :func:`verify` reads every byte of every
data file: it checks each frame's xxh3-64 checksum, decompresses compressed
frames, compares the ``torch.save`` envelope around each uncompressed tensor
with the one its dtype and shape produce, and reports every problem it finds
instead of stopping at the first. Use it before
trusting a checkpoint copied between systems, or to find out which files of a
checkpoint that failed to load are damaged (``dcp-ext verify`` in a shell).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..config import IOConfig
from ..dcp_io import CheckpointReader
from ..errors import CheckpointNotFoundError, DcpExtError
from ..format import torch_save_envelope
from ..frames import FrameSpan, frame_fault, frame_table
from ..full import FullCheckpointReader
from ..metadata import METADATA_FILE, DecodedMetadata, StoredItem, decode_metadata
from ..metadata.chunk_table import ChunkLocations
from ..metadata.document import split_reference
from ..metadata.frame_index import attach_frame_indexes
from ..planning import ChunkShapes
from ..storage import Location, Piece, Store, plan_requests

__all__ = ["verify", "verify_full", "VerifyReport", "Problem"]

# Stored bytes held in memory at once while verifying.
_BATCH_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Problem:
    """One damaged part of a checkpoint.

    Attributes:
        file: Data file name (relative to the checkpoint).
        start: First byte of the damaged range in the file.
        end: One past its last byte.
        keys: The tensor keys (with chunk offsets) stored in that range.
        reason: What is wrong.
    """

    file: str
    start: int
    end: int
    keys: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        """``file bytes [start, end) (keys): reason``."""
        return f"{self.file} bytes [{self.start}, {self.end}) ({', '.join(self.keys)}): {self.reason}"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
        path: The checkpoint.
        files: Data files checked.
        frames: Frames whose checksum was checked.
        bytes_checked: Stored bytes read and checked.
        unchecked_items: Items stored without checksums (written before
            dcp_ext recorded them); their bytes were not checked.
        problems: Every damaged range found; empty when the checkpoint is intact.
        absent_files: With ``present_only``: data files not in this copy
            (another node's files in a node's local tier); not problems.
        referenced_files: Incremental checkpoints: earlier checkpoints' data
            files whose frames this one refers to (and were checked too).
    """

    path: str
    files: int
    frames: int
    bytes_checked: int
    unchecked_items: int
    problems: tuple[Problem, ...]
    absent_files: tuple[str, ...] = ()
    referenced_files: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether no damage was found (``problems`` is empty)."""
        return not self.problems

    def __str__(self) -> str:
        """A summary: what was checked, then one line per problem."""
        head = (
            f"{self.path}: {self.files} files, {self.frames} frames, "
            f"{self.bytes_checked} bytes checked"
        )
        if self.unchecked_items:
            head += f", {self.unchecked_items} items without checksums"
        if self.absent_files:
            head += f", {len(self.absent_files)} files not in this copy"
        if self.referenced_files:
            head += f" (with {len(self.referenced_files)} files of earlier checkpoints it refers to)"
        if self.ok:
            return head + ": OK"
        return head + f": {len(self.problems)} problem(s)\n" + "\n".join(f"  {p}" for p in self.problems)


def _key(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}@{tuple(index.offset)}"


def read_own_metadata(location: Location, store: Store | None = None) -> DecodedMetadata:
    """Decode the dcp_ext metadata of the checkpoint at ``location``, read
    through ``store`` (its store, already open) if given.

    Raises:
        CheckpointNotFoundError, CheckpointIncompleteError, NotACheckpointError:
            No committed dcp_ext checkpoint there (the reader's errors, which
            say whether nothing, a root, an incomplete save or a torch-written
            checkpoint is there).
        CheckpointCorruptError: The metadata is damaged.
    """
    store = store or location.open()
    try:
        raw = store.read_file(METADATA_FILE)
    except CheckpointNotFoundError:
        CheckpointReader(location.at(store.url)).read_metadata()
        raise CheckpointNotFoundError(
            f"{store.describe()} was written by torch's own writer and has no dcp_ext "
            f"metadata, so it has no checksums to verify or codecs to list (CheckpointReader loads it)",
            store.url,
        ) from None
    return decode_metadata(raw, store.describe(METADATA_FILE))


def _attach_indexes(
    store: Store,
    decoded: DecodedMetadata,
    readable: dict[str, list[tuple[MetadataIndex, StoredItem]]],
    truncated: set[str],
    problems: list[Problem],
) -> None:
    """Version 3: give the readable files' items their frame tables from each
    file's frame index; a damaged index is a problem of its whole file."""
    locations = decoded.metadata.storage_data
    if not isinstance(locations, ChunkLocations):
        return
    for name, entries in readable.items():
        ref = decoded.frame_indexes.get(name)
        if name in truncated:
            readable[name] = []  # its frame index is gone with its end: the truncation is the problem
            continue
        try:
            attach_frame_indexes(
                locations, [name], decoded.frame_indexes,
                lambda n, r: store.read_range(n, r.at, r.length, allow_short=True), store.describe,
            )
        except DcpExtError as err:
            start, end = (ref.at, ref.at + ref.length) if ref is not None else (0, 0)
            problems.append(Problem(name, start, end, tuple(_key(i) for i, _ in entries),
                                    f"its frame index cannot be used: {err}"))
            readable[name] = []
            continue
        readable[name] = [(index, locations[index]) for index, _ in entries]


def verify(
    path: str | os.PathLike[str] | Location,
    *,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
    present_only: bool = False,
) -> VerifyReport:
    """Check every stored frame of a checkpoint against its checksum.

    Called by one process (no process group needed).

    Args:
        path: Checkpoint directory (local path, ``s3://`` or fsspec URL); for a
            partial checkpoint of :class:`~dcp_ext.CheckpointManager`, the
            ``{tag}_partial`` directory.
        storage_options: fsspec/s3fs options.
        config: I/O tunables.
        progress: Called with ``(bytes done, bytes total)`` after each batch.
        present_only: Check the data files that are there and list the
            missing ones as absent instead of damaged: for one node's copy
            in a local tier, which holds only that node's (and its
            partner's) files.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False if anything is damaged.

    Raises:
        CheckpointNotFoundError, CheckpointIncompleteError, NotACheckpointError:
            No committed checkpoint at ``path``.
        CheckpointCorruptError: The metadata itself is damaged (nothing can
            be checked without it).
    """
    location = Location.of(path, storage_options, config)
    store = location.open()
    decoded = read_own_metadata(location, store)
    storage: dict[MetadataIndex, StoredItem] = decoded.metadata.storage_data
    problems: list[Problem] = []
    by_file: dict[str, list[tuple[MetadataIndex, StoredItem]]] = {}
    for index, item in storage.items():
        by_file.setdefault(item.relative_path, []).append((index, item))

    # Files that are missing or shorter than recorded.
    readable: dict[str, list[tuple[MetadataIndex, StoredItem]]] = {}
    truncated: set[str] = set()
    absent: list[str] = []
    for name in sorted(decoded.files):
        entries = sorted(by_file.get(name, []), key=lambda e: e[1].offset)
        recorded = decoded.files[name]
        try:
            actual = store.size(name)
        except CheckpointNotFoundError:
            if present_only:
                absent.append(name)
                continue
            problems.append(
                Problem(name, 0, recorded, tuple(_key(i) for i, _ in entries), "file is missing")
            )
            continue
        if actual < recorded:
            lost = [(i, it) for i, it in entries if it.offset + it.length > actual]
            problems.append(
                Problem(
                    name, actual, recorded, tuple(_key(i) for i, _ in lost),
                    f"file is truncated: {actual} bytes, the metadata records {recorded}",
                )
            )
            entries = [(i, it) for i, it in entries if it.offset + it.length <= actual]
            truncated.add(name)
        readable[name] = entries

    _attach_indexes(store, decoded, readable, truncated, problems)
    reader = CheckpointReader(location, store=store)
    references = sorted(decoded.incremental.references) if decoded.incremental is not None else []
    missing_references = _missing_references(reader, references)
    checked = _check_frames(store, reader, readable, ChunkShapes(decoded.metadata.state_dict_metadata),
                            missing_references, problems, location.config, progress)
    for name, keys in missing_references.items():
        problems.append(Problem(name, 0, 0, tuple(keys), f"{reader.describe(name)} is missing: this incremental "
                                "checkpoint refers to its frames (it was deleted by hand, or copied without it)"))
    return VerifyReport(
        store.url, len(decoded.files) - len(absent), checked.frames, checked.done, checked.unchecked,
        tuple(sorted(problems, key=lambda p: (p.file, p.start))), tuple(absent), tuple(references),
    )


def verify_full(
    path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check a full checkpoint (a file, or a Hugging Face folder) against the
    frame checksums recorded in its sidecar (:mod:`dcp_ext.full._checksums`).

    Called by one process. Tensors of a file without a sidecar (written by
    another tool, or before dcp_ext recorded checksums) are counted as
    ``unchecked_items``; their file must still hold every tensor its header
    lists.

    Args:
        path: The full checkpoint: a ``.safetensors`` file, a Hugging Face
            folder, or a ``torch.save`` file; local path, ``s3://`` or fsspec URL.
        storage_options: fsspec/s3fs options (S3 endpoint, credentials...).
        config: I/O tunables; by default from the ``DCP_EXT_*`` environment.
        progress: Called as ``progress(bytes_checked, bytes_total)`` as the check goes.

    Returns:
        What was checked and every problem found.

    Raises:
        CheckpointNotFoundError, NotACheckpointError: No full checkpoint at ``path``.
        CheckpointCorruptError: Its header, index or sidecar is damaged, or a
            file's size differs from the one its checksums were recorded for.
    """

    config = config or IOConfig.from_env()
    reader = FullCheckpointReader(path, storage_options=storage_options, config=config)
    metadata = reader.read_metadata()
    store = reader.store
    readable: dict[str, list[tuple[MetadataIndex, StoredItem]]] = {}
    for index, item in metadata.storage_data.items():
        # One chunk per tensor: problems name the tensor alone.
        readable.setdefault(item.relative_path, []).append((MetadataIndex(index.fqn), item))
    problems: list[Problem] = []
    for name, entries in sorted(readable.items()):
        entries.sort(key=lambda e: e[1].offset)
        size = store.size(name)
        end = max(item.offset + item.length for _, item in entries)
        if size < end:
            lost = [(i, it) for i, it in entries if it.offset + it.length > size]
            problems.append(Problem(name, size, end, tuple(_key(i) for i, _ in lost),
                                    f"file is truncated: {size} bytes, its header needs {end}"))
            readable[name] = [(i, it) for i, it in entries if it.offset + it.length <= size]
    checked = _check_frames(store, reader, readable, None, {}, problems, config, progress)
    return VerifyReport(
        reader.source, len(readable), checked.frames, checked.done, checked.unchecked,
        tuple(sorted(problems, key=lambda p: (p.file, p.start))),
    )


# One region to check: its key, its item, where it lies, the buffer it is read
# into and the check of its bytes ("" when they are right).
_Region = tuple[MetadataIndex, StoredItem, FrameSpan, memoryview, Callable[[memoryview], str]]


@dataclass(frozen=True)
class _Checked:
    frames: int
    done: int
    unchecked: int


def _check_frames(
    store: Store,
    reader: CheckpointReader,
    readable: dict[str, list[tuple[MetadataIndex, StoredItem]]],
    chunks: ChunkShapes | None,
    missing_references: dict[str, list[str]],
    problems: list[Problem],
    config: IOConfig,
    progress: Callable[[int, int], None] | None,
) -> _Checked:
    """Read every frame of ``readable``'s items (and, with ``chunks``, each
    uncompressed tensor's torch.save envelope) and check it, appending what
    is wrong to ``problems``; frames in ``missing_references`` are listed
    there instead of read."""
    total = sum(max(it.length, it.data_length) for entries in readable.values() for _, it in entries)
    done = frames = unchecked = 0
    # (key, item, region, buffer, check): a region is a frame, or the
    # torch.save envelope around an uncompressed tensor (index -1).
    batch: list[_Region] = []
    batch_bytes = 0

    def read(entries: list[_Region]) -> None:
        pieces = [Piece(region.file or item.relative_path, region.stored_offset, buf) for _, item, region, buf, _ in entries]
        reader.read_requests(plan_requests(pieces, gap=store.coalesce_gap, max_request=config.read_request_size))

    def unreadable(entries: list[_Region]) -> set[int]:
        """Positions in ``entries`` that cannot be read, each reported.

        One read of the whole batch first; when it fails, each file's regions
        on their own, and a failing file's region by region: a broken file
        (say, a truncated earlier checkpoint's file that an incremental one
        refers to) must not make healthy frames of other files, or its own
        frames before the damage, look unreadable (issue 32, finding 12)."""
        try:
            read(entries)
            return set()
        except DcpExtError:
            pass
        by_file: dict[str, list[int]] = {}
        for position, (_, item, region, _, _) in enumerate(entries):
            by_file.setdefault(region.file or item.relative_path, []).append(position)
        failed: set[int] = set()
        for positions in by_file.values():
            try:
                read([entries[p] for p in positions])
                continue
            except DcpExtError:
                pass
            for position in positions:
                index, item, region, _, _ = entries[position]
                try:
                    read([entries[position]])
                except DcpExtError as err:
                    problems.append(_problem(item, region, index, f"cannot be read ({err})"))
                    failed.add(position)
        return failed

    def run_batch() -> None:
        nonlocal done, frames, batch_bytes
        if not batch:
            return
        failed = unreadable(batch)
        for position, (index, item, region, buf, check) in enumerate(batch):
            if position in failed:
                continue
            reason = check(buf)
            if reason:
                problems.append(_problem(item, region, index, reason))
            if region.index >= 0:
                frames += 1
            done += region.stored_length
        batch.clear()
        batch_bytes = 0
        if progress is not None:
            progress(done, total)

    def add(index: MetadataIndex, item: StoredItem, region: FrameSpan, check: Callable[[memoryview], str]) -> None:
        nonlocal batch_bytes
        if batch_bytes + region.stored_length > _BATCH_BYTES:
            run_batch()
        batch.append((index, item, region, memoryview(bytearray(region.stored_length)), check))
        batch_bytes += region.stored_length

    for name, entries in readable.items():
        for index, item in entries:
            if not item.frame_size:  # written before frames had checksums
                unchecked += 1
                continue
            try:
                table = frame_table(item, store.describe(name))
            except DcpExtError as err:
                problems.append(Problem(name, item.offset, item.offset + item.length, (_key(index),), str(err)))
                continue
            for k in range(len(table)):
                frame = table.frame(k)
                if frame.file in missing_references:
                    missing_references[frame.file].append(f"{_key(index)} frame {k + 1}/{len(table)}")
                    continue
                add(index, item, frame, functools.partial(_check, item, frame))
            for region, expected in _envelope_regions(index, item, chunks) if chunks is not None else ():
                add(index, item, region, functools.partial(_check_envelope, expected))
    run_batch()
    return _Checked(frames, done, unchecked)


def _missing_references(reader: CheckpointReader, references: list[str]) -> dict[str, list[str]]:
    """The referenced files (of earlier checkpoints) that are not there, each
    with an empty list for the frames that need it."""
    missing: dict[str, list[str]] = {}
    for name in references:
        directory, file = split_reference(name, reader.path)
        if not reader.sibling_store(directory).exists(file):
            missing[name] = []
    return missing


def _envelope_regions(
    index: MetadataIndex,
    item: StoredItem,
    chunks: ChunkShapes,
) -> list[tuple[FrameSpan, bytes]]:
    """The envelope bytes before and after an uncompressed tensor's data, and
    what they must be (the envelope is a pure function of dtype and shape)."""
    prefix_len = item.data_offset
    suffix_len = item.length - item.data_offset - item.data_length
    if item.transforms or item.frame_offsets or (prefix_len == 0 and suffix_len == 0):
        return []  # compressed, or an incremental save's (no envelopes), or none
    shape = chunks.of(index)
    if shape is None:
        return []
    envelope = torch_save_envelope(shape[0], shape[1])
    regions = []
    if prefix_len:
        regions.append((FrameSpan(-1, 0, 0, 0, item.offset, prefix_len, None), envelope.prefix))
    if suffix_len:
        start = item.offset + item.data_offset + item.data_length
        regions.append((FrameSpan(-1, 0, 0, 0, start, suffix_len, None), envelope.suffix))
    return regions


def _check_envelope(expected: bytes, stored: memoryview) -> str:
    if bytes(stored) == expected:
        return ""
    return "torch.save envelope bytes differ from the ones this dtype and shape produce"


def _check(item: StoredItem, frame: FrameSpan, stored: memoryview) -> str:
    fault = frame_fault(item.transforms, frame, stored)
    return "" if fault is None else fault.reason


def _problem(item: StoredItem, frame: FrameSpan, index: MetadataIndex, reason: str) -> Problem:
    where = "envelope" if frame.index < 0 else f"frame {frame.index + 1}/{frame.count}"
    return Problem(
        frame.file or item.relative_path,
        frame.stored_offset,
        frame.stored_offset + frame.stored_length,
        (f"{_key(index)} {where}",),
        reason,
    )
