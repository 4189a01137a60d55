"""How a load's read items become byte reads: where each stored chunk lies, its pieces, and what happens once read.

For every slice a rank's load plan asks for, :class:`ItemReads` works out
which bytes of the stored chunk hold it (one contiguous run, several runs,
or a covering span when runs are tiny), and (:meth:`ItemReads.read_all`)
merges byte ranges of the same file that lie close together, splits large
ones, and fetches them in parallel. Where the stored bytes and the
destination tensor line up (same dtype, contiguous CPU memory), data lands
directly in the destination. Compressed or checked items are read as whole
frames (:class:`~dcp_ext.frames.FrameReader`); items written by torch's own
writers are read whole and decoded (:mod:`dcp_ext.format`).
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from .._runtime import _StorageInfo, narrow_tensor_by_index
from ..config import IOConfig, usable_cores
from ..errors import CheckpointCorruptError
from ..format import (
    ARCHIVE_SLACK,
    decode_item,
    load_tensor,
    stream_extensions,
    tensor_bytes,
)
from ..frames import FrameReader, FrameTable, FrameWork, frame_table
from ..metadata import TORCH_METADATA_FILE, StoredItem
from ..metadata.chunk_table import ChunkLocations
from ..metadata.document import FrameIndexRef
from ..metadata.frame_index import attach_frame_indexes
from ..planning import ChunkShapes
from ..storage import Piece, box_runs, plan_requests, run_starts
from ._checkpoint_files import CheckpointFiles
from ._read_exchange import Incoming, as_bytes, bytes_incoming

if TYPE_CHECKING:
    from .._runtime import ExtensionRegistry

__all__ = ["ItemReads", "Pending", "MAX_BYTES_ITEM"]

#: Non-tensor values (pickled by DCP's planner) larger than this are refused
#: before anything is allocated: real ones are small (steps, RNG states, configs).
MAX_BYTES_ITEM = 1 << 30
# Above this many runs per slice, read the covering span instead.
_MAX_RUNS = 4096


@dataclass
class Pending:
    """One read item: its pieces, and what to do once they (and the work on
    their frames) are done."""

    pieces: list[Piece]
    scratch_bytes: int
    finish: Callable[[], None]
    # The stored bytes of the item as one contiguous tensor (read-once
    # owners send it); valid once the item is read.
    payload: Callable[[], torch.Tensor] | None = None


class ItemReads:
    """The reads of one load on one rank (a new one for each load).

    Args:
        files: Where the checkpoint's data files are.
        config: I/O tunables.
        extension_registry: torch's ``ExtensionRegistry`` for items written by
            torch's ``FileSystemWriter(_extensions=...)`` (``None``: torch's default).
    """

    def __init__(self, files: CheckpointFiles, config: IOConfig,
                 extension_registry: ExtensionRegistry | None = None) -> None:
        self.files = files
        self.config = config
        self.extension_registry = extension_registry
        self.storage_data: Any = {}
        self.frame_indexes: dict[str, FrameIndexRef] = {}
        self.chunks = ChunkShapes({})
        self.frames = FrameReader()
        self._tables: dict[MetadataIndex, FrameTable] = {}
        # Sizes of data files, looked up once per load (torch-written items only).
        self._file_sizes: dict[str, int] = {}

    def use(self, storage_data: Any, frame_indexes: dict[str, FrameIndexRef], chunks: ChunkShapes) -> None:
        """Read with this map of where every stored chunk lives (looked up per
        read item: nothing here walks every chunk)."""
        self.storage_data = storage_data
        self.frame_indexes = frame_indexes
        self.chunks = chunks

    @property
    def path(self) -> str:
        return self.files.path

    # -- reading a plan ---------------------------------------------------------------
    def read_all(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        *,
        positions: Sequence[int] | None = None,
        keep: frozenset[int] = frozenset(),
        payloads: dict[int, Callable[[], torch.Tensor]] | None = None,
    ) -> None:
        """Read the plan's items (those at ``positions`` only, if given);
        record the payload of those in ``keep`` in ``payloads``."""
        budget = self.config.read_buffer_bytes
        batch: list[Pending] = []
        batch_scratch = 0
        chosen = range(len(plan.items)) if positions is None else positions
        self.attach_frame_indexes([plan.items[p] for p in chosen])
        self.frames.work = FrameWork(usable_cores())
        try:
            for position in range(len(plan.items)) if positions is None else positions:
                read_item = plan.items[position]
                pending = self.prepare(read_item, planner)
                if position in keep and payloads is not None:
                    if pending.payload is None:
                        raise AssertionError(f"no payload for read item {read_item}")
                    payloads[position] = pending.payload
                if batch and batch_scratch + pending.scratch_bytes > budget:
                    self._run_batch(batch)
                    batch, batch_scratch = [], 0
                batch.append(pending)
                batch_scratch += pending.scratch_bytes
            self._run_batch(batch)
        finally:
            self.frames.work.close()

    def _run_batch(self, batch: list[Pending]) -> None:
        if not batch:
            return
        store = self.files.store
        requests = plan_requests(
            (p for pending in batch for p in pending.pieces),
            gap=store.coalesce_gap,
            max_request=self.config.read_request_size,
        )
        while True:
            try:
                self.files.read_requests(requests)
                self.frames.work.wait()
                break
            except CheckpointCorruptError as err:
                # A store with other copies (TieredStore) reads a damaged
                # file again from the next one; the batch is read again.
                fall_back = getattr(store, "fall_back", None)
                if fall_back is None or not fall_back(err):
                    raise
                with contextlib.suppress(BaseException):
                    self.frames.work.wait()  # let the failed round's frame work finish
        for pending in batch:
            pending.finish()

    def attach_frame_indexes(self, read_items: Sequence[ReadItem]) -> None:
        """Read the frame indexes of the files these items are in (version-3
        metadata), several at once; a damaged copy is read again from the
        next source of a store that has one (TieredStore)."""
        locations = self.storage_data
        if not isinstance(locations, ChunkLocations):
            return
        names = set()
        for read_item in read_items:
            info = locations.get(read_item.storage_index)
            if info is not None and info.indexed:
                names.add(info.relative_path)
        store = self.files.store
        while True:
            try:
                attach_frame_indexes(
                    locations, names, self.frame_indexes,
                    lambda name, ref: store.read_range(name, ref.at, ref.length, allow_short=True),
                    store.describe, self.config.max_concurrency,
                )
                return
            except CheckpointCorruptError as err:
                fall_back = getattr(store, "fall_back", None)
                if fall_back is None or not fall_back(err):
                    raise

    # -- one item ----------------------------------------------------------------------
    def info(self, read_item: ReadItem) -> Any:
        """Where the stored chunk ``read_item`` reads from lies (its frame index read if needed)."""
        try:
            info = self.storage_data[read_item.storage_index]
            if isinstance(info, StoredItem) and info.indexed:
                self.attach_frame_indexes([read_item])
                info = self.storage_data[read_item.storage_index]
            return info
        except KeyError:
            raise CheckpointCorruptError(
                f"checkpoint {self.path} has no stored data for key "
                f"{read_item.storage_index.fqn!r} at offset "
                f"{tuple(read_item.storage_index.offset or ())}; its metadata is inconsistent",
                self.path,
            ) from None

    def prepare(self, read_item: ReadItem, planner: LoadPlanner) -> Pending:
        """The pieces of ``read_item`` and what to do once they are read."""
        info = self.info(read_item)
        if isinstance(info, _StorageInfo):
            return self._prepare_torch_item(read_item, info, planner)
        if read_item.type == LoadItemType.BYTE_IO:
            if info.raw_size > MAX_BYTES_ITEM:
                where = self.files.store.describe(info.relative_path)
                raise CheckpointCorruptError(
                    f"{where}: the metadata claims {info.raw_size} bytes for the non-tensor "
                    f"value {read_item.storage_index.fqn!r} (at most {MAX_BYTES_ITEM}); refusing "
                    f"to allocate that. The metadata is damaged or hostile.",
                    where,
                )
            buffer = bytearray(info.raw_size)

            def finish_bytes() -> None:
                planner.load_bytes(read_item, io.BytesIO(buffer))

            pending = self._fetch(read_item, info, [(0, memoryview(buffer))], len(buffer), finish_bytes)
            pending.payload = lambda: torch.frombuffer(buffer, dtype=torch.uint8)
            return pending
        return self._prepare_tensor(read_item, info, planner)

    def incoming(self, read_item: ReadItem, planner: LoadPlanner) -> Incoming:
        """Where a read item received from its read-once owner lands (stored
        bytes of the item), and how it is committed."""
        info = self.info(read_item)
        if read_item.type == LoadItemType.BYTE_IO:
            return bytes_incoming(info.raw_size, lambda data: planner.load_bytes(read_item, data))
        dtype, _ = self.chunk(read_item)
        lengths = tuple(int(n) for n in read_item.lengths)
        target = self._target(read_item, planner, lengths)
        if lands_directly(target, dtype):
            return Incoming(as_bytes(target), lambda: planner.commit_tensor(read_item, target))
        box = torch.empty(lengths, dtype=dtype)

        def finish() -> None:
            target.copy_(box)
            planner.commit_tensor(read_item, target)

        return Incoming(as_bytes(box), finish)

    def chunk(self, read_item: ReadItem) -> tuple[torch.dtype, tuple[int, ...]]:
        """Dtype and shape of the stored chunk a read item reads from."""
        index = read_item.storage_index
        found = self.chunks.of(index)
        if found is None:
            raise CheckpointCorruptError(
                f"checkpoint {self.path}: no chunk of {index.fqn!r} at offset {tuple(index.offset or ())} in metadata",
                self.path,
            )
        return found

    def _target(self, read_item: ReadItem, planner: LoadPlanner, lengths: tuple[int, ...]) -> torch.Tensor:
        """The destination slice of a read item, checked against its lengths."""
        target = planner.resolve_tensor(read_item).detach()
        if tuple(target.shape) != lengths:
            raise ValueError(
                f"cannot load {read_item.storage_index.fqn!r}: the destination slice has shape "
                f"{tuple(target.shape)} but the checkpoint slice has shape {lengths}"
            )
        return target

    def _prepare_tensor(self, read_item: ReadItem, info: StoredItem, planner: LoadPlanner) -> Pending:
        fqn = read_item.storage_index.fqn
        dtype, chunk_sizes = self.chunk(read_item)
        lengths = tuple(map(int, read_item.lengths))
        offsets = tuple(map(int, read_item.storage_offsets))
        esize = dtype.itemsize
        elements = numel(chunk_sizes)
        if info.raw_size != elements * esize:
            raise CheckpointCorruptError(
                f"checkpoint {self.path}: stored chunk of {fqn!r} holds {info.raw_size} "
                f"bytes, but a {dtype} chunk of shape {chunk_sizes} needs "
                f"{elements * esize}",
                self.path,
            )
        target = self._target(read_item, planner, lengths)
        commit = functools.partial(planner.commit_tensor, read_item, target)
        if lengths == chunk_sizes and not any(offsets):
            # The whole stored chunk (a load in the layout it was saved in):
            # one run from its first byte, nothing to work out.
            if not elements:
                return Pending([], 0, commit, lambda: torch.empty(lengths, dtype=dtype))
            return self._prepare_runs(read_item, info, target, dtype, [0], elements * esize, commit)
        shape = box_runs(chunk_sizes, offsets, lengths)
        if shape.runs == 0:
            return Pending([], 0, commit, lambda: torch.empty(lengths, dtype=dtype))
        if shape.runs == 1 or (shape.run * esize >= self.files.store.coalesce_gap and shape.runs <= _MAX_RUNS):
            starts = [start * esize for start in run_starts(shape, offsets, lengths)]
            return self._prepare_runs(read_item, info, target, dtype, starts, shape.run * esize, commit)
        # Many tiny runs: one read of the covering span, then a strided copy.
        span = torch.empty(shape.span, dtype=dtype)

        def finish_span() -> None:
            target.copy_(span.as_strided(lengths, shape.strides))
            commit()

        runs = [(shape.first * esize, tensor_bytes(span))]
        pending = self._fetch(read_item, info, runs, shape.span * esize, finish_span)
        pending.payload = lambda: span.as_strided(lengths, shape.strides).contiguous()
        return pending

    def _prepare_runs(
        self,
        read_item: ReadItem,
        info: StoredItem,
        target: torch.Tensor,
        dtype: torch.dtype,
        starts: list[int],
        run_bytes: int,
        commit: Callable[[], None],
    ) -> Pending:
        """A slice stored as runs of ``run_bytes`` at byte ``starts`` of its
        chunk, read straight into ``target`` when the stored bytes can land
        there (else into a box copied over once read)."""
        direct = lands_directly(target, dtype)
        box = target if direct else torch.empty(tuple(target.shape), dtype=dtype)
        view = tensor_bytes(box)
        runs = [(start, view[i * run_bytes : (i + 1) * run_bytes]) for i, start in enumerate(starts)]
        if direct:
            pending = self._fetch(read_item, info, runs, 0, commit)
        else:

            def finish_box() -> None:
                target.copy_(box)
                commit()

            pending = self._fetch(read_item, info, runs, view.nbytes, finish_box)
        pending.payload = lambda: box
        return pending

    def _fetch(
        self,
        read_item: ReadItem,
        info: StoredItem,
        runs: list[tuple[int, memoryview]],
        scratch_bytes: int,
        finish: Callable[[], None],
    ) -> Pending:
        """Read raw bytes ``[start, start + len(dest))`` of a stored item into
        each ``(start, dest)`` of ``runs``.

        Uncompressed data without verification is read straight into the
        destinations; otherwise whole frames are read, checked and decoded
        (:meth:`dcp_ext.frames.FrameReader.pieces`).
        """
        name = info.relative_path
        verify = self.config.verify_checksums and (bool(info.checksums) or info.indexed)
        if not info.transforms and not info.frame_offsets and (not verify or not info.frame_size):
            base = info.offset + info.data_offset
            return Pending([Piece(name, base + start, dest) for start, dest in runs], scratch_bytes, finish)
        index = read_item.storage_index
        where = self.files.store.describe(name)
        table = self._tables.get(index)
        if table is None:
            table = self._tables[index] = frame_table(info, where)
        pieces, frame_scratch = self.frames.pieces(table, runs, where, index, verify, self.files.describe)
        return Pending(pieces, scratch_bytes + frame_scratch, finish)

    def _prepare_torch_item(self, read_item: ReadItem, info: _StorageInfo, planner: LoadPlanner) -> Pending:
        """An item written by torch's own writers: read it whole and decode it
        (undoing its stream extensions first, if it has any)."""
        fqn = read_item.storage_index.fqn
        where = self.files.store.describe(info.relative_path)
        descriptors = tuple(getattr(info, "transform_descriptors", None) or ())
        # Resolved before any byte is read: an unknown extension fails fast.
        extensions = stream_extensions(self.extension_registry, descriptors, where, fqn) if descriptors else []
        span = (info.offset, info.offset + info.length)
        self._check_torch_item(info, where, fqn)
        buffer = bytearray(info.length)
        piece = Piece(info.relative_path, info.offset, memoryview(buffer))

        def decoded(limit: int) -> bytes | bytearray:
            if not descriptors:
                return buffer
            return decode_item(buffer, extensions, limit, where, fqn, descriptors)

        def finish() -> None:
            if read_item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(read_item, io.BytesIO(decoded(MAX_BYTES_ITEM)))
                return
            dtype, sizes = self.chunk(read_item)
            tensor = load_tensor(decoded(numel(sizes) * dtype.itemsize + ARCHIVE_SLACK), where, span, fqn)
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(sizes):
                raise CheckpointCorruptError(
                    f"{where}: bytes [{span[0]}, {span[1]}) hold {fqn!r} as {tensor.dtype} of shape "
                    f"{tuple(tensor.shape)}, but {TORCH_METADATA_FILE} records a {dtype} chunk of shape "
                    f"{tuple(sizes)}; the metadata was changed or is damaged", where)
            tensor = narrow_tensor_by_index(tensor, read_item.storage_offsets, read_item.lengths)
            target = planner.resolve_tensor(read_item).detach()
            if target.shape != tensor.shape:
                raise ValueError(
                    f"cannot load {fqn!r}: destination slice has "
                    f"shape {tuple(target.shape)}, checkpoint slice {tuple(tensor.shape)}"
                )
            target.copy_(tensor)
            planner.commit_tensor(read_item, target)

        return Pending([piece], info.length, finish)

    def _check_torch_item(self, info: _StorageInfo, where: str, fqn: str) -> None:
        """Refuse a torch-written item that claims bytes its file does not
        have, before its buffer is allocated: torch's ``.metadata`` records
        each item's length, and a damaged or hostile one must not make a rank
        allocate gigabytes to find the file short (issue 32, finding 6).

        Raises:
            CheckpointCorruptError: The item lies past the end of its file.
        """
        size = self._file_sizes.get(info.relative_path)
        if size is None:
            size = self._file_sizes[info.relative_path] = self.files.store.size(info.relative_path)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise CheckpointCorruptError(
                f"{where}: {TORCH_METADATA_FILE} puts {fqn!r} at bytes [{info.offset}, {info.offset + info.length}), "
                f"past the end of the file ({size} bytes); refusing to read it. The checkpoint is truncated or its "
                f"metadata is damaged",
                where,
            )

    # -- what read-once planning needs to know of an item -------------------------------
    def item_bytes(self, item: ReadItem) -> int | None:
        """Stored bytes of a read item, ``None`` for one each rank must read itself."""
        info = self.storage_data.get(item.storage_index)
        if not isinstance(info, StoredItem):
            return None  # torch-format items, or inconsistent metadata (the read says so)
        if item.type == LoadItemType.BYTE_IO:
            return info.raw_size if info.raw_size <= MAX_BYTES_ITEM else None
        chunk = self.chunks.of(item.storage_index)
        if chunk is None:
            return None
        return numel(tuple(int(n) for n in item.lengths)) * chunk[0].itemsize

    def item_grain(self, item: ReadItem) -> int:
        """Rows of the item's chunk per frame, when frames hold whole rows
        and the item spans whole rows (cuts there share no frame); else 1."""
        info = self.storage_data.get(item.storage_index)
        chunk = self.chunks.of(item.storage_index)
        if not isinstance(info, StoredItem) or not info.frame_size or chunk is None:
            return 1
        dtype, sizes = chunk
        if len(sizes) == 0 or tuple(int(n) for n in item.lengths[1:]) != tuple(sizes[1:]):
            return 1
        row_bytes = numel(tuple(sizes[1:])) * dtype.itemsize
        if not row_bytes or info.frame_size % row_bytes:
            return 1
        return info.frame_size // row_bytes

    def item_order(self, item: ReadItem) -> tuple[object, ...]:
        """Where an item's stored bytes lie (the order read-once deals items out in)."""
        info = self.storage_data[item.storage_index]
        return (info.relative_path, info.offset, tuple(int(o) for o in item.storage_offsets))


def lands_directly(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes of ``dtype`` can land in ``target`` as they are."""
    return target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous()


def numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n
