"""Incremental checkpoints with the tiers: full local copies, incremental drains.

A tiered manager with ``incremental=True`` (:mod:`dcp_ext.tiers._local_tier`,
:mod:`dcp_ext.incremental._save`) keeps **full copies in the local tiers** and
writes **only the changed frames to the persistent root**:

* the local save writes every frame, recording each frame's raw hash
  (xxh3-128) in the data files' version-2 frame indexes (an incremental
  save without a base). The local tiers hold self-contained checkpoints, so
  the local flow (spread commit, replicas, ``keep_local``, restore plans,
  healing from partners) is exactly that of any tiered save;
* the drain does not copy the data files byte for byte. Its base is the
  root's ``newest``, a committed checkpoint of the root itself
  (:func:`choose_base`): each rank rewrites its share of the data files
  into ``ROOT/{tag}_partial/`` holding only the frames whose raw hash,
  key, chunk offsets, frame size and codec differ from the base's
  (:func:`rewrite_file`); the frames that match are referred to where the
  base stores them (in its own files or in those it refers to: never a
  reference to a reference). The coordinator then writes the root's
  metadata: the local document's items where the rewritten files hold
  them, the ``incremental`` section (base, chain, referenced files with
  their bytes and sizes), and the local save's ``created`` time.

Why this design and not incremental local saves with the same base: a
persisted incremental tag may only refer to files that are in the root.
A base chosen when the local save starts is not yet (or no longer) in the
root when the drain commits (drains run in the background and
``persist_every`` saves are local only), and local references would also
bind ``keep_local``, replicas and healing to files of other tags. Here the
base is chosen by the drain, under the drain's save lock, from what the
root has committed, so references never leave the root.

Which ranks call what (from :func:`~dcp_ext.tiers.drain`):

* the coordinator picks the base (:func:`choose_base`) and shares it;
* every rank decodes the local metadata (on its own node) and rewrites its
  share of its node's data files (:func:`rewrite_files`); no rank reads
  another node's path;
* the coordinator gathers the rewritten items and commits
  (:func:`root_document`, then ``partition.json``, ``user_content`` and the
  metadata last), after checking that every referenced file is in the root.

Without a usable base (none, not committed, recorded no hashes, ``max_chain``
reached, or :func:`~dcp_ext.incremental.restart_reason`) the drain copies
byte for byte as before: the root copy is then the local copy.

Restores: a root copy that refers to other tags' files is a different
encoding of the same checkpoint, so its files cannot stand in for the local
files one by one. :meth:`CheckpointManager.resume <dcp_ext.CheckpointManager.resume>`
reads such a tag either wholly from the local tiers (every saving rank's
files there, and only then) or wholly from the root, and if a local copy
turns out damaged it loads the whole tag again from the root.

Crash safety: the root's files of the tag are written under its
``_partial`` directory and its save lock, and the metadata, written last,
commits them; a kill before that leaves an uncommitted directory that the
next save's leftover pass removes, and the root's committed tags unchanged.
The base is never modified. Retention after the commit computes the
referenced files with the new tag's references included, so the base's
files stay (retired, :meth:`~dcp_ext.root.CheckpointRoot.delete_partial`)
as long as a kept tag refers to them; a kill during retention is handled
as for any save (the retired marker is written before anything is
deleted). As with plain incremental saves, the drain holds a root lease on its
base from before it reads it until it commits (:mod:`dcp_ext.guard._leases`), so
another job's retention, ``compact`` or cleanup on the same root leaves the
base and every file it refers to alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from .._runtime import crash_point, validate_relative_name
from ..errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    DcpExtError,
)
from ..frames import HASH_BYTES, checksum, frame_table
from ..guard import Lease, lock_state
from ..incremental import BaseFrames, IncrementalSave, read_base, restart_reason
from ..layout import PARTIAL_SUFFIX, partial_dir
from ..metadata import (
    METADATA_FILE,
    StoredItem,
    encode_metadata,
    read_incremental_section,
)
from ..metadata.chunk_table import ChunkLocations
from ..metadata.decode import DecodedMetadata
from ..metadata.document import FrameIndexRef, split_reference
from ..metadata.frame_index import attach_frame_indexes, encode_frame_index
from ..planning import ChunkShapes
from ..root import CheckpointRoot
from ..storage import Store

__all__ = [
    "DrainBase", "DrainIncompleteError", "RewrittenFiles", "choose_base", "rewrite_files", "rewrite_file", "root_document",
    "refers_elsewhere",
]

log = logging.getLogger("dcp_ext.tiers")


class DrainIncompleteError(DcpExtError, RuntimeError):
    """A rewritten drain does not account for every item of the local checkpoint."""


@dataclass(frozen=True)
class DrainBase:
    """The root checkpoint an incremental drain compares with (coordinator's choice, shared).

    Attributes:
        tag: The base's tag (``None``: no usable base; copy byte for byte).
        document: Its metadata document, read once by the coordinator.
        max_chain: Incremental saves allowed since the last self-contained one.
    """

    tag: str | None = None
    document: bytes | None = dataclasses.field(default=None, repr=False)
    max_chain: int = 0


@dataclass(frozen=True)
class RewrittenFiles:
    """One rank's share of an incremental drain.

    Attributes:
        items: Each item of the rewritten files, as the root's metadata records it.
        referenced: Stored bytes referred to in each earlier file, by reference name.
        sizes: Size of the files referred to, where the base recorded it.
        chain: This rank's chain length (``0``: it referred to nothing of the base).
        written: Bytes written to the root.
    """

    items: tuple[tuple[MetadataIndex, StoredItem], ...] = ()
    referenced: dict[str, int] = dataclasses.field(default_factory=dict)
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)
    chain: int = 0
    written: int = 0


def choose_base(persistent: CheckpointRoot, tag: str, local_document: bytes, local_where: str,
                max_chain: int, leases: list[Lease] | None = None) -> DrainBase:
    """(coordinator, under the drain's lock) The base of the drain of ``tag``:
    the tag the root's ``newest`` names, if it is committed there, recorded
    frame hashes, and may be built on (``max_chain``,
    :func:`~dcp_ext.incremental.restart_reason`); and only if the local copy
    of ``tag`` recorded hashes too. Else a :class:`DrainBase` without a tag.

    As for an incremental save, a root lease on the base is taken before the
    base's save lock is checked and its metadata read (:mod:`dcp_ext.guard._leases`),
    and appended to ``leases``: the drain ends it once it has committed."""
    none = DrainBase(max_chain=max_chain)
    if read_incremental_section(local_document, local_where) is None:
        return none  # saved without hashes: nothing to compare
    base = persistent.newest_record()
    if base is None or base == tag:
        return none
    lease = Lease(persistent.location, tag, base)
    try:
        lease.take()
        store = persistent.partial_store(base)
        state = lock_state(store)
        if state is not None and state.live:
            log.info("drain of %s: copying every frame, the root's newest %s is being changed (%s)",
                     tag, base, state.reason)
            lease.end()
            return none
        document = store.read_file(METADATA_FILE)
        section = read_incremental_section(document, store.describe(METADATA_FILE))
    except DcpExtError as err:
        log.info("drain of %s: copying every frame, the root's newest %s is not readable: %s", tag, base, err)
        lease.end()
        return none
    except BaseException:
        lease.end()
        raise
    if section is None or section.chain + 1 > max_chain:
        lease.end()
        return none
    reason = restart_reason(section)
    if reason is not None:
        log.info("drain of %s: starting a new chain rather than building on %s: %s", tag, base, reason)
        lease.end()
        return none
    if leases is not None:
        leases.append(lease)
    return DrainBase(base, document, max_chain)


def _write_item(index: MetadataIndex, metadata: Metadata, shapes: ChunkShapes) -> WriteItem | None:
    """The ``WriteItem`` a save of the stored chunk ``index`` had (what
    :func:`~dcp_ext.incremental.read_base` looks up), from its metadata."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if md is None:
        return None
    if not isinstance(md, TensorStorageMetadata):
        return WriteItem(index=index, type=WriteItemType.BYTE_IO)
    shape = shapes.of(index)
    if shape is None or index.offset is None:
        return None
    chunk = ChunkStorageMetadata(offsets=torch.Size(index.offset), sizes=torch.Size(shape[1]))
    return WriteItem(index=index, type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=md.properties, size=md.size))


def rewrite_files(
    local: Store,
    target: Store,
    names: Sequence[str],
    decoded: DecodedMetadata,
    base: DrainBase,
    persistent: CheckpointRoot,
) -> RewrittenFiles:
    """(each rank) Write the local data files ``names`` of a checkpoint to
    ``target`` holding only the frames the base does not (see the module
    docstring). Each copied frame's checksum is checked on the way. The
    base's frames are read from ``persistent``'s location (its storage
    options and I/O config).

    Raises:
        ChecksumMismatchError: A local frame is damaged (the drain fails; the tag stays local).
        CheckpointCorruptError: The local metadata or a frame index is damaged.
    """
    assert base.tag is not None
    locations = decoded.metadata.storage_data
    if not isinstance(locations, ChunkLocations):
        raise CheckpointCorruptError(f"{local.describe(METADATA_FILE)} has no chunk table (metadata version 3)",
                                     local.describe(METADATA_FILE))
    wanted = set(names)
    by_file: dict[str, list[MetadataIndex]] = {}
    for index in locations:
        name = locations[index].relative_path
        if name in wanted:
            by_file.setdefault(name, []).append(index)
    shapes = ChunkShapes(decoded.metadata.state_dict_metadata)
    write_items = {index: _write_item(index, decoded.metadata, shapes) for indexes in by_file.values()
                   for index in indexes}
    frames = read_base(
        IncrementalSave(persistent.partial_url(base.tag), partial_dir(base.tag), base.tag, base.max_chain,
                        base.document),
        [w for w in write_items.values() if w is not None], persistent.location,
    )
    attach_frame_indexes(
        locations, sorted(by_file), decoded.frame_indexes,
        lambda name, ref: local.read_range(name, ref.at, ref.length, allow_short=True), local.describe,
        persistent.config.max_concurrency,
    )
    items: list[tuple[MetadataIndex, StoredItem]] = []
    referenced: dict[str, int] = {}
    written = 0
    for name in sorted(by_file):
        entries = sorted(((index, locations[index]) for index in by_file[name]), key=lambda e: e[1].offset)
        out, nbytes = rewrite_file(local, target, name, entries, write_items, frames, referenced)
        items.extend(out)
        written += nbytes
        crash_point("mid_drain")
    sizes = {n: frames.file_sizes[n] for n in referenced if n in frames.file_sizes}
    return RewrittenFiles(tuple(items), referenced, sizes, frames.own_chain if referenced else 0, written)


def rewrite_file(
    local: Store,
    target: Store,
    name: str,
    entries: Sequence[tuple[MetadataIndex, StoredItem]],
    write_items: dict[MetadataIndex, WriteItem | None],
    frames: BaseFrames,
    referenced: dict[str, int],
) -> tuple[list[tuple[MetadataIndex, StoredItem]], int]:
    """(each rank) One data file of the drain: each item's frames that the
    base holds are referred to, the others copied from the local file
    (checked); the file's frame index at its end. Adds the bytes referred to
    per earlier file to ``referenced``; returns the items as they now lie
    (without frame tables, as the metadata records them) and the file's size."""
    stored: list[tuple[MetadataIndex, StoredItem]] = []
    validate_relative_name(name, local.describe(METADATA_FILE), "data file")  # before anything is read or written
    where = local.describe(name)
    with target.open_writer(name, size_hint=sum(item.data_length for _, item in entries)) as writer:
        for index, item in entries:
            table = frame_table(item, where)
            count = len(table)
            if len(item.frame_hashes) != HASH_BYTES * count or len(item.frame_offsets) != count:
                raise CheckpointCorruptError(f"{where}: an item lacks the frame hashes its metadata promises", where)
            write_item = write_items.get(index)
            known = frames.get(write_item) if write_item is not None else None
            if known is not None and not known.matches(item.frame_size, item.transforms, item.raw_size):
                known = None  # written differently (frame size, codec, shape): nothing lines up
            start = writer.position
            sums: list[int] = []
            offsets: list[int] = []
            sources: list[str] = []
            lengths: list[int] = []
            for k in range(count):
                frame = table.frame(k)
                if frame.file != name:
                    raise CheckpointCorruptError(f"{where}: a local copy refers to another checkpoint's file", where)
                if known is not None and known.hash_of(k) == item.frame_hashes[HASH_BYTES * k:HASH_BYTES * (k + 1)]:
                    sums.append(known.checksums[k])
                    offsets.append(known.offsets[k])
                    sources.append(known.sources[k])
                    lengths.append(known.lengths[k])
                    referenced[known.sources[k]] = referenced.get(known.sources[k], 0) + known.lengths[k]
                    continue
                data = local.read_range(name, frame.stored_offset, frame.stored_length)
                if frame.checksum is not None and checksum(data) != frame.checksum:
                    raise ChecksumMismatchError(
                        f"{where}: bytes [{frame.stored_offset}, {frame.stored_offset + frame.stored_length}) fail "
                        f"their checksum; they hold frame {k + 1} of {count} of {index.fqn!r}. Not drained",
                        where,
                    )
                sums.append(checksum(data) if frame.checksum is None else frame.checksum)
                offsets.append(writer.position)
                sources.append("")
                lengths.append(frame.stored_length)
                writer.write(data)
            stored.append((index, dataclasses.replace(
                item, relative_path=name, offset=start, length=writer.position - start, data_offset=0,
                data_length=sum(lengths), frame_lengths=tuple(lengths) if item.transforms else (),
                checksums=tuple(sums), frame_offsets=tuple(offsets), frame_sources=tuple(sources),
                indexed=False, frame_index=None,
            )))
        index_bytes = encode_frame_index([item for _, item in stored])
        ref = FrameIndexRef(writer.position, len(index_bytes), xxhash.xxh3_64_intdigest(index_bytes))
        writer.write(index_bytes)
        size = writer.position
        writer.commit()
    out = [(index, dataclasses.replace(item, frame_lengths=(), checksums=(), frame_hashes=b"", frame_offsets=(),
                                       frame_sources=(), indexed=True, frame_index=ref))
           for index, item in stored]
    return out, size


def root_document(decoded: DecodedMetadata, shares: Sequence[RewrittenFiles], base: DrainBase,
                  persistent: CheckpointRoot, where: str) -> bytes:
    """(coordinator) The root's metadata of an incremental drain: the local
    document's items where the ranks' rewritten files hold them, its
    ``created`` time, and the ``incremental`` section.

    Raises:
        DrainIncompleteError: Some item of the local checkpoint was not rewritten.
        CheckpointNotFoundError: A file the rewritten frames refer to is not
            (any more) in the root: nothing is committed.
    """
    items: dict[MetadataIndex, StoredItem] = {}
    referenced: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for share in shares:
        items.update(share.items)
        for name, nbytes in share.referenced.items():
            referenced[name] = referenced.get(name, 0) + nbytes
        sizes.update(share.sizes)
    locations = decoded.metadata.storage_data
    assert isinstance(locations, ChunkLocations)
    missing = [index for index in locations if index not in items]
    if missing:
        raise DrainIncompleteError(f"{where}: the drain rewrote no file holding {missing[0]} "
                                   f"({len(missing)} items unaccounted for); nothing committed", where)
    for name in referenced:
        directory, file = split_reference(name, where)
        if not directory.endswith(PARTIAL_SUFFIX):
            # A sibling that is no partial checkpoint: partial_store() would look elsewhere.
            raise CheckpointCorruptError(f"{where}: the drained frames refer to {name!r}, which is not in a "
                                         f"checkpoint directory ('*{PARTIAL_SUFFIX}'); nothing committed", where)
        store = persistent.partial_store(directory.removesuffix(PARTIAL_SUFFIX))
        if not store.exists(file):
            raise CheckpointNotFoundError(
                f"{store.describe(file)}, which the drained frames refer to, is gone from the root (deleted "
                f"while the drain ran?); nothing committed", store.describe(file))
    chain = max((share.chain for share in shares), default=0)
    section = {
        "base": base.tag if chain else None,
        "chain": chain,
        "references": [[name, nbytes] for name, nbytes in sorted(referenced.items())],
        "sizes": [[name, sizes[name]] for name in sorted(referenced) if name in sizes],
    }
    return encode_metadata(decoded.metadata, items, world_size=decoded.world_size, version=3,
                           incremental=section, created=decoded.created)


def refers_elsewhere(document: bytes, where: str) -> bool:
    """Whether a checkpoint's metadata refers to other checkpoints' files
    (then its data files differ from a full copy's of the same tag)."""
    section = read_incremental_section(document, where)
    return section is not None and bool(section.references)
