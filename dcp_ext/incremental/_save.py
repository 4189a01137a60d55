"""Incremental saves: write only the frames that changed since the last save.

With ``CheckpointManager(incremental=True)`` every save hashes each frame's
raw bytes (xxh3-128) as it writes them, next to the frame checksums it
computes anyway, and records the hashes in its data files' frame indexes
(version 2, :mod:`dcp_ext.metadata.frame_index`). The next save compares each
frame with the frame of the same key, chunk offsets, frame size and codec in
its *base*, the newest committed checkpoint: a frame whose hash matches is
not written again. The new checkpoint's frame index records instead where the
frame's stored bytes already are, in the data file of whichever earlier save
wrote them (always that file itself, never a reference to a reference), with
their checksum. Loads read those bytes there, with the same ranged, parallel,
verified reads; resharding works as for any checkpoint.

A save that has ``max_chain`` incremental saves behind it since the last
self-contained one writes every frame again (and becomes the next chain's
start), so a checkpoint never needs the files of more than ``max_chain + 1``
saves. Retention and deletion (:mod:`dcp_ext.root._root`) keep every data file a
kept checkpoint refers to.

Which ranks call what:

* the manager (every rank) says which checkpoint is the base
  (:class:`IncrementalSave`);
* each rank's writer reads the base's metadata and the frame indexes of the
  base files holding its own items (:func:`read_base`), then writes through
  :class:`~dcp_ext.frames.FrameEncoder` with each item's :class:`BaseItem`;
* the coordinator writes the metadata's ``incremental`` section: the base,
  the chain length and every referenced file with its bytes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..frames import HASH_BYTES, BaseItem
from ..guard import Lease
from ..metadata import METADATA_FILE, IncrementalSection, StoredItem, decode_metadata
from ..metadata.chunk_table import ChunkLocations
from ..metadata.document import reference_name
from ..metadata.frame_index import attach_frame_indexes, frame_count
from ..planning import ChunkShapes
from ..storage import Location

__all__ = [
    "IncrementalSave", "BaseFrames", "read_base", "restart_reason", "DEFAULT_MAX_CHAIN",
    "MIN_REFERENCED_BYTES",
]

log = logging.getLogger("dcp_ext.incremental")

#: ``max_chain`` unless the caller says otherwise: a bound on the earlier
#: saves a checkpoint depends on. Storage is bounded by :func:`restart_reason`,
#: so frozen weights are not rewritten every few saves for nothing.
DEFAULT_MAX_CHAIN = 32
#: Items smaller than this (or than one frame, if frames are smaller) are
#: written by every save, never referred to: a few bytes that do not change
#: (an optimizer's ``param_groups``, a frozen bias) would otherwise keep a
#: whole earlier data file alive after retention deleted its checkpoint, for
#: almost no saving.
MIN_REFERENCED_BYTES = 64 * 1024


@dataclass(frozen=True)
class IncrementalSave:
    """How one save is incremental (made by the manager on every rank; it pickles).

    Attributes:
        base_url: The base checkpoint's directory (``None``: no base, write
            every frame and record hashes).
        base_dir: Its directory's name under the root (``step10_partial``).
        base_tag: Its tag.
        max_chain: Incremental saves allowed since the last self-contained one.
        base_metadata: The base's metadata document, read once by the
            coordinator and shared (``None``: each rank reads it).
        lease: (coordinator) The root lease that pins the base while the
            save is in flight (:mod:`dcp_ext.guard._leases`); the writer ends it
            after the commit or the failure.
    """

    base_url: str | None = None
    base_dir: str | None = None
    base_tag: str | None = None
    max_chain: int = DEFAULT_MAX_CHAIN
    base_metadata: bytes | None = dataclasses.field(default=None, repr=False)
    lease: Lease | None = dataclasses.field(default=None, repr=False, compare=False)

    def end_lease(self) -> None:
        """(coordinator) End the lease, if this save holds one (idempotent)."""
        if self.lease is not None:
            self.lease.end()

    def __post_init__(self) -> None:
        if self.max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {self.max_chain}")
        if (self.base_url is None) != (self.base_dir is None):
            raise ValueError("IncrementalSave needs both base_url and base_dir, or neither")


@dataclass(frozen=True)
class BaseFrames:
    """What one rank's writer compares with: its items' frames in the base.

    Attributes:
        items: ``(key, chunk offsets or None) -> BaseItem`` for this rank's
            items that the base holds with the same dtype and shape.
        chain: The base's chain length (saves since its last self-contained
            one); ``None`` when the base recorded no hashes (then nothing is
            referred to and this save starts a chain).
        referable: Whether this save may refer to the base's frames
            (``chain + 1 <= max_chain``).
        file_sizes: Size of every data file the base's frames are in (its
            own and, where it recorded them, those it refers to), by
            reference name: recorded with this save's references.
    """

    items: dict[tuple[str, tuple[int, ...] | None], BaseItem] = dataclasses.field(default_factory=dict)
    chain: int | None = None
    referable: bool = False
    file_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def own_chain(self) -> int:
        """The chain length of the save comparing with this base."""
        return self.chain + 1 if self.referable and self.chain is not None else 0

    def get(self, item: WriteItem) -> BaseItem | None:
        """The base's copy of ``item``, if this save may refer to it (see :data:`MIN_REFERENCED_BYTES`)."""
        if not self.referable:
            return None
        found = self.items.get(_key(item))
        if found is None or found.raw_size < min(MIN_REFERENCED_BYTES, found.frame_size):
            return None
        return found


def restart_reason(section: IncrementalSection | None) -> str | None:
    """Why the save after the checkpoint with this ``incremental`` section
    should start a new chain (write every frame) although ``max_chain``
    allows another incremental save; ``None`` if it should not.

    A chain keeps whole earlier data files alive while a kept checkpoint
    refers to any frame in them, so as frames change their old copies become
    dead weight. Once the files the base refers to hold more unused bytes
    than used ones, writing the used bytes again (one self-contained save)
    lets retention free more than it costs. Frozen weights never get there:
    their frames stay used, and are not rewritten. Only files whose size
    the base recorded count.
    """
    if section is None or not section.sizes:
        return None
    used = sum(section.references[name] for name in section.sizes)
    unused = section.unused_bytes
    if unused <= used:
        return None
    return (f"{unused / 2**20:.1f} MiB of the earlier files it refers to are no longer used "
            f"(more than the {used / 2**20:.1f} MiB in use)")


def _key(item: WriteItem) -> tuple[str, tuple[int, ...] | None]:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return (item.index.fqn, None)
    return (item.index.fqn, tuple(int(o) for o in item.tensor_data.chunk.offsets))


def read_base(save: IncrementalSave, items: Sequence[WriteItem], location: Location) -> BaseFrames:
    """(each rank, before writing) This rank's items as the base stored them.

    Decodes the base's metadata (``save.base_metadata``, else read here) and
    reads the frame indexes of the base files that hold this rank's items
    (typically its own earlier files: one ranged read each). A base that is
    gone, or that recorded no hashes, gives an empty :class:`BaseFrames`:
    the save then writes every frame (the same checkpoint, only larger).

    A damaged base (its metadata or a frame index) is not built on either:
    the save writes every frame, with a warning, rather than fail.
    """
    if save.base_url is None or save.base_dir is None:
        return BaseFrames()
    try:
        return _read_base(save, items, location.at(save.base_url))
    except CheckpointCorruptError as err:
        log.warning("incremental save: writing every frame, since its base %s is damaged: %s", save.base_url, err)
        return BaseFrames()


def _read_base(save: IncrementalSave, items: Sequence[WriteItem], base: Location) -> BaseFrames:
    assert save.base_url is not None and save.base_dir is not None
    store = base.open()
    raw = save.base_metadata
    if raw is None:
        try:
            raw = store.read_file(METADATA_FILE)
        except CheckpointNotFoundError:
            return BaseFrames()  # deleted meanwhile: nothing to compare with
    decoded = decode_metadata(raw, store.describe(METADATA_FILE))
    metadata, section, locations = decoded.metadata, decoded.incremental, decoded.metadata.storage_data
    if section is None or not isinstance(locations, ChunkLocations):
        return BaseFrames()
    referable = section.chain + 1 <= save.max_chain
    if not referable:
        return BaseFrames(chain=section.chain, referable=False)
    found: dict[tuple[str, tuple[int, ...] | None], StoredItem] = {}
    state = metadata.state_dict_metadata
    shapes = ChunkShapes(state)
    for item in items:
        key = _key(item)
        md = state.get(key[0])
        if key[1] is None:
            index = MetadataIndex(key[0])
            if md is None or isinstance(md, TensorStorageMetadata):
                continue
        else:
            if not isinstance(md, TensorStorageMetadata) or item.tensor_data is None:
                continue
            if md.properties.dtype != item.tensor_data.properties.dtype:
                continue
            index = MetadataIndex(key[0], key[1])
        stored = locations.get(index)
        if stored is None:
            continue
        if key[1] is not None:
            shape = shapes.of(index)
            if shape is None or shape[1] != tuple(int(s) for s in item.tensor_data.chunk.sizes):  # type: ignore[union-attr]
                continue
        found[key] = stored
    attach_frame_indexes(
        locations, {s.relative_path for s in found.values()}, decoded.frame_indexes,
        lambda name, ref: store.read_range(name, ref.at, ref.length, allow_short=True),
        store.describe, base.config.max_concurrency,
    )
    out: dict[tuple[str, tuple[int, ...] | None], BaseItem] = {}
    for key in found:
        index = MetadataIndex(key[0]) if key[1] is None else MetadataIndex(key[0], key[1])
        full = locations[index]
        count = frame_count(full)
        if not full.frame_offsets or len(full.frame_hashes) != HASH_BYTES * count:
            continue
        own = reference_name(save.base_dir, full.relative_path)
        lengths = full.frame_lengths if full.transforms else tuple(
            min(full.frame_size, full.raw_size - k * full.frame_size) for k in range(count)
        )
        out[key] = BaseItem(
            full.frame_size, full.transforms, full.raw_size, full.frame_hashes, full.checksums, lengths,
            full.frame_offsets, tuple(s or own for s in (full.frame_sources or ("",) * count)),
        )
    sizes = {reference_name(save.base_dir, name): size for name, size in decoded.files.items()}
    sizes.update(section.sizes)
    return BaseFrames(out, section.chain, True, sizes)
