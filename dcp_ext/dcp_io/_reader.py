"""``CheckpointReader``: DCP ``StorageReader`` that reads only the bytes a rank needs.

The DCP lifecycle only; the work is its collaborators': where the metadata
comes from, chosen once (:mod:`._metadata_sources`: dcp_ext's JSON, torch's
``.metadata``, a safetensors folder), where the data files are
(:mod:`._checkpoint_files`), how each read item becomes byte reads
(:mod:`._item_reads`), and the read-once exchange between ranks
(:mod:`._read_once`, :mod:`._read_exchange`). Checkpoints written by torch's
own ``FileSystemWriter``/``FsspecWriter`` and safetensors folders written by
torch's ``HuggingFaceStorageWriter`` or Hugging Face are read too.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._runtime import HookPause, gc_paused, release_free_memory
from ..config import IOConfig
from ..errors import CheckpointCorruptError, DcpExtError
from ..frames import FrameStats
from ..metadata import IncrementalSection
from ..metadata.document import FrameIndexRef
from ..planning import ChunkShapes
from ..storage import Location, ReadRequest, Store, normalize_path
from ._checkpoint_files import CheckpointFiles
from ._item_reads import ItemReads
from ._metadata_sources import (
    LoadedMetadata,
    broadcast_metadata_bytes,
    missing_metadata_error,
    read_checkpoint_metadata,
    replaced_error,
)
from ._read_exchange import Exchange, Incoming, host_identity, shared_memory_usable
from ._read_once import GroupSeen, RankExchange, Receive, Send, auto_min_saved, plan_read_once

if TYPE_CHECKING:
    from .._runtime import ExtensionRegistry

__all__ = ["CheckpointReader"]

class CheckpointReader(StorageReader):
    """Load a DCP checkpoint from a local directory, shared POSIX or S3/fsspec.

    Use with stock DCP::

        dcp.load(state_dict, storage_reader=CheckpointReader("s3://bucket/ckpt/step100"))

    Lifecycle (DCP calls these; which ranks call each):

    0. (all ranks) ``reset(checkpoint_id)`` when ``checkpoint_id=`` is passed.
    1. (all ranks) ``read_metadata``: refuses a checkpoint without metadata.
    2. (all ranks) ``set_up_storage_reader``.
    3. (all ranks) ``prepare_local_plan``; (coordinator) ``prepare_global_plan``.
    4. (all ranks) ``read_data``: ranged, merged, parallel reads of this
       rank's slices.

    Args:
        path: Checkpoint directory: local path, ``file://``, ``s3://`` or any
            fsspec URL. ``dcp.load(checkpoint_id=...)`` replaces it.
        storage_options: The store's options (see :class:`CheckpointWriter`).
        config: I/O tunables; the keyword arguments below override its fields.
        max_concurrency: Ranged reads in flight per rank.
        read_request_size: Largest single ranged read.
        coalesce_gap: Merge reads whose gap is at most this many bytes.
        verify_checksums: Check each frame read against its recorded checksum
            (default on; ``ChecksumMismatchError`` names the file, byte range
            and tensor on a mismatch).
        store: Read through this store instead of opening ``path`` (e.g. a
            :class:`~dcp_ext.storage.tiered.TieredStore` over the copies of
            one checkpoint in several tiers; a damaged file is then read
            again from the next copy).
        read_once: When several ranks of the load need the same stored
            bytes (DDP replicas, HSDP's replicate dimension, replicated
            buffers), read them from storage once and hand them to the
            other ranks (shared memory on one host, the process group
            between hosts). ``None`` (default): on, except for a local or
            shared file system when every rank is on one host, where the
            page cache already serves each byte once and every rank copying
            from it is faster (measured: 4-rank DDP load of 1 GiB from a warm
            page cache 0.81 s each rank reading vs 1.39 s read-once), and
            for a load of at most 8 ranks that would spare storage less than
            1 MiB per rank (only small values shared: ``step``, norms; the
            exchange costs more than reading them twice,
            :func:`~dcp_ext.dcp_io._read_once.auto_min_saved`).
            ``True``: always. ``False``: every rank reads everything it
            needs itself.
        process_group: The group ``dcp.load`` runs on (its
            ``process_group=``; ``None``: the default group). Read-once
            exchanges data over it.
        exchange_timeout: Seconds a rank waits for one batch of the
            read-once exchange before giving up with an error.
        shared_memory: Ranks on the same host exchange read-once data
            through shared-memory files in ``/dev/shm`` (one copy in, one
            copy out) instead of over the process group (default on).
        extension_registry: For checkpoints written by torch's
            ``FileSystemWriter(_extensions=[...])``: a torch
            ``ExtensionRegistry`` that knows their stream extensions (as
            torch's ``FileSystemReader(_extension_registry=...)``).
            ``None``: torch's default registry, which knows ``ZStandard``.

    Compressed checkpoints need no setting: each item's metadata names its
    codec, and only the frames covering the requested bytes are read and
    decompressed, in parallel threads. Nor do safetensors folders written by
    torch's ``HuggingFaceStorageWriter`` (any of its modes) or Hugging Face:
    a folder without DCP metadata but with ``model.safetensors.index.json`` or
    ``*.safetensors`` files is described by their headers
    (:mod:`dcp_ext.dcp_io._hf_folder`) and read with the same ranged reads.

    Attributes:
        stats: Bytes and requests this reader's store has read (for tests and
            benchmarks): ``reader.store.stats.snapshot()``.
        last_error: The dcp_ext error of the last failed ``read_metadata``
            (DCP rewraps it in an ``AssertionError`` without a cause) or
            read-once exchange (DCP's next collective fails too when a rank
            died, raising gloo's error instead).
        frame_stats: Frames verified and decoded since the last ``reset``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Location,
        *,
        storage_options: dict[str, Any] | None = None,
        config: IOConfig | None = None,
        max_concurrency: int | None = None,
        read_request_size: int | str | None = None,
        coalesce_gap: int | str | None = None,
        verify_checksums: bool | None = None,
        store: Store | None = None,
        read_once: bool | None = None,
        process_group: Any = None,
        exchange_timeout: float = 600.0,
        shared_memory: bool = True,
        extension_registry: ExtensionRegistry | None = None,
    ) -> None:
        super().__init__()
        if extension_registry is not None and not callable(getattr(extension_registry, "from_descriptor_list", None)):
            raise TypeError(
                f"extension_registry must be a torch ExtensionRegistry, got {type(extension_registry).__name__}"
            )
        self.extension_registry = extension_registry
        """torch's ``ExtensionRegistry`` for checkpoints written with stream extensions
        (``None``: torch's default)."""
        self.read_once = read_once
        """Whether ranks that need the same stored bytes read them once and share them (``None``:
        automatic)."""
        self.shared_memory = shared_memory
        """Whether ranks on one host exchange read-once data through ``/dev/shm`` files."""
        self.process_group = process_group
        """The group ``dcp.load`` runs on (``None``: the default group); read-once exchanges use
        it."""
        #: This rank's phases in dcp_ext's own load calls (:mod:`dcp_ext.dcp_io._watched`), else ``None``.
        self.rank_watch: Any = None
        self.exchange_timeout = exchange_timeout
        """Seconds a rank waits for one batch of the read-once exchange."""
        overrides = {
            "verify_checksums": verify_checksums,
            "max_concurrency": max_concurrency,
            "read_request_size": read_request_size,
            "coalesce_gap": coalesce_gap,
        }
        if config is None:
            config = path.config if isinstance(path, Location) else IOConfig.from_env()
        config = config.with_overrides(**overrides)
        self.config = config
        """The I/O tunables this reader reads with."""
        location = Location.of(path, storage_options).with_config(config)
        self.storage_options = location.storage_options
        """The store's options."""
        self._files = CheckpointFiles(location, store)
        self._reads = ItemReads(self._files, config, extension_registry)
        self.load_id = uuid.uuid4().hex
        """A random id of the current load, new at every ``reset``; ``read_metadata`` sets it as
        ``storage_meta.load_id`` of the metadata it returns (every rank)."""
        self._frame_indexes: dict[str, FrameIndexRef] = {}
        #: An incremental save's section of the metadata (version 4), else ``None``.
        self.incremental: IncrementalSection | None = None
        #: Set by dcp_ext's loads, which call ``read_metadata`` on every rank of
        #: this group (a 1-tuple; ``(None,)`` is the default group): the
        #: coordinator then reads the document once for all.
        self.metadata_group: tuple[Any] | None = None
        #: How many times this reader read the metadata document from storage.
        self.metadata_reads = 0
        self.last_error: BaseException | None = None
        self._dcp_rank: int | None = None
        # The metadata file the current load started from and the xxh3-64 of
        # its bytes: a read that fails is checked against it (replaced_error).
        self._metadata_seen: tuple[str, int] | None = None
        self._gc_pause = HookPause(main_thread_only=False)
        self.last_exchange: Exchange | None = None
        """The read-once exchange of this rank's last ``read_data`` (``None`` when it read
        everything itself); tests read its plan."""

    @property
    def path(self) -> str:
        """The checkpoint directory's URL."""
        return self._files.path

    @property
    def store(self) -> Store:
        """The store of the current checkpoint path (created on first use)."""
        return self._files.store

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory's URL, as DCP's ``checkpoint_id`` (the same as :attr:`path`)."""
        return self.path

    @property
    def storage_data(self) -> Any:
        """Where every stored chunk lives (after ``set_up_storage_reader``)."""
        return self._reads.storage_data

    @property
    def frame_indexes(self) -> dict[str, FrameIndexRef]:
        """Version 3 and later: where each data file's frame index lies (after ``read_metadata``)."""
        return self._frame_indexes

    def sibling_store(self, directory: str) -> Store:
        """The store of another checkpoint directory under the same root (the
        files an incremental checkpoint's frames refer to), opened once."""
        return self._files.sibling_store(directory)

    def describe(self, name: str) -> str:
        """Where a data file (or a file an incremental checkpoint refers to) is."""
        return self._files.describe(name)

    def file_store(self, name: str) -> tuple[Store, str]:
        """The store holding data file ``name`` of this checkpoint, and its name there."""
        return self._files.file_store(name)

    def read_requests(self, requests: list[ReadRequest]) -> None:
        """Run read requests on the stores of the files they name."""
        self._files.read_requests(requests)

    def replaced_error(self, err: DcpExtError) -> DcpExtError:
        """``err``, or a :class:`~dcp_ext.errors.CheckpointReplacedError` when
        the read failed because the checkpoint changed under it
        (:func:`dcp_ext.dcp_io._metadata_sources.replaced_error`)."""
        return replaced_error(self.store, self.path, self._metadata_seen, err)

    def stored_item(self, read_item: ReadItem) -> Any:
        """(after :meth:`set_up_storage_reader`) Where the stored chunk
        ``read_item`` reads from lies: a :class:`~dcp_ext.metadata.StoredItem`
        with its frames (frame index read if needed), or a torch-written
        item's storage info.

        Raises:
            CheckpointCorruptError: The metadata has no such chunk.
            CheckpointReplacedError: Its frame index no longer matches: the
                checkpoint was replaced since ``read_metadata``.
        """
        try:
            return self._reads.info(read_item)
        except DcpExtError as err:
            replaced = self.replaced_error(err)
            if replaced is not err:
                raise replaced from err
            raise

    @property
    def frame_stats(self) -> FrameStats:
        """Frames verified and decoded since the last ``reset``."""
        return self._reads.frames.stats

    def end_gc_lease(self) -> None:
        """(each rank) End the GC pause that :meth:`prepare_local_plan` began, if any."""
        self._gc_pause.end()

    def missing_metadata_error(self) -> DcpExtError:
        """The error for a path without metadata: nothing there, an
        incomplete save, or something that is not a checkpoint."""
        return missing_metadata_error(self.store)

    # -- StorageReader --------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) Start a new load, optionally from a new path."""
        self.end_gc_lease()
        if checkpoint_id:
            self._files.moved(self._files.location.at(normalize_path(checkpoint_id)))
        self.load_id = uuid.uuid4().hex
        self._metadata_seen = None
        self._frame_indexes = {}
        self.incremental = None
        self._reads = ItemReads(self._files, self.config, self.extension_registry)

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP must not retry per rank
        """(all ranks) Read and validate the checkpoint's metadata.

        Raises:
            CheckpointNotFoundError: Nothing exists at the path (or no bucket).
            CheckpointIncompleteError: Data files but no metadata: the save
                failed or is still running.
            NotACheckpointError: The path holds something else.
            CheckpointCorruptError: The metadata is damaged or hostile.
        """
        self.last_error = None
        try:
            with gc_paused():
                loaded = self._load_metadata()
        except DcpExtError as err:
            self.last_error = err
            raise
        self.metadata_reads += loaded.reads
        self._metadata_seen = loaded.seen
        self._frame_indexes = loaded.frame_indexes
        self.incremental = loaded.incremental
        metadata = loaded.metadata
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _load_metadata(self) -> LoadedMetadata:
        """The checkpoint's metadata from the first source that has it (a
        subclass that describes its files itself overrides this)."""
        shared, reads = (None, 0) if self.metadata_group is None else broadcast_metadata_bytes(
            self.metadata_group[0], self.store)
        loaded = read_checkpoint_metadata(self.store, shared, self.config.max_concurrency)
        return dataclasses.replace(loaded, reads=loaded.reads + reads)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """(all ranks) Take the map of where every stored chunk lives (looked
        up per read item: nothing here walks every chunk)."""
        if metadata.storage_data is None:
            raise CheckpointCorruptError(f"metadata of {self.path} has no storage map", self.path)
        self._reads.use(metadata.storage_data, self._frame_indexes, ChunkShapes(metadata.state_dict_metadata))
        rank = kwargs.get("rank")
        self._dcp_rank = rank if isinstance(rank, int) else None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """(all ranks) With read-once, tell the coordinator this rank's place
        in the group it would exchange over.

        From here until :meth:`read_data` returns (DCP's plan exchange, the
        global plan, the reads) the cyclic collector is paused
        (:class:`~dcp_ext._runtime.HookPause`): only ``dcp.load`` calls this, and
        ``read_data`` next."""
        self._gc_pause.begin()
        seen = None
        if self.read_once is not False and dist.is_available() and dist.is_initialized():
            seen = GroupSeen(dist.get_rank(self.process_group), dist.get_world_size(self.process_group),
                             host_identity(), self.shared_memory and shared_memory_usable())
            if self._dcp_rank is not None and self._dcp_rank != seen.rank:
                seen = None  # not the group dcp.load runs on: no exchange
        return dataclasses.replace(plan, storage_data=seen)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """(coordinator) With read-once, give every read that several ranks
        share one owner (:func:`dcp_ext.dcp_io._read_once.plan_read_once`)."""
        seen = [plan.storage_data for plan in plans]
        groups = [s for s in seen if isinstance(s, GroupSeen)]
        exchangeable = len(plans) > 1 and len(groups) == len(plans) and all(
            (s.rank, s.size) == (rank, len(plans)) for rank, s in enumerate(groups)
        )
        # On one host a file's bytes are read once by the page cache anyway.
        page_cache_shared = len({s.host for s in groups}) == 1 and self.store.kind == "local"
        if not exchangeable or (self.read_once is None and page_cache_shared):
            return [dataclasses.replace(plan, storage_data=None) for plan in plans]
        hosts = [s.host if s.shared_memory else "" for s in groups]
        reads = self._reads
        return plan_read_once(plans, reads.item_bytes, reads.item_order, self.config.read_buffer_bytes,
                              reads.item_grain, hosts, uuid.uuid4().hex[:16],
                              min_saved=0 if self.read_once else auto_min_saved(len(plans)))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Fetch this rank's slices and hand them to the planner;
        with read-once, exchange shared items with the other ranks (every
        rank raises the same error if any rank fails)."""
        watcher = self.rank_watch
        if watcher is not None:
            watcher.phase("read_data")
        with self._gc_pause.ending_after(), gc_paused():
            try:
                if isinstance(plan.storage_data, RankExchange):
                    self._read_exchanging(plan, planner, plan.storage_data)
                else:
                    self._reads.read_all(plan, planner)
            except DcpExtError as err:
                replaced = self.replaced_error(err)
                if isinstance(plan.storage_data, RankExchange):
                    # DCP's own collective after read_data fails too when a
                    # rank died, hiding this error; dcp_ext.load raises it.
                    self.last_error = replaced
                if replaced is not err:
                    raise replaced from err
                raise
        if watcher is not None:
            watcher.phase("read")
        release_free_memory()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_exchanging(self, plan: LoadPlan, planner: LoadPlanner, part: RankExchange) -> None:
        """Read this rank's own and owned items and exchange the shared ones.

        A reading thread reads the items this rank owns batch by batch (then
        the ones only it needs) while this thread exchanges each batch as
        soon as its items are read, so storage reads and network transfers
        overlap. A read error is agreed at the batch it belongs to.
        """
        exchange = self.last_exchange = Exchange(part, self.process_group, self.exchange_timeout, self.path)
        reads = self._reads
        payloads: dict[int, Callable[[], torch.Tensor]] = {}
        owned: list[list[int]] = [[] for _ in range(part.batches)]
        for send in part.sends:
            owned[send.batch].append(send.item)
        kept = frozenset(s.item for s in part.sends)
        alone = [i for i in range(len(plan.items)) if i not in kept and i not in part.skipped]

        def payload(send: Send) -> torch.Tensor:
            return payloads[send.item]()

        def incoming(receive: Receive) -> Incoming:
            return reads.incoming(plan.items[receive.item], planner)

        with ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-read-once") as pool:
            batches = [
                pool.submit(reads.read_all, plan, planner, positions=items, keep=kept, payloads=payloads)
                for items in owned
            ]
            rest = pool.submit(reads.read_all, plan, planner, positions=alone)
            failed = True
            try:
                for batch in range(part.batches):
                    start = time.perf_counter()
                    read_error = batches[batch].exception()
                    exchange.seconds["reading"] += time.perf_counter() - start
                    exchange.run_batch(batch, payload, incoming, read_error)
                start = time.perf_counter()
                read_error = rest.exception()
                exchange.seconds["reading"] += time.perf_counter() - start
                exchange.agree(read_error)
                failed = False
            finally:
                for future in [*batches, rest]:
                    future.cancel()
                exchange.close(failed)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether DCP may pass ``checkpoint_id`` to this reader: any path or URL string (or
        path-like).

        DCP calls it to pick a storage reader when none is given.
        """
        return isinstance(checkpoint_id, (str, os.PathLike))
