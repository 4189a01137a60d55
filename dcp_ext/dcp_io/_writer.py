"""``CheckpointWriter``: DCP ``StorageWriter`` for local disk, shared POSIX and S3.

Commit protocol (each step starts only after the previous one succeeded on
every rank; DCP's collectives provide the ordering):

1. (coordinator, ``prepare_global_plan``) take the path's save lock
   (:mod:`dcp_ext.guard._save_lock`) before changing anything: a second job saving
   the same path at the same time fails with ``CheckpointInProgressError``,
   and a refused save leaves the old checkpoint as it was. Then refuse an
   existing committed checkpoint unless ``overwrite=True``. For a
   ``ROOT/{tag}_partial`` path that holds a checkpoint (or a retired one),
   refuse with ``CheckpointInUseError`` if another checkpoint refers to its
   files or a save in flight builds on it (the root's one rule,
   :mod:`dcp_ext.root._root`). With ``overwrite``, delete the old metadata
   (torch's, then dcp_ext's) so the old checkpoint stops being loadable
   before any byte of it is replaced.
2. (all ranks, ``write_data``) stream data files. Each file becomes visible
   under its final name only when durable: fsync + rename on file systems, a
   completed multipart upload on S3. A failing rank aborts its files.
3. (coordinator, ``finish``) write ``dcp_ext.metadata.json``, the commit
   marker, then torch's pickled ``.metadata`` (so torch's readers can load
   the checkpoint; written last, a directory with it alone is never a
   crashed dcp_ext save). Still holding the lock, delete data files of an
   overwritten checkpoint that the new one does not use and temporary files
   left by crashed saves; then release the lock and run ``after_commit``
   (the manager moves ``newest`` there); its failure reaches every rank as
   a ``PostCommitError``.

A reader refuses a checkpoint without metadata, so a save that dies at any
point leaves either the previous state or nothing loadable, never a mix.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._runtime import HookPause, crash_point, release_free_memory
from ..config import IOConfig
from ..errors import CheckpointExistsError, DcpExtError, PlanMismatchError, PostCommitError
from ..format import DTYPES, Codec, resolve_codec, tensor_bytes, torch_save_envelope
from ..frames import FrameEncoder
from ..guard import LOCK_FILE, SaveLock, check_reuse
from ..incremental import BaseFrames, IncrementalSave, read_base
from ..layout import (
    DATA_SUFFIX,
    FileAssignment,
    item_nbytes,
)
from ..metadata import (
    METADATA_FILE,
    TORCH_METADATA_FILE,
    StoredItem,
    encode_metadata,
    to_torch_metadata,
    torch_reader_marker,
)
from ..metadata.document import FrameIndexRef
from ..metadata.frame_index import encode_frame_index
from ..metadata.stored_columns import StoredColumns
from ..planning import LayoutSavePlanner, collect_stored, pack_results
from ..storage import Location, Store, normalize_path
from ._replacing import assign_beside, committed_with, remove_replaced, save_outcome, uncommit
from ._staging import copy_state

__all__ = ["CheckpointWriter"]

log = logging.getLogger("dcp_ext.writer")

_REFERENCED_LOCK = threading.Lock()

# Rough upper bound of a torch.save envelope, used only for S3 part sizing.
_ENVELOPE_ESTIMATE = 2048


class CheckpointWriter(StorageWriter, AsyncStager):
    """Stream a DCP checkpoint to a local directory, shared POSIX or S3/fsspec.

    Use with stock DCP::

        dcp.save(state_dict, storage_writer=CheckpointWriter("s3://bucket/ckpt/step100",
                 storage_options={"endpoint_url": ...}))

    Lifecycle (DCP calls these; which ranks call each):

    0. (all ranks) ``reset(checkpoint_id)`` when ``checkpoint_id=`` is passed.
    1. (all ranks) ``set_up_storage_writer``: on the main thread, pause the
       cyclic collector until the rank's last hook returns (4 or 5).
    2. (all ranks) ``prepare_local_plan``: create the directory / check the bucket.
    3. (coordinator) ``prepare_global_plan``: refuse or invalidate an existing
       checkpoint, assign each rank its data file names.
    4. (all ranks) ``write_data``: stream the rank's items; commit its files.
    5. (coordinator) ``finish``: write metadata (the commit marker), clean up.

    Args:
        path: Checkpoint directory: local path, ``file://``, ``s3://``,
            ``gs://``, ``az://`` or any registered or fsspec URL, or a
            :class:`~dcp_ext.storage.Location` (then its storage options and
            config are used). ``dcp.save(checkpoint_id=...)`` replaces it.
        storage_options: The store's options (S3 ``endpoint_url``, ``key``,
            ``secret``, ``client_kwargs={'region_name': ...}``...).
        overwrite: Replace a committed checkpoint at ``path``. Off by default:
            a good checkpoint is never replaced by accident.
        config: I/O tunables; the keyword arguments below override its fields.
        part_size: Bytes per S3 part (default 16 MiB).
        max_concurrency: Requests in flight per rank (default 8).
        files_per_rank: Data files per rank, written by parallel threads.
        fsync: fsync files before commit (local/POSIX; default True).
        before_commit: Called by the coordinator with the checkpoint's store
            after all data is durable and before the metadata commits it;
            extra files written there are part of the checkpoint. An
            overwrite un-commits the old one just before; a hook with a
            ``with_renamed(mapping)`` method is first given the data files
            written under new names, and the hook it returns is called.
        after_commit: Called by the coordinator after the commit; an error
            it raises reaches every rank as ``PostCommitError`` (the
            checkpoint stays committed).
        compression: ``None`` (default: raw bytes, readable by torch's own
            readers too), ``"zstd"`` (zstd level 1 with byte grouping for
            floating-point tensors), or a codec such as
            ``dcp_ext.ZstdCodec(level=3)``. Recorded per item in the metadata;
            readers need no setting.
        frame_size: Raw bytes per compressed/checksummed frame (default 1 MiB).
        incremental: Write only the frames that changed since a base
            checkpoint (:mod:`dcp_ext.incremental._save`; from
            ``CheckpointManager(incremental=True)``); needs ``LayoutSavePlanner``
            and metadata version 3; read by dcp_ext only.

    Every stored frame gets an xxh3-64 checksum, verified on every read.
    ``dcp.async_save`` without an ``async_stager`` stages through
    :meth:`stage` (a blocking copy; ``dcp_ext.Stager()`` stages in the
    background). The writer pickles without its store, so process-based
    uploads work if ``before_commit`` and ``after_commit`` pickle too.
    """

    # AsyncStager: stage() blocks until the copy is made, so DCP need not call
    # synchronize_staging() afterwards.
    _synchronize_after_execute = False

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        config: IOConfig | None = None,
        part_size: int | str | None = None,
        max_concurrency: int | None = None,
        files_per_rank: int | None = None,
        fsync: bool | None = None,
        before_commit: Callable[[Store], None] | None = None,
        after_commit: Callable[[], None] | None = None,
        compression: str | Codec | None = None,
        frame_size: int | str | None = None,
        incremental: IncrementalSave | None = None,
    ) -> None:
        super().__init__()
        overrides = {
            "frame_size": frame_size,
            "part_size": part_size,
            "max_concurrency": max_concurrency,
            "files_per_rank": files_per_rank,
            "fsync": fsync,
        }
        if config is None:
            config = path.config if isinstance(path, Location) else IOConfig.from_env()
        config = config.with_overrides(**overrides)
        #: Where the checkpoint goes (URL, storage options, config).
        self.location = Location.of(path, storage_options).with_config(config)
        self.config = config
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex  #: This save's random id (new at each ``reset``; names its lock).
        self.is_coordinator = True  #: Whether this rank is DCP's coordinator (``set_up_storage_writer``).
        self.rank = 0  #: This rank in the save's process group (``set_up_storage_writer``).
        self._store: Store | None = None
        self._written: list[str] = []
        self.before_commit = before_commit
        self.after_commit = after_commit
        self.codec = resolve_codec(compression)  #: The codec of ``compression`` (``None``: raw bytes).
        self._lock: SaveLock | None = None
        # (root store, marker name): strays marker of an overwrite, until its old files are gone.
        self._strays: tuple[Store, str] | None = None
        if incremental is not None and config.metadata_version < 3:
            raise ValueError("incremental saves need metadata_version 3 (frame indexes with hashes)")
        self.incremental = incremental
        #: This save's view of its base (incremental saves; set by write_data).
        self.base_frames: BaseFrames | None = None
        #: (coordinator) An overwrite's data files named apart from the old
        #: checkpoint's: planned name -> the name written (set by prepare_global_plan).
        self.renamed: dict[str, str] = {}
        self._replacing: list[str] = []
        #: This rank's phases in dcp_ext's own save calls (:mod:`dcp_ext.dcp_io._watched`), else ``None``.
        self.rank_watch: Any = None
        self._gc_pause = HookPause()

    # -- helpers ----------------------------------------------------------------
    @property
    def path(self) -> str:
        """The checkpoint's URL (or local path)."""
        return self.location.url

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.location.storage_options

    @property
    def store(self) -> Store:
        """The store of the current checkpoint path (created on first use)."""
        if self._store is None:
            self._store = self.location.open()
        return self._store

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its store, lock and rank watch: an open store holds clients, sockets and
        thread pools; a copy in another process (process-based uploads) opens its own."""
        state = dict(self.__dict__)
        state.update(_store=None, _lock=None, _strays=None, rank_watch=None, _gc_pause=HookPause())
        return state

    # -- AsyncStager (dcp.async_save without async_stager) ------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """(all ranks) A private CPU copy of ``state_dict`` for the background upload."""
        return copy_state(state_dict)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns a finished copy."""

    def close(self) -> None:
        """End a GC pause a failed save left (staged copies belong to the save that uses them)."""
        self.end_gc_lease()

    def end_gc_lease(self) -> None:
        """(each rank) End the GC pause that :meth:`set_up_storage_writer` began, if any."""
        self._gc_pause.end()

    # -- StorageWriter --------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Start a new save, optionally at a new path."""
        self.end_gc_lease()
        # A lock left by a failed earlier save through this writer stays on
        # storage, where it now counts as abandoned (its save is gone).
        self._lock = None
        self._strays = None
        self.renamed = {}
        self._replacing = []
        if checkpoint_id:
            new_path = normalize_path(checkpoint_id)
            if new_path != self.path:
                self.location = self.location.at(new_path)
                self._store = None
        self.save_id = uuid.uuid4().hex
        self._written = []
        self.base_frames = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all ranks) Record this rank's role; on the main thread, pause the
        cyclic collector until this rank's last hook (:meth:`write_data`,
        or :meth:`finish` on the coordinator) returns
        (:class:`~dcp_ext._runtime.HookPause`). In a 2-rank 256 MiB Azure save
        4 full collections of 141-345 ms fell in 7 saves without it, one in
        DCP's unpickling of a 67 KB plan.
        """
        self._gc_pause.begin()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        if kwargs.get("use_collectives", True) is False:
            raise ValueError(
                "CheckpointWriter needs use_collectives=True: its metadata is the "
                "single commit marker written by the coordinator after all ranks "
                "finished"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """(all ranks) Make sure the checkpoint location can be written."""
        self.store.ensure_root()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Take the save lock, protect existing checkpoints, name every rank's files.

        An overwrite leaves the checkpoint it replaces committed while the new
        data is written: a rank's file whose name the old checkpoint's
        directory holds gets a free generation of it (``model_rank0.g1.distcp``),
        and the old checkpoint is un-committed only in :meth:`finish`.
        """
        store = self.store
        if not self.overwrite:
            # The clearer error, before the lock's (an overwrite looks only under the lock).
            self._refuse_existing(store)
        self._lock = SaveLock(store, self.save_id, self.config)
        self._lock.acquire()
        try:
            # Checked again under the lock: a save that held it may have committed.
            existing = self._refuse_existing(store)
            # The root's one rule (dcp_ext.root): files another tag refers to stay.
            self._strays = check_reuse(self.location, store, bool(existing))
            taken = {name for name in store.list_tree() if name.endswith(DATA_SUFFIX)} if existing else set()
        except BaseException:
            self._release_lock()
            raise
        self._replacing = existing
        answers, self.renamed = assign_beside(plans, taken, self.config)
        return answers

    def _refuse_existing(self, store: Store) -> list[str]:
        """The metadata files of a committed checkpoint at the path (torch's
        first: un-committing removes dcp_ext's last); raises unless ``overwrite``."""
        existing = [n for n in (TORCH_METADATA_FILE, METADATA_FILE) if store.exists(n)]
        if existing and not self.overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {store.url}; pass overwrite=True "
                f"(to CheckpointWriter, dcp_ext.save or save_checkpoint) to replace it, or save to a new path",
                store.url,
            )
        return existing

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Stream this rank's items into its data files and commit them."""
        with self._gc_pause.ending_after(unless_ok=self.is_coordinator):  # the coordinator's ends in finish
            return self._write_data(plan, planner)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assignment = plan.storage_data
        if not isinstance(assignment, FileAssignment):
            raise ValueError(
                "SavePlan.storage_data must be a dcp_ext FileAssignment; was the "
                "plan prepared by CheckpointWriter.prepare_global_plan?"
            )
        store = self.store
        files = assignment.files_for(list(plan.items), self.config.files_per_rank)
        if self.incremental is not None:
            if not isinstance(planner, LayoutSavePlanner):
                raise ValueError("incremental saves need dcp_ext's LayoutSavePlanner (CheckpointManager uses it)")
            self.base_frames = read_base(self.incremental, plan.items, self.location)
        self._phase("write_data")
        crash_point("before_data")

        written: list[tuple[list[WriteItem], list[StoredItem]]] = []
        referenced: dict[str, int] = {}
        if len(files) == 1:
            written = [_write_file(self, store, files[0][0], files[0][1], planner, referenced)]
        elif files:
            with ThreadPoolExecutor(len(files), thread_name_prefix="dcp_ext-write") as pool:
                pending = [
                    pool.submit(_write_file, self, store, name, bucket, planner, referenced)
                    for name, bucket in files
                ]
                errors = []
                for task in pending:
                    try:
                        written.append(task.result())
                    except BaseException as err:  # collect, then raise the first
                        errors.append(err)
                if errors:
                    raise errors[0]
        if self.config.metadata_version >= 3 and isinstance(planner, LayoutSavePlanner):
            # One table for the coordinator instead of a result per item (dcp_ext.planning._write_results).
            position = {id(item): k for k, item in enumerate(plan.items)}
            results = pack_results(
                [position[id(item)] for items, _ in written for item in items],
                [where for _, stored in written for where in stored],
                referenced,
            )
        else:
            results = [
                WriteResult(index=item.index, size_in_bytes=where.length, storage_data=where)
                for items, stored in written
                for item, where in zip(items, stored, strict=True)
            ]
        crash_point("after_data")
        self._phase("written")
        release_free_memory()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator) Write the metadata, which commits the checkpoint."""
        with self._gc_pause.ending_after():
            self._finish(metadata, results)

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self._phase("commit")
        crash_point("before_metadata")
        store = self.store
        items = collect_stored(metadata, results)
        metadata.version = "1.0.0"
        metadata.storage_data = items
        if metadata.storage_meta is None:
            metadata.storage_meta = self.storage_meta()
        if self.before_commit is not None:
            # Its files replace the old checkpoint's (partition.json, user
            # content): un-commit the old one first, so that a crash in
            # between leaves no old checkpoint with the new files.
            uncommit(store, self._replacing)
            self._replacing = []
            hook = self.before_commit
            renaming = getattr(hook, "with_renamed", None)
            (renaming(dict(self.renamed)) if renaming is not None else hook)(store)
        if self._lock is not None:
            self._lock.check_held()  # a save judged dead meanwhile (stopped past the heartbeat timeout) never commits
        # Torch's pickle first, for torch's readers (they cannot decode our
        # compressed frames, so compressed checkpoints get none, nor do large
        # ones: see IOConfig.torch_metadata_chunks); our JSON last: the commit.
        compressed = bool(items.codecs) if isinstance(items, StoredColumns) else any(
            item.transforms for item in items.values()
        )
        incremental = _incremental_section(self.incremental, self.base_frames, items)
        store.write_file(
            METADATA_FILE,
            encode_metadata(metadata, items, world_size=len(results), version=self.config.metadata_version,
                            incremental=incremental),
        )
        if self.incremental is not None:
            self.incremental.end_lease()  # committed: the base's files are now referred to by our metadata
        # Written after ours, so that a directory with torch's .metadata alone is
        # never a crashed dcp_ext save (the root's cleanup leaves it alone); always
        # written, so tools that take it as DCP's commit marker find every checkpoint.
        reason = ("its data is compressed" if compressed else "it refers to earlier checkpoints' files"
                  if incremental is not None else f"its {len(items)} chunks are too many for torch's pickled "
                  f"metadata (IOConfig.torch_metadata_chunks)" if len(items) > self.config.torch_metadata_chunks
                  else None)
        store.write_file(TORCH_METADATA_FILE, to_torch_metadata(metadata, items) if reason is None
                         else torch_reader_marker(reason))
        # Old files go while the lock is still held: a save that takes it next
        # may write files this one does not name.
        remove_replaced(store, {name for name, _, _ in items.files} if isinstance(items, StoredColumns)
                        else {item.relative_path for item in items.values()}, self._strays)
        self._strays = None
        self._release_lock()
        if self.after_commit is not None:
            try:
                self.after_commit()
            except PostCommitError:
                raise
            except Exception as err:
                raise PostCommitError(f"checkpoint {store.url} committed, but {err}", store.url) from err

    def remove_own_files(self) -> None:
        """(each rank) Delete the data files this rank committed in the current
        save, and the checkpoint's directory if that left it empty. Used
        after a failed save so that no orphaned data remains.

        Nothing is deleted if the checkpoint committed after all: a rank
        whose coordinator died after writing the metadata (or whose
        ``after_commit`` failed) sees the save fail, yet the metadata, which
        only this save can have written once it took the lock and removed
        the old one, references these files. If that cannot be checked, the
        files stay for the leftover cleanup of the next save.
        """
        if self._written:
            try:
                committed = committed_with(self.store, self._written)
            except DcpExtError as err:
                log.warning("not removing this rank's files in %s: %s", self.store.url, err)
                committed = True
            if committed:
                self._written = []
        for name in self._written:
            try:
                self.store.delete(name)
            except Exception as err:
                log.warning("could not delete %s: %s", self.store.describe(name), err)
        self._written = []
        if self.is_coordinator and self.incremental is not None:
            self.incremental.end_lease()
        if self._lock is None:  # not the coordinator: the directory goes if it is empty
            left: list[str] = []
        else:
            left = self._give_up_lock()
        if left:
            return
        try:  # a directory the failed save created and left empty (local file systems)
            self.store.remove_root_if_empty()
        except Exception as err:  # noqa: BLE001 - only tidiness is lost
            log.debug("could not remove the empty %s: %s", self.store.url, err)

    def _give_up_lock(self) -> list[str]:
        """(coordinator, after a failure) Release the lock; the files still
        in the directory (then the lock stays, released, as dcp_ext's mark)."""
        assert self._lock is not None
        try:
            # Other ranks' files (a rank that died, or is still deleting) keep
            # the lock file, released, as the mark that the directory is
            # dcp_ext's: the next save's leftover cleanup removes it.
            left = [name for name in self.store.list_tree() if name != LOCK_FILE]
        except Exception as err:  # noqa: BLE001 - then keep the mark
            log.debug("could not list %s: %s", self.store.url, err)
            left = [self.store.url]
        self._lock.release(keep_mark=bool(left))
        self._lock = None
        return left

    def _phase(self, name: str) -> None:
        if self.rank_watch is not None:
            self.rank_watch.phase(name)

    def outcome(self) -> str:
        """(each rank, after a failed save) What became of the checkpoint, for messages."""
        return save_outcome(self.store, self._written)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))




def _write_file(
    owner: CheckpointWriter, store: Store, name: str, items: list[WriteItem], planner: SavePlanner,
    referenced: dict[str, int],
) -> tuple[list[WriteItem], list[StoredItem]]:
    """(each rank, ``write_data``) Write one data file of ``owner``'s save:
    each item's frames (:class:`~dcp_ext.frames.FrameEncoder`); add the bytes
    its frames refer to in earlier checkpoints' files to ``referenced``."""
    size_hint = sum(item_nbytes(i) + _ENVELOPE_ESTIMATE for i in items)
    base = owner.base_frames
    hashing = owner.incremental is not None
    # Stored inside torch.save envelopes (for torch's readers), except in
    # incremental saves, whose items may be partly in other files.
    raw_tensors = owner.codec is None and not hashing
    with store.open_writer(name, size_hint=size_hint) as writer:
        with FrameEncoder(writer, name, owner.config.frame_size, owner.codec, hashing=hashing) as frames:
            for item in items:
                data = planner.resolve_data(item)
                keep, raw = _raw_view(data, item)
                known = base.get(item) if base is not None else None
                if keep is None:
                    frames.add(raw, data, base=known)
                else:
                    envelope = torch_save_envelope(keep.dtype, tuple(keep.shape)) if raw_tensors else None
                    frames.add(raw, keep, dtype=keep.dtype, envelope=envelope, base=known)
                del data, keep, raw
            stored = frames.finish()
        with _REFERENCED_LOCK:  # files are written by parallel threads
            for source, nbytes in frames.referenced.items():
                referenced[source] = referenced.get(source, 0) + nbytes
        if owner.config.metadata_version >= 3:
            stored = _append_frame_index(writer, stored)
        writer.commit()
    owner._written.append(name)
    return items, stored


def _incremental_section(incremental: IncrementalSave | None, base_frames: BaseFrames | None,
                         items: Any) -> dict[str, Any] | None:
    """(coordinator) The metadata's ``incremental`` section: the base, the
    chain length, and every earlier checkpoint's file its frames refer to."""
    if incremental is None:
        return None
    base = base_frames or BaseFrames()
    references = items.references if isinstance(items, StoredColumns) else {}
    chain = base.own_chain
    if references and chain == 0:  # pragma: no cover - a rank referred although the coordinator's base was not referable
        raise RuntimeError("a rank referred to its base's frames although this save starts a chain")
    return {
        "base": incremental.base_tag if base.referable else None,
        "chain": chain,
        "references": [[name, nbytes] for name, nbytes in sorted(references.items())],
        "sizes": [[name, base.file_sizes[name]] for name in sorted(references) if name in base.file_sizes],
    }


def _append_frame_index(writer: Any, stored: list[StoredItem]) -> list[StoredItem]:
    """Write the file's frame index at its end; the items without their frame
    tables (they travel to the coordinator, which needs only where items lie)."""
    index = encode_frame_index(stored)
    ref = FrameIndexRef(writer.position, len(index), xxhash.xxh3_64_intdigest(index))
    writer.write(index)
    return [
        dataclasses.replace(item, frame_lengths=(), checksums=(), indexed=True, frame_index=ref)
        for item in stored
    ]


def _tensor_for_storage(data: Any, item: WriteItem) -> torch.Tensor:
    """The item's tensor as contiguous CPU memory, with clear errors."""
    fqn = item.index.fqn
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner returned {type(data).__name__} for tensor item {fqn!r}")
    tensor = data.detach()
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise TypeError(f"tensor {fqn!r} has layout {tensor.layout}; only dense tensors are stored")
    if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
        raise TypeError(f"tensor {fqn!r} has dtype {tensor.dtype}, which dcp_ext cannot store")
    if tensor.device.type != "cpu":
        # Accelerator tensors: one synchronous copy per item keeps the path thin;
        # dcp.async_save stages to CPU before this point anyway.
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    _check_against_plan(tensor, item)
    return tensor


def _check_against_plan(tensor: torch.Tensor, item: WriteItem) -> None:
    """Refuse a tensor whose dtype, shape or byte size is not what the save
    plan (and so the metadata this save commits) records for ``item``: a
    stale plan must never commit numbers the metadata describes otherwise."""
    planned = item.tensor_data
    if planned is None:
        return
    fqn = item.index.fqn
    dtype = planned.properties.dtype if planned.properties is not None else None
    if dtype is not None and tensor.dtype != dtype:
        raise PlanMismatchError(
            f"tensor {fqn!r} is {tensor.dtype}, but the save plan records it as {dtype}; "
            f"nothing was committed (a plan cached by another planner than dcp_ext's LayoutSavePlanner?)"
        )
    sizes = tuple(planned.chunk.sizes) if planned.chunk is not None else tuple(planned.size)
    if tuple(tensor.shape) != sizes:
        raise PlanMismatchError(
            f"tensor {fqn!r} has shape {tuple(tensor.shape)} but the save plan expects {sizes}; "
            f"nothing was committed"
        )
    expected = math.prod(sizes) * tensor.element_size()
    if tensor.nbytes != expected:  # pragma: no cover - implied by dtype and shape for dense tensors
        raise PlanMismatchError(f"tensor {fqn!r} holds {tensor.nbytes} bytes, but the save plan expects {expected}")


def _raw_view(data: Any, item: WriteItem) -> tuple[torch.Tensor | None, memoryview]:
    """The bytes to store for an item, and the tensor that owns them (``None``
    for a bytes item, whose bytes are copied)."""
    if item.type == WriteItemType.BYTE_IO:
        if not hasattr(data, "getbuffer"):
            raise TypeError(
                f"planner returned {type(data).__name__} for bytes item "
                f"{item.index.fqn!r}; expected io.BytesIO"
            )
        return None, memoryview(data.getvalue())
    tensor = _tensor_for_storage(data, item)
    return tensor, tensor_bytes(tensor)

