"""The checkpoint API: ``CheckpointManager``, ``save_checkpoint`` and ``resume_from_checkpoint``.

The SageMaker model-parallel workflow on open PyTorch (DCP with plain, DDP,
FSDP2 and tensor-parallel models) in the layout of :mod:`dcp_ext.layout`. The
manager orchestrates; each job has its own module: the root's tags,
``newest``, deletion and leftovers (:mod:`dcp_ext.root`), retention policies
(:mod:`dcp_ext.retention`), full checkpoints (:mod:`dcp_ext.full`; Hugging Face
folders: :mod:`dcp_ext.hf_export`), DCP calls
(:mod:`dcp_ext._dcp_calls`), the process group (:mod:`dcp_ext.process_group`).

Order of a partial save (each step only after the previous one succeeded):

1. every rank streams its shards into ``{tag}_partial/`` (``dcp.save`` with
   :class:`~dcp_ext.CheckpointWriter` and :class:`~dcp_ext.planners.LayoutSavePlanner`);
2. the coordinator writes ``user_content.safetensors`` and ``partition.json``,
   then the metadata, which commits the checkpoint;
3. the coordinator points ``newest`` at the tag (atomic replace locally, one
   PUT on S3);
4. retention deletes the committed partial checkpoints its policy does not
   keep, never the ``newest`` target and never a file dcp_ext did not write;
   then what crashed saves left behind is removed.

Steps 3-4 run inside the writer's ``finish``, so a failure there reaches
every rank through DCP, for synchronous and asynchronous saves alike. A
failure at any step leaves ``newest`` on the previous tag and deletes nothing.

An asynchronous save (``async_save=True``) stops the caller only while the
state is walked; the manager's :class:`~dcp_ext.staging.Stager` copies it into
reused buffers in the background, and the upload (steps 1-4) runs in a thread
or, with ``async_uploads="process"``, in DCP's checkpoint process. The
returned :class:`~dcp_ext.AsyncSaveHandle` has DCP's two futures:
``staging_completion`` (wait before changing the state) and
``upload_completion`` (committed, ``newest`` moved, retention done).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._dcp_calls import AsyncSaveHandle, run_load, run_save, start_async_save
from .codecs import Codec, resolve_codec
from .compact import CompactReport
from .config import IOConfig
from .errors import (
    CheckpointCorruptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    DcpExtError,
    NotACheckpointError,
    PostCommitError,
    StorageFullError,
)
from .full import save_full
from .hf_layout import HF_INDEX_FILE
from .incremental import DEFAULT_MAX_CHAIN, IncrementalSave, restart_reason
from .incremental_drain import refers_elsewhere
from .key_map import KeyMap, TranslateFunction, rename_keys
from .layout import (
    PARTITION_FILE,
    USER_CONTENT_FILE,
    MeshInfo,
    Partition,
    TagInfo,
    is_valid_tag,
    partial_dir,
    user_content_name,
    validate_tag,
)
from .leases import Lease
from .metadata import METADATA_FILE, TORCH_METADATA_FILE, read_incremental_section
from .model_registry import with_registered
from .nodes import NodeMap
from .planners import LayoutLoadPlanner, LayoutSavePlanner
from .pretrained import load_pretrained
from .process_group import GroupView
from .reader import CheckpointReader
from .retention import KeepLast, RetentionPolicy
from .root import CheckpointRoot
from .save_lock import lock_state
from .staging import Stager
from .storage import Store, join_path, normalize_path, open_store
from .storage.tiered import TieredStore
from .tiers import LocalTier, RestorePlan, drain, plan_restore, raise_if_any
from .user_content import decode_user_content, encode_user_content
from .writer import CheckpointWriter

__all__ = ["CheckpointManager", "ResumeResult", "save_checkpoint", "resume_from_checkpoint", "close_checkpoints"]

log = logging.getLogger("dcp_ext.manager")

# A resume that follows ``newest`` retries this often when retention of a
# concurrent save deletes the tag it is reading.
_RESUME_ATTEMPTS = 4


@dataclass(frozen=True)
class ResumeResult:
    """What :meth:`CheckpointManager.resume` loaded.

    Attributes:
        tag: The checkpoint's tag.
        user_content: The ``user_content`` saved with it (``None`` if none).
        partial: Whether it came from a partial checkpoint.
    """

    tag: str
    user_content: Any
    partial: bool


class CheckpointManager:
    """Partial and full checkpoints under one root, SageMaker style.

    Create one on every rank with the same arguments; :meth:`save` and
    :meth:`resume` are called by all ranks of ``process_group`` (collective),
    queries such as :meth:`tags` by any rank.

    Args:
        root: Local path, ``s3://bucket/prefix`` or fsspec URL of the root.
        storage_options: fsspec/s3fs options (S3 endpoint, credentials, ...).
        config: I/O tunables.
        process_group: Group that saves and loads (default group if ``None``).
        mesh: The ``DeviceMesh`` (with dimension names) the model is sharded
            over; data files are then named by mesh coordinates.
        compression: Codec of partial checkpoints: ``None`` (default),
            ``"zstd"`` or a codec object (see :class:`CheckpointWriter`).
            Loading needs no setting; full checkpoints are not compressed.
        retention: Default :mod:`dcp_ext.retention` policy applied after each
            partial save (``None``: keep everything unless a save says otherwise).
        async_uploads: Where an asynchronous save's upload runs: ``"thread"``
            (default) or ``"process"`` (DCP's checkpoint process, one per
            rank, started on the first such save; the upload's Python work
            then does not compete with training for the GIL). With
            ``"process"``, retention policies must pickle (no lambdas).
        stager: The :class:`~dcp_ext.staging.Stager` for asynchronous saves
            (default: one made on the first asynchronous save, with
            background staging, shared-memory buffers for ``"process"``
            uploads). Its buffers hold one copy of the state per rank until
            :meth:`close`.
        local_tier: This node's local-tier directory (NVMe, ``/dev/shm``;
            each rank passes its own node's path): partial saves commit
            there first and reach ``root`` only when persisted (see
            :mod:`dcp_ext.tiers`). Which ranks share a node:
            :mod:`dcp_ext.nodes` (``DCP_EXT_NODE_RANK`` overrides). Creating
            the manager is then collective; without ``process_group`` it
            creates a gloo group of its own for its background collectives.
        persist_every: With ``local_tier``: drain every N-th save to ``root``
            in the background (``0``: only saves asked with ``persist=True``).
        keep_local: With ``local_tier``: keep this many newest tags in each
            local tier (``None``: keep all); a tag still draining is kept.
        replicas: With ``local_tier``: ``1`` to also keep each node's data
            files in its partner node's tier (sent over the process group),
            so that a node whose tier is lost restores from its partner.
        local_tier_bytes: With ``local_tier``: the most bytes this node's
            tier may hold (a share of ``/dev/shm``, say; the node leader's
            value counts). Before each tiered save every node's room (this
            cap and the free space) is checked; a save that does not fit in
            some node's tier goes straight to ``root`` instead, and its
            handle (or a synchronous ``save``) raises
            :class:`~dcp_ext.errors.StorageFullError` naming the node.
        incremental: Partial saves write only the frames that changed since
            the newest checkpoint (:mod:`dcp_ext.incremental`): unchanged
            frames (frozen weights, untouched embedding rows) are referred
            to in the earlier checkpoint's files. Off by default. Retention
            and deletion keep every file a kept checkpoint refers to. With
            ``local_tier``, the local tiers hold full copies (with frame
            hashes) and each drain writes to ``root`` only the frames that
            differ from the root's newest checkpoint
            (:mod:`dcp_ext.incremental_drain`).
        max_chain: With ``incremental``: after this many incremental saves
            in a row, a save writes every frame again (so a checkpoint
            needs the files of at most ``max_chain + 1`` saves). A save also
            starts a new chain earlier when most bytes of the earlier files
            its base refers to are no longer used
            (:func:`~dcp_ext.incremental.restart_reason`), so frozen weights
            are not rewritten for nothing and drifting ones are not kept
            alive in files mostly dead.

    Attributes:
        checkpoints: The :class:`~dcp_ext.root.CheckpointRoot` (tags, ``newest``, deletion).
        last_load_planner: The planner of the last partial resume (fast-path and key reports).
        last_reader: Its reader; ``last_reader.store.stats`` has the bytes and files read.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        config: IOConfig | None = None,
        process_group: Any = None,
        mesh: Any = None,
        compression: str | Codec | None = None,
        retention: RetentionPolicy | None = None,
        async_uploads: str = "thread",
        stager: Stager | None = None,
        local_tier: str | os.PathLike[str] | None = None,
        persist_every: int = 10,
        keep_local: int | None = 2,
        replicas: int = 0,
        local_tier_bytes: int | None = None,
        incremental: bool = False,
        max_chain: int = DEFAULT_MAX_CHAIN,
    ) -> None:
        if async_uploads not in ("thread", "process"):
            raise ValueError(f"async_uploads must be 'thread' or 'process', got {async_uploads!r}")
        if persist_every < 0:
            raise ValueError(f"persist_every must be >= 0, got {persist_every}")
        if keep_local is not None and keep_local < 1:
            raise ValueError(f"keep_local must be >= 1 or None, got {keep_local}")
        if replicas not in (0, 1):
            raise ValueError(f"replicas must be 0 or 1, got {replicas}")
        if local_tier_bytes is not None and local_tier_bytes < 0:
            raise ValueError(f"local_tier_bytes must be >= 0 or None, got {local_tier_bytes}")
        if local_tier is not None and "://" in normalize_path(local_tier):
            raise ValueError(f"local_tier must be a directory on this node, got the URL {os.fspath(local_tier)!r}")
        if max_chain < 0:
            raise ValueError(f"max_chain must be >= 0, got {max_chain}")
        self.incremental = incremental
        self.max_chain = max_chain
        self.root = normalize_path(root)
        self.compression = resolve_codec(compression)
        self.storage_options = dict(storage_options or {})
        self.config = config or IOConfig.from_env()
        self.process_group = process_group
        self.group = GroupView(process_group)
        self._own_group: Any = None
        self.mesh = MeshInfo.from_device_mesh(mesh) if mesh is not None else None
        self.retention = retention
        self.checkpoints = CheckpointRoot(self.root, self.config, self.storage_options)
        self.async_uploads = async_uploads
        self.stager = stager
        self._own_stager = stager is None
        self._pending: AsyncSaveHandle | None = None
        self._lock = threading.Lock()
        _LIVE_MANAGERS.add(self)
        self.last_load_planner: LayoutLoadPlanner | None = None
        self.last_reader: CheckpointReader | None = None
        self.last_restore_plan: RestorePlan | None = None
        self.persist_every = persist_every
        self.keep_local = keep_local
        self.replicas = replicas
        self.local_tier_bytes = local_tier_bytes
        self.local: LocalTier | None = None
        self._saves = 0
        self._draining: set[str] = set()
        self._last_drain: concurrent.futures.Future[None] | None = None
        if local_tier is not None:
            self._set_up_tiers(normalize_path(local_tier))

    def _set_up_tiers(self, local_tier: str) -> None:
        import torch.distributed as dist

        if self.process_group is None and self.group.distributed:
            # The local commit, replication and drains run collectives on
            # background threads too: every collective of a tiered manager
            # goes to its own group.
            self.process_group = self._background_group()
            self.group = GroupView(self.process_group)
        self.local = LocalTier(local_tier, self.config, NodeMap.gather(self.group), self.group)
        # Drains run their collectives while later saves run theirs: a group of their own.
        self._drain_group = None
        if self.group.distributed:
            ranks = self.group.global_ranks() or list(range(dist.get_world_size()))
            self._drain_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        self._drains = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-drain")
        self._tier_steps = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_ext-tiers")

    # -- queries (any rank) ------------------------------------------------------------
    def committed(self) -> list[TagInfo]:
        """Committed partial checkpoints, oldest first."""
        return self.checkpoints.committed()

    def tags(self) -> list[str]:
        """Tags of the committed partial checkpoints, oldest first."""
        return [t.tag for t in self.committed()]

    def read_newest(self) -> str | None:
        """The tag named by ``newest`` if it is committed, else the newest committed
        tag (with a warning), else ``None``."""
        return self.checkpoints.newest()

    def partition(self, tag: str) -> Partition:
        """The partition record of a partial checkpoint."""
        store = self.checkpoints.partial_store(tag)
        return Partition.from_json(store.read_file(PARTITION_FILE), store.describe(PARTITION_FILE))

    # -- save -------------------------------------------------------------------------
    def wait(self) -> None:
        """(all ranks) Block until an asynchronous save in flight is done (or failed).

        Also runs at interpreter exit for every live manager, so a process
        that ends right after ``save(async_save=True)`` still commits that
        save and moves ``newest``.
        """
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as err:  # reported by that save's own handle
                log.warning("the previous asynchronous save failed: %s", err)

    def wait_for_persist(self) -> None:
        """(all ranks) :meth:`wait`, then wait for the drains to the persistent root (tiered saves)."""
        self.wait()
        self._wait_for_drains(forget=True)

    def _wait_for_drains(self, forget: bool = False) -> None:
        """(all ranks) Wait for the last drain to the root (its failure is its
        handle's); ``forget``: the manager no longer tracks it afterwards."""
        with self._lock:
            last = self._last_drain
            if forget:
                self._last_drain = None
        if last is not None:
            try:
                last.result()
            except BaseException as err:  # noqa: BLE001 - reported by that save's own handle
                log.warning("the last drain to %s failed: %s", self.root, err)

    def close(self) -> None:
        """(all ranks) Wait for a save (and drain) in flight, then free the
        staging buffers of the manager's own stager."""
        self.wait_for_persist()
        if self.local is not None:
            self._drains.shutdown(wait=True)
            self._tier_steps.shutdown(wait=True)
        if self.stager is not None and self._own_stager:
            self.stager.close()
            self.stager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def save(
        self,
        tag: str,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        user_content: Any = None,
        *,
        partial: bool = True,
        num_kept_partial_checkpoints: int | None = None,
        async_save: bool = False,
        overwrite: bool = False,
        full_format: str = "safetensors",
        include_optimizer: bool = False,
        retention: RetentionPolicy | None = None,
        persist: bool = False,
        translate_if_full: bool = True,
        translate_function: TranslateFunction | None = None,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        hf_config: dict[str, Any] | str | None = None,
    ) -> AsyncSaveHandle | None:
        """(all ranks) Save a checkpoint under ``tag``.

        Args:
            tag: The checkpoint's name (see :func:`dcp_ext.layout.validate_tag`).
            model: Plain, DDP, FSDP2 or tensor-parallel module (default: the
                one given to :func:`dcp_ext.register_model`, with its optimizer).
            optimizer: Its optimizer (partial checkpoints only, unless
                ``include_optimizer``).
            user_content: Extra state (see :mod:`dcp_ext.user_content`);
                the coordinator's value is stored.
            partial: ``True``: sharded ``{tag}_partial/`` for resuming;
                ``False``: one full model file ``ROOT/{tag}`` for inference.
            num_kept_partial_checkpoints: After this save commits, delete the
                oldest partial checkpoints beyond this many (``KeepLast(n)``).
            async_save: Return an :class:`~dcp_ext.AsyncSaveHandle` as soon
                as the state has been walked: wait on its
                ``staging_completion`` before changing the state; the handle
                (``result()``, ``upload_completion``) completes when the save
                committed, ``newest`` moved and retention ran. Its outcome,
                errors included, is the same on every rank. A save started
                while another is in flight first waits for that one.
            overwrite: Replace an existing checkpoint with this tag.
            full_format: ``"safetensors"`` or ``"torch"`` (one file
                ``ROOT/{tag}``), or ``"hf"``: a Hugging Face folder
                ``ROOT/{tag}/`` written by every rank at once
                (:func:`~dcp_ext.save_hf`).
            include_optimizer: Also put the optimizer state in a full checkpoint.
            retention: A :mod:`dcp_ext.retention` policy for this save
                (default: the manager's); not together with
                ``num_kept_partial_checkpoints``. With a local tier it
                applies to the persistent root.
            persist: With a local tier: drain this save to the root even if
                it is not a ``persist_every``-th one.
            translate_if_full: Full checkpoints: rename the keys with
                ``translate_function`` before writing (``False``: write the
                model's own keys). dcp_ext has no built-in translations (the
                SageMaker library's "supported models out of the box"), so
                without ``translate_function`` this changes nothing.
            translate_function: Full checkpoints: called with the list of all
                keys being saved, returns ``{model key: saved key}`` (keys
                absent keep their name, ``None`` leaves a key out), e.g. back
                to the original implementation's names. Not for partial saves.
            max_shard_size: ``full_format="hf"``: most bytes of tensor data per file.
            dtype: ``full_format="hf"``: cast floating tensors to this dtype.
            hf_config: ``full_format="hf"``: the ``config.json`` to write (dict or JSON string).

        Returns:
            The save's handle when ``async_save``, else ``None``.

        Raises:
            PostCommitError: (every rank) The checkpoint committed, but moving
                ``newest`` or retention failed.
        """
        validate_tag(tag)
        model, optimizer = with_registered(model, optimizer)
        if model is None and optimizer is None:
            raise ValueError(_NO_MODEL.format(call="save"))
        if partial and translate_function is not None:
            raise ValueError("translate_function applies to full checkpoints (partial=False) only")
        if num_kept_partial_checkpoints is not None and retention is not None:
            raise ValueError("pass num_kept_partial_checkpoints or retention, not both")
        policy = KeepLast(num_kept_partial_checkpoints) if num_kept_partial_checkpoints is not None else (
            retention or self.retention
        )
        encoded = None if user_content is None else encode_user_content(user_content)
        self.wait()  # one save at a time
        if not partial:
            if async_save:
                raise ValueError("async_save is only supported for partial checkpoints")
            if model is None:
                raise ValueError("a full checkpoint needs the model")
            state = _full_state(model, optimizer if include_optimizer else None)
            if translate_if_full and translate_function is not None:
                state = _translated(state, translate_function, f"full checkpoint {tag!r}")
            if full_format == "hf":
                self._save_hf(tag, state, encoded, overwrite, max_shard_size, dtype, hf_config)
                return None
            save_full(self.group, self.checkpoints.store, tag, state, fmt=full_format, user_content=encoded,
                      overwrite=overwrite, frame_size=self.config.frame_size)
            return None
        if self.local is not None:
            return self._save_tiered(tag, model, optimizer, encoded, policy, async_save, overwrite, persist)
        return self._save_partial(tag, model, optimizer, encoded, policy, async_save, overwrite)

    def _save_hf(
        self,
        tag: str,
        state: dict[str, Any],
        user_content: bytes | None,
        overwrite: bool,
        max_shard_size: int | str,
        dtype: torch.dtype | None,
        hf_config: dict[str, Any] | str | None,
    ) -> None:
        """(all ranks) ``state`` as the Hugging Face folder ``ROOT/{tag}/``; its
        user content, ``ROOT/user_content_{tag}``, is written just before the index."""
        from .hf_export import write_live_state

        self.group.run_on_coordinator(lambda: self._clear_full_file(tag, overwrite))
        store = self.checkpoints.store
        write_live_state(
            state, join_path(self.root, tag), max_shard_size=max_shard_size, dtype=dtype, config_json=hf_config,
            overwrite=overwrite, process_group=self.process_group, storage_options=self.storage_options,
            config=self.config, extra=None if user_content is None else (store, user_content_name(tag), user_content),
        )

    def _clear_full_file(self, tag: str, overwrite: bool) -> None:
        """(coordinator) Refuse, or with ``overwrite`` delete, a single-file
        full checkpoint ``ROOT/{tag}`` where a folder of that name is to go."""
        store = self.checkpoints.store
        if not store.exists(tag):
            return
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: the full checkpoint {store.describe(tag)}; pass overwrite=True",
                store.describe(tag),
            )
        self.checkpoints.delete(tag, partial=False)

    def _save_partial(
        self,
        tag: str,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        user_content: bytes | None,
        policy: RetentionPolicy | None,
        async_save: bool,
        overwrite: bool,
    ) -> AsyncSaveHandle | None:
        state = _app_state(model, optimizer)
        planner = LayoutSavePlanner(self.mesh, self.group.global_ranks(), key_prefixes=self.config.key_prefixes)
        # Both steps are picklable objects, not closures: a process-based
        # upload runs them in DCP's checkpoint process.
        incremental = self._incremental_save(tag) if self.incremental else None
        writer = CheckpointWriter(
            self.checkpoints.partial_url(tag), storage_options=self.storage_options,
            overwrite=overwrite, config=self.config, before_commit=_CommitFiles(user_content, planner),
            after_commit=_PostCommit(self.checkpoints, tag, policy), compression=self.compression,
            incremental=incremental,
        )
        try:
            if not async_save:
                run_save(state, writer, planner, self.process_group)
                return None
            if self.stager is None:
                self.stager = Stager(share_memory=self.async_uploads == "process")
            handle = start_async_save(state, writer, planner, self._background_group(), stager=self.stager,
                                      uploads=self.async_uploads)
        except BaseException:
            if incremental is not None:
                incremental.end_lease()  # the writer ends it on its own failures; this covers the rest
            raise
        with self._lock:
            self._pending = handle
        return handle

    def _incremental_save(self, tag: str) -> IncrementalSave:
        """(all ranks) The base of an incremental save of ``tag``: the tag
        ``newest`` names and its metadata document, read by the coordinator
        and broadcast (every rank compares with the same checkpoint, and
        storage serves one GET of the document, not one per rank). The
        coordinator's copy holds the root lease that pins the base until the
        save ends (:mod:`dcp_ext.leases`)."""
        leases: list[Lease] = []
        base, document = self.group.run_on_coordinator(lambda: self._incremental_base(tag, leases))
        if base is None or base == tag:  # never build on the checkpoint being replaced
            return IncrementalSave(max_chain=self.max_chain)
        return IncrementalSave(self.checkpoints.partial_url(base), partial_dir(base), base, self.max_chain, document,
                               lease=leases[0] if leases else None)

    def _incremental_base(self, tag: str, leases: list[Lease]) -> tuple[str | None, bytes | None]:
        """(coordinator) The base of the incremental save of ``tag`` and its
        metadata document, or ``(None, None)`` to write every frame.

        The base is the tag ``newest`` names; if that is not a valid,
        committed tag (an empty or damaged ``newest``), the newest committed
        one, with a warning, as :meth:`resume` does. Its lease is written
        before its save lock is checked and its metadata read, so that no
        deleter can remove what this save will refer to (appended to ``leases``).
        """
        checkpoints = self.checkpoints
        base = checkpoints.newest_record()
        if base is not None and not is_valid_tag(base):
            base = checkpoints.newest()  # warns
        for attempt in range(2):
            if base is None or base == tag:
                return None, None
            lease = Lease(checkpoints.url, tag, base, self.config, self.storage_options)
            lease.take()
            store = checkpoints.partial_store(base)
            try:
                state = lock_state(store)
                if state is not None and state.live:
                    log.info("incremental save of %s: writing every frame, since %s is being changed (%s)",
                             tag, base, state.reason)
                    lease.end()
                    return None, None
                document = store.read_file(METADATA_FILE)
                reason = restart_reason(read_incremental_section(document, store.describe(METADATA_FILE)))
            except CheckpointNotFoundError:
                lease.end()
                if attempt == 0:  # newest names a tag that is not committed: as resume does
                    base = checkpoints.newest()  # warns
                    continue
                return None, None
            except DcpExtError as err:
                # As read_base says it when a rank finds its base damaged.
                logging.getLogger("dcp_ext.incremental").warning(
                    "incremental save of %s: writing every frame, since its base %s is damaged or unreadable: %s",
                    tag, store.url, err)
                lease.end()
                return None, None
            except BaseException:
                lease.end()
                raise
            if reason is not None:
                log.info("incremental save: starting a new chain rather than building on %s: %s", base, reason)
                lease.end()
                return None, None
            leases.append(lease)
            return base, document
        return None, None

    def _background_group(self) -> Any:
        """(all ranks; collective the first time) The group for collectives
        that run on background threads (DCP's upload, tier steps): the
        caller's ``process_group``, else a gloo group of the manager's own,
        made on first use. Training runs its own collectives meanwhile; on
        the default group the two could interleave differently per rank."""
        if self.process_group is not None or not self.group.distributed:
            return self.process_group
        if self._own_group is None:
            import torch.distributed as dist

            self._own_group = dist.new_group(backend="gloo")
        return self._own_group

    def _save_tiered(
        self,
        tag: str,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        user_content: bytes | None,
        policy: RetentionPolicy | None,
        async_save: bool,
        overwrite: bool,
        persist: bool,
    ) -> AsyncSaveHandle | None:
        assert self.local is not None
        self._saves += 1
        persist = persist or (self.persist_every > 0 and self._saves % self.persist_every == 0)
        lacking = self.local.lacking_room(_state_nbytes(model, optimizer) + _SMALL_FILES_ALLOWANCE,
                                          self.local_tier_bytes, self.replicas)
        if lacking is not None:
            if self.incremental:
                # Its base is the root's newest: no drain may move it (or retire it) meanwhile.
                self._wait_for_drains()
            direct = self._save_partial(tag, model, optimizer, user_content, policy, async_save, overwrite)
            return self._report_full_tier(tag, lacking, direct)
        state = _app_state(model, optimizer)
        nodes = self.local.nodes
        planner = LayoutSavePlanner(
            self.mesh, self.group.global_ranks(), nodes=[nodes.node_of(r) for r in range(nodes.world_size)],
            partners=[nodes.partner_of(n) for n in range(nodes.node_count)] if self.replicas else (),
            replicated_apart=True, key_prefixes=self.config.key_prefixes,
        )
        writer = CheckpointWriter(
            self.local.partial_url(tag), overwrite=overwrite, config=self.config,
            before_commit=_CommitFiles(user_content, planner), compression=self.compression,
            # Incremental: a full local copy with each frame's hash, which the drain compares.
            incremental=IncrementalSave(max_chain=self.max_chain) if self.incremental else None,
        )
        if not async_save:
            run_save(state, writer, planner, self.process_group)
            self._after_local_save(tag, policy, persist, None)
            return None
        if self.async_uploads != "thread":
            raise ValueError("tiered saves upload in a thread (async_uploads='thread')")
        if self.stager is None:
            self.stager = Stager()
        upload = start_async_save(state, writer, planner, self.process_group, stager=self.stager)
        handle = AsyncSaveHandle(upload.staging_completion)
        persisted: concurrent.futures.Future[None] | None = concurrent.futures.Future() if persist else None
        handle.persist_completion = persisted

        def finish() -> None:
            try:
                upload.result()
                self._after_local_save(tag, policy, persist, persisted)
            except BaseException as err:  # noqa: BLE001 - the handle carries it
                handle.set_exception(err)
                if persisted is not None and not persisted.done():
                    persisted.set_exception(err)
                return
            handle.set_result(None)

        self._tier_steps.submit(finish)
        with self._lock:
            self._pending = handle
        return handle

    def _report_full_tier(self, tag: str, lacking: str, direct: AsyncSaveHandle | None) -> AsyncSaveHandle:
        """(all ranks) ``tag`` did not fit some node's tier and was saved
        straight to the root (``direct``: its handle, ``None`` once done
        synchronously): raise, or have the returned handle raise, the same
        :class:`StorageFullError` on every rank; the root save's own outcome
        is the handle's ``persist_completion``."""
        assert self.local is not None
        full = StorageFullError(
            f"checkpoint {tag!r} was not saved to the local tiers: {lacking}; it is saved straight to "
            f"{self.root} instead (free space in the local tier, lower keep_local, or raise local_tier_bytes)",
            self.local.path,
        )
        log.warning("%s", full)
        if direct is None:
            raise full
        handle = AsyncSaveHandle(direct.staging_completion)
        handle.persist_completion = direct
        direct.add_done_callback(lambda _: handle.set_exception(full))
        with self._lock:
            self._pending = handle
        return handle

    def _after_local_save(
        self,
        tag: str,
        policy: RetentionPolicy | None,
        persist: bool,
        persisted: concurrent.futures.Future[None] | None,
    ) -> None:
        """(all ranks, after the local-tier ``dcp.save`` returned on every rank)
        Commit ``tag`` on every node, move the nodes' ``newest``, apply local
        retention, and start the drain to the root if ``persist``."""
        assert self.local is not None
        self.local.spread_commit(tag)
        self.local.share_replicated(tag)
        if self.replicas:
            self.local.replicate(tag)
        with self._lock:
            protect = set(self._draining) | {tag}
            if persist:
                self._draining.add(tag)
        error = None
        try:
            self.local.after_local_commit(tag, self.keep_local, protect)
        except DcpExtError as err:
            error = str(err)
        try:
            raise_if_any(self.group, error, f"moving the local tier's newest to {tag!r} / local retention")
        except DcpExtError as err:
            with self._lock:
                self._draining.discard(tag)
            raise PostCommitError(f"checkpoint {tag!r} committed in the local tier, but {err}") from err
        if not persist:
            return
        drained = self._drains.submit(self._drain, tag, policy)
        if persisted is not None:
            drained.add_done_callback(lambda f: _copy_outcome(f, persisted))
        with self._lock:
            self._last_drain = drained

    def _drain(self, tag: str, policy: RetentionPolicy | None) -> None:
        assert self.local is not None
        try:
            drain(self.local, self.checkpoints, tag, GroupView(self._drain_group), policy,
                  max_chain=self.max_chain if self.incremental else None, storage_options=self.storage_options)
        except BaseException as err:
            log.warning("checkpoint %r stays in the local tier only: drain to %s failed: %s", tag, self.root, err)
            raise
        finally:
            with self._lock:
                self._draining.discard(tag)

    # -- resume -----------------------------------------------------------------------
    def resume(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        tag: str | None = None,
        partial: bool = True,
        strict: bool = True,
        allow_dtype_cast: bool = False,
        load_optimizer: bool = True,
        load_sharded_optimizer_state: bool = True,
        key_map: KeyMap | None = None,
        translate_function: TranslateFunction | None = None,
    ) -> ResumeResult:
        """(all ranks) Load a checkpoint into ``model`` / ``optimizer`` in place.

        Args:
            model: Plain, DDP, FSDP2 or tensor-parallel module (for full
                checkpoints it may be on the meta device). Default: the one
                given to :func:`dcp_ext.register_model`, with its optimizer.
            optimizer: Its optimizer (partial checkpoints).
            tag: Which checkpoint; ``None`` means the newest committed one.
            partial: Load ``{tag}_partial/`` (``True``) or the full file ``ROOT/{tag}``.
            strict: Refuse a checkpoint that lacks keys of the model/optimizer,
                or holds model/optimizer keys they do not have. Without an
                optimizer only the model is loaded (a selective load).
            allow_dtype_cast: Load tensors saved in another dtype by casting.
            load_optimizer: ``False``: load only the model from a partial
                checkpoint, even when an optimizer is passed or registered
                (it is left untouched).
            load_sharded_optimizer_state: Accepted for the SageMaker API;
                ``True`` and ``False`` load the same thing. Under DCP each rank
                always reads its own shard of the optimizer state, resharded to
                the current layout, so there is no separate "full optimizer
                state" load to choose.
            key_map: Full checkpoints: rename checkpoint keys to model keys
                (a callable, ``None`` skipping a key, or a dict; see
                :func:`dcp_ext.load_pretrained`).
            translate_function: Full checkpoints, SageMaker style: called
                with the list of all checkpoint keys, returns ``{checkpoint
                key: model key}`` (keys absent keep their name), e.g. from the
                original implementation's names to a tensor-parallel model's.

        The checkpoint may have been saved by any world size and parallel
        layout (resharding); when ``partition.json`` shows the same world size
        and mesh, each rank reads its own chunks without overlap computation.

        Raises:
            CheckpointNotFoundError: No such tag, or nothing committed under the root.
            CheckpointKeyError: Missing / unexpected keys (``strict``).
            ReshardError: A shape or dtype differs, or the layout cannot be filled.
        """
        if not isinstance(load_sharded_optimizer_state, bool):
            raise TypeError(f"load_sharded_optimizer_state must be a bool, got {load_sharded_optimizer_state!r}")
        if partial and (key_map is not None or translate_function is not None):
            raise ValueError(
                "key_map / translate_function apply to full checkpoints (partial=False); a partial "
                "checkpoint is loaded by the keys it was saved with"
            )
        model, optimizer = with_registered(model, optimizer)
        if not load_optimizer:
            optimizer = None
        if partial and self.local is not None:
            if model is None:
                raise ValueError(_NO_MODEL.format(call="resume"))
            return self._resume_tiered(tag, model, optimizer, strict, allow_dtype_cast)
        follow_newest = tag is None
        if tag is None:
            tag = self.group.run_on_coordinator(self._newest_or_raise)
        validate_tag(tag)
        if not partial:
            return self._resume_full(tag, model, strict, key_map, translate_function)
        if model is None:
            raise ValueError(_NO_MODEL.format(call="resume"))
        for attempt in range(_RESUME_ATTEMPTS):
            try:
                return self._resume_partial(tag, model, optimizer, strict, allow_dtype_cast)
            except (CheckpointNotFoundError, NotACheckpointError, CheckpointReplacedError) as err:
                # Retention of a concurrent save can delete the tag we are
                # reading (every rank sees the failure: DCP propagates it).
                # If newest has moved on, load that one instead.
                if not follow_newest or attempt == _RESUME_ATTEMPTS - 1:
                    raise
                newer = self.group.run_on_coordinator(self.read_newest)
                if newer is None or newer == tag:
                    raise
                log.warning("checkpoint %s disappeared while loading (%s); loading the newest, %s", tag, err, newer)
                tag = newer
        raise AssertionError("unreachable")

    def _resume_tiered(
        self,
        tag: str | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        allow_dtype_cast: bool,
    ) -> ResumeResult:
        """(all ranks) Restore the newest tag readable from the local tiers or the root (or ``tag``)."""
        assert self.local is not None
        if tag is not None:
            validate_tag(tag)
        inventories = self.local.gather_inventories()
        root = self.checkpoints

        def root_tags() -> tuple[list[TagInfo], str | None]:
            # The persistent tier being down must not stop a restore that the local tiers can serve.
            try:
                return (root.committed() if root.exists() else []), None
            except (DcpExtError, OSError) as err:
                return [], f"{type(err).__name__}: {err}"

        persisted, unreachable = self.group.run_on_coordinator(root_tags)
        if unreachable is not None:
            log.warning("cannot list the persistent root %s (%s); restoring from the local tiers only",
                        root.url, unreachable)
        plan = plan_restore(inventories, persisted, self.local.nodes, tag)
        if plan is None:
            where = f"the local tiers or {root.url}" + (f" (unreachable: {unreachable})" if unreachable else "")
            what = f"checkpoint {tag!r}" if tag is not None else "committed checkpoint"
            raise CheckpointNotFoundError(f"no {what} readable from {where}", root.url)
        # A root copy written by an incremental drain refers to other tags'
        # files: its data files are not the local ones, so the two copies are
        # never mixed file by file (dcp_ext.incremental_drain).
        apart = plan.in_root and self.group.run_on_coordinator(lambda: _root_refers(root, plan.tag))
        if plan.fetches:
            self.local.heal(plan, inventories)
        sources: list[tuple[str, Store]] = []
        if self.local.node in plan.local_nodes | plan.healed_nodes and not (apart and not plan.local_complete):
            sources.append(("local", self.local.checkpoints.partial_store(plan.tag)))
        if plan.in_root and not (apart and sources):
            sources.append(("root", root.partial_store(plan.tag)))
        store = TieredStore(sources)
        self.last_restore_plan = plan
        # Each node reads the files in its own tier; read-once could make a
        # rank owner of bytes only another node holds locally, so it is off.
        reader = CheckpointReader(store.describe(), storage_options=self.storage_options, config=self.config, store=store,
                                  read_once=False)
        if not apart:
            return self._resume_partial(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)
        failure: Exception | None = None
        try:
            result = self._resume_partial(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)
        except Exception as err:  # noqa: BLE001 - decided on every rank alike below
            failure = err
        damaged = self.group.all_gather(isinstance(failure, (CheckpointCorruptError, CheckpointNotFoundError))
                                        and sources[0][0] == "local")
        if not any(damaged):
            if failure is not None:
                raise failure
            return result
        # A damaged (or vanished) local copy: the whole tag again from the root.
        log.warning("the local copy of %s cannot be read (%s); loading it from %s", plan.tag,
                    failure or "on another node", root.url)
        store = TieredStore([("root", root.partial_store(plan.tag))])
        reader = CheckpointReader(store.describe(), storage_options=self.storage_options, config=self.config, store=store,
                                  read_once=False)
        return self._resume_partial(plan.tag, model, optimizer, strict, allow_dtype_cast, reader)

    def _newest_or_raise(self) -> str:
        newest = self.read_newest()
        if newest is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {self.checkpoints.store.url}: nothing to resume from",
                self.checkpoints.store.url,
            )
        return newest

    def _resume_partial(
        self,
        tag: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        allow_dtype_cast: bool,
        reader: CheckpointReader | None = None,
    ) -> ResumeResult:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if reader is None:
            reader = CheckpointReader(self.checkpoints.partial_url(tag), storage_options=self.storage_options,
                                      config=self.config, process_group=self.group.group)
        state = _app_state(model, optimizer)

        def small_files() -> tuple[bytes | None, bytes | None]:
            # Read by the coordinator before the data and shared, so that a
            # tag deleted meanwhile fails on every rank alike. A checkpoint
            # written by torch's own writers has its .metadata only.
            if not reader.store.exists(METADATA_FILE) and not reader.store.exists(TORCH_METADATA_FILE):
                raise reader.missing_metadata_error()
            return _read_optional(reader.store, PARTITION_FILE), _read_optional(reader.store, USER_CONTENT_FILE)

        partition_raw, user_content_raw = self.group.run_on_coordinator(small_files)
        partition = (
            None if partition_raw is None
            else Partition.from_json(partition_raw, reader.store.describe(PARTITION_FILE))
        )
        # A parameter that had no gradient when the checkpoint was saved has
        # no optimizer state in it; get_state_dict has made some here.
        per_param = state.get("optimizer", {}).get("state", {})
        planner = LayoutLoadPlanner(
            strict, allow_dtype_cast=allow_dtype_cast, partition=partition, world_size=self.group.world_size,
            mesh=self.mesh, optional_prefixes=[f"optimizer.state.{fqn}." for fqn in per_param],
        )
        self.last_load_planner = planner
        self.last_reader = reader
        run_load(state, reader, planner, self.process_group)
        for prefix in planner.absent_prefixes:
            # As when it was saved: no state until the parameter's first step.
            del per_param[prefix[len("optimizer.state."):-1]]
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        if optimizer is not None:
            # Not strict where parameters were left without state: torch would refuse them.
            set_optimizer_state_dict(model, optimizer, state["optimizer"],
                                     options=StateDictOptions(strict=strict and not planner.absent_prefixes))
        user_content = (
            None if user_content_raw is None
            else decode_user_content(user_content_raw, reader.store.describe(USER_CONTENT_FILE))
        )
        return ResumeResult(tag, user_content, True)

    def _resume_full(
        self,
        tag: str,
        model: nn.Module | None,
        strict: bool,
        key_map: KeyMap | None = None,
        translate_function: TranslateFunction | None = None,
    ) -> ResumeResult:
        if model is None:
            raise ValueError(_NO_MODEL.format(call="resume from a full checkpoint"))
        store = self.checkpoints.store
        if not store.exists(tag) and not store.exists(f"{tag}/{HF_INDEX_FILE}"):
            raise CheckpointNotFoundError(
                f"no full checkpoint {store.describe(tag)}; saved tags with partial=False live at ROOT/<tag>",
                store.describe(tag),
            )
        load_pretrained(
            model, join_path(self.root, tag), strict=strict, key_map=key_map, translate_function=translate_function,
            storage_options=self.storage_options, process_group=self.process_group, config=self.config,
        )
        raw = _read_optional(store, user_content_name(tag))
        content = None if raw is None else decode_user_content(raw, store.describe(user_content_name(tag)))
        return ResumeResult(tag, content, False)

    # -- maintenance (coordinator or a single process) -------------------------------
    def delete(self, tag: str, *, partial: bool = True, full: bool = True) -> None:
        """Delete a checkpoint's files written by dcp_ext (nothing else).

        Raises:
            ValueError: ``tag`` is the target of ``newest`` (partial).
        """
        self.checkpoints.delete(tag, partial=partial, full=full)

    def compact(self, tag: str) -> CompactReport:
        """(one process, e.g. the coordinator) Rewrite the incremental
        checkpoint ``tag`` self-contained: the frames it refers to in earlier
        checkpoints' files are copied into new files of its own (see
        :mod:`dcp_ext.compact`). Earlier checkpoints' files that nothing
        refers to any more are then removed. Safe while other jobs save to
        the root (:meth:`dcp_ext.root.CheckpointRoot.compact`).

        Returns:
            What was rewritten (nothing for a checkpoint that refers to no other).

        Raises:
            CheckpointInUseError: A save to ``tag``, or one that builds on it, is in progress.
        """
        validate_tag(tag)
        self.wait()
        report: CompactReport = self.checkpoints.compact(tag)
        return report

    def export(
        self,
        tag: str,
        *,
        out: str | None = None,
        full_format: str = "safetensors",
        include_optimizer: bool = False,
        overwrite: bool = False,
        progress: Callable[[int, int], None] | None = None,
        max_shard_size: int | str = "5GB",
        dtype: torch.dtype | None = None,
        hf_config: dict[str, Any] | str | None = None,
    ) -> str:
        """Write a full checkpoint from a partial one, one tensor in memory at a time.

        Runs in one process (no process group needed); reads each tensor's
        chunks with ranged reads and streams it into the output. With
        ``full_format="hf"`` (a Hugging Face folder, :func:`~dcp_ext.export_hf`)
        it is collective over the manager's group when ``torch.distributed``
        is initialized: every rank writes its share of the files.

        Args:
            tag: The partial checkpoint.
            out: Output tag under the root (default: ``tag``), or a path/URL
                containing ``/``.
            full_format: ``"safetensors"`` or ``"torch"`` (one file), or
                ``"hf"`` (a folder: ``ROOT/{out or tag}/`` or the path ``out``).
            include_optimizer: Also export the optimizer's tensors.
            overwrite: Replace an existing output.
            progress: Called as ``progress(bytes_done, bytes_total)`` as
                tensors are written (the CLI draws its progress bar with it;
                with ``"hf"``, this rank's bytes).
            max_shard_size: ``"hf"``: most bytes of tensor data per file.
            dtype: ``"hf"``: cast floating tensors to this dtype.
            hf_config: ``"hf"``: the ``config.json`` to write (dict or JSON string).

        Returns:
            Where the full checkpoint was written.
        """
        validate_tag(tag)
        if full_format == "hf":
            return self._export_hf(tag, out, include_optimizer, overwrite, progress, max_shard_size, dtype, hf_config)
        from .export import export_partial

        root_store = self.checkpoints.store
        if out is None or "/" not in out:
            target_store, target_name = root_store, validate_tag(out or tag)
        else:
            parent, _, target_name = normalize_path(out).rstrip("/").rpartition("/")
            target_store = open_store(parent, self.config, self.storage_options)
        if target_store.exists(target_name) and not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {target_store.describe(target_name)}; pass overwrite=True", target_store.describe(target_name)
            )
        export_partial(self.checkpoints.partial_url(tag), target_store, target_name, full_format=full_format,
                       include_optimizer=include_optimizer, storage_options=self.storage_options,
                       config=self.config, progress=progress)
        content = _read_optional(self.checkpoints.partial_store(tag), USER_CONTENT_FILE)
        if content is not None and target_store is root_store:
            root_store.write_file(user_content_name(target_name), content)
        return target_store.describe(target_name)

    def _export_hf(
        self,
        tag: str,
        out: str | None,
        include_optimizer: bool,
        overwrite: bool,
        progress: Callable[[int, int], None] | None,
        max_shard_size: int | str,
        dtype: torch.dtype | None,
        hf_config: dict[str, Any] | str | None,
    ) -> str:
        """(all ranks, or one process) :meth:`export` to a Hugging Face folder."""
        from .hf_export import write_partial

        extra = None
        if out is None or "/" not in out:
            name = validate_tag(out or tag)
            folder = join_path(self.root, name)
            self.group.run_on_coordinator(lambda: self._clear_full_file(name, overwrite))
            content = self.group.run_on_coordinator(
                lambda: _read_optional(self.checkpoints.partial_store(tag), USER_CONTENT_FILE))
            if content is not None:
                extra = (self.checkpoints.store, user_content_name(name), content)
        else:
            folder = normalize_path(out)
        write_partial(
            self.checkpoints.partial_url(tag), folder, include_optimizer=include_optimizer,
            max_shard_size=max_shard_size, dtype=dtype, config_json=hf_config, overwrite=overwrite,
            process_group=self.process_group, storage_options=self.storage_options, config=self.config,
            extra=extra, progress=progress,
        )
        return folder


@dataclass(frozen=True)
class _CommitFiles:
    """(coordinator, the writer's ``before_commit``) Write ``user_content`` and ``partition.json``."""

    user_content: bytes | None
    planner: LayoutSavePlanner

    def __call__(self, store: Store) -> None:
        if self.user_content is not None:
            store.write_file(USER_CONTENT_FILE, self.user_content)
        if self.planner.partition is not None:
            store.write_file(PARTITION_FILE, self.planner.partition.to_json())


@dataclass(frozen=True)
class _PostCommit:
    """(coordinator, the writer's ``after_commit``) Move ``newest``, apply retention, tidy."""

    checkpoints: CheckpointRoot
    tag: str
    policy: RetentionPolicy | None

    def __call__(self) -> None:
        tag = self.tag
        try:
            self.checkpoints.set_newest(tag)
        except DcpExtError as err:
            raise PostCommitError(f"checkpoint {tag!r} committed, but updating newest failed: {err}") from err
        if self.policy is not None:
            try:
                self.checkpoints.apply_retention(self.policy, protect={tag})
            except DcpExtError as err:
                raise PostCommitError(f"checkpoint {tag!r} committed, but retention failed: {err}") from err
        try:
            self.checkpoints.remove_leftovers(current=tag)
        except DcpExtError as err:  # the checkpoint is committed; this is tidying
            log.warning("could not remove leftovers under %s: %s", self.checkpoints.url, err)


# Managers with a save possibly in flight; each is waited for at exit, so a
# committed save always gets its ``newest`` before the process ends.
_LIVE_MANAGERS: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()


@atexit.register
def _wait_for_saves_in_flight() -> None:
    for manager in list(_LIVE_MANAGERS):
        manager.wait_for_persist()


def _copy_outcome(source: concurrent.futures.Future[None], target: concurrent.futures.Future[None]) -> None:
    """Give ``target`` the outcome of the finished ``source``."""
    error = source.exception()
    if error is None:
        target.set_result(None)
    else:
        target.set_exception(error)


#: Bytes a rank may write beside its tensors in one save (headers, metadata, partition).
_SMALL_FILES_ALLOWANCE = 1 << 20


def _state_nbytes(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of this rank's shards of the model's and optimizer's tensors:
    what a save writes at most (uncompressed)."""
    seen: set[int] = set()
    total = 0

    def add(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()

    if model is not None:
        for value in itertools.chain(model.parameters(), model.buffers()):
            add(value)
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                add(value)
    return total


def _app_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` state dicts as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if model is None:
        raise ValueError("a model is needed to name the optimizer's state")
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's state dict, plus the optimizer's tensors under flattened ``optimizer.`` keys."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from ._compat import flatten_state_dict

    state = dict(get_model_state_dict(model))
    if optimizer is not None:
        flat, _ = flatten_state_dict({"optimizer": get_optimizer_state_dict(model, optimizer)})
        state.update({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
    return state


def _translated(state: dict[str, Any], translate_function: TranslateFunction, where: str) -> dict[str, Any]:
    """``state`` with its keys renamed by ``translate_function`` (``None`` leaves a key out)."""
    names = rename_keys(list(state), translate_function=translate_function, where=where)
    return {names[key]: value for key, value in state.items() if key in names}


_NO_MODEL = (
    "{call} needs the model: pass model=, or call dcp_ext.register_model(model, optimizer) once on every "
    "rank after sharding it (the SageMaker library finds its DistributedModel the same way)"
)


def _root_refers(root: CheckpointRoot, tag: str) -> bool:
    """(coordinator) Whether the root's copy of ``tag`` refers to other
    checkpoints' files (an incremental drain's): ``False`` if unreadable."""
    store = root.partial_store(tag)
    try:
        return refers_elsewhere(store.read_file(METADATA_FILE), store.describe(METADATA_FILE))
    except (DcpExtError, OSError):
        return False




def _read_optional(store: Store, name: str) -> bytes | None:
    try:
        return store.read_file(name)
    except CheckpointNotFoundError:
        return None


# -- SageMaker-style functions ------------------------------------------------------
def save_checkpoint(
    path: str | os.PathLike[str],
    tag: str,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    user_content: Any = None,
    partial: bool = True,
    num_kept_partial_checkpoints: int | None = None,
    async_save: bool = False,
    storage_options: dict[str, Any] | None = None,
    translate_if_full: bool = True,
    translate_function: TranslateFunction | None = None,
    **kwargs: Any,
) -> AsyncSaveHandle | None:
    """(all ranks) ``smp.save_checkpoint`` on DCP; see :meth:`CheckpointManager.save`.

    Without ``model``, the model given to :func:`dcp_ext.register_model` is
    saved (with its optimizer unless ``optimizer`` is passed).
    ``translate_if_full`` / ``translate_function``: full saves rename keys
    before writing (dcp_ext has no built-in translations: without a
    ``translate_function``, ``translate_if_full`` changes nothing).

    Extra keyword arguments: ``process_group``, ``mesh``, ``config``,
    ``compression``, ``async_uploads``, ``local_tier``, ``persist_every``,
    ``keep_local``, ``replicas``, ``local_tier_bytes``, ``incremental``, ``max_chain``
    (for the manager) and ``overwrite``,
    ``full_format``, ``include_optimizer``, ``retention``, ``persist``.

    Calls with the same root and manager arguments share one manager for the
    life of the process, so that a save waits for the asynchronous one in
    flight (two saves must never run DCP's collectives at once) and
    asynchronous saves reuse its staging buffers. :func:`close_checkpoints`
    waits for them and frees the buffers.
    """
    manager_args = {
        k: kwargs.pop(k) for k in _MANAGER_ARGS if k in kwargs
    }
    manager = _shared_manager(path, storage_options, manager_args)
    return manager.save(
        tag, model, optimizer, user_content, partial=partial,
        num_kept_partial_checkpoints=num_kept_partial_checkpoints, async_save=async_save,
        translate_if_full=translate_if_full, translate_function=translate_function, **kwargs,
    )


_MANAGER_ARGS = ("process_group", "mesh", "config", "compression", "async_uploads", "local_tier", "persist_every",
                 "keep_local", "replicas", "local_tier_bytes", "incremental", "max_chain")

# Managers of save_checkpoint(), by root and manager arguments (see there).
_SHARED_MANAGERS: dict[tuple[Any, ...], CheckpointManager] = {}


def _shared_manager(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None, manager_args: dict[str, Any]
) -> CheckpointManager:
    def identity(value: Any) -> Any:
        # Process groups, meshes and codecs by identity: the cached manager
        # holds them, so their ids cannot be reused while it exists.
        return value if isinstance(value, (str, int, float, bool, type(None), IOConfig)) else ("id", id(value))

    key = (
        normalize_path(path),
        repr(sorted((storage_options or {}).items())),
        tuple(sorted((k, identity(v)) for k, v in manager_args.items())),
    )
    manager = _SHARED_MANAGERS.get(key)
    if manager is None:
        manager = _SHARED_MANAGERS[key] = CheckpointManager(path, storage_options=storage_options, **manager_args)
    return manager


def close_checkpoints() -> None:
    """(all ranks) Wait for the saves in flight of :func:`save_checkpoint` and free their staging buffers."""
    while _SHARED_MANAGERS:
        _, manager = _SHARED_MANAGERS.popitem()
        manager.close()


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    allow_dtype_cast: bool = False,
    load_optimizer: bool = True,
    load_sharded_optimizer_state: bool = True,
    translate_function: TranslateFunction | None = None,
    key_map: KeyMap | None = None,
    **kwargs: Any,
) -> ResumeResult:
    """(all ranks) ``smp.resume_from_checkpoint`` on DCP; see :meth:`CheckpointManager.resume`.

    Without ``model``, the model given to :func:`dcp_ext.register_model` is
    loaded (with its optimizer unless ``optimizer`` is passed), so the
    SageMaker fine-tuning call ``resume_from_checkpoint(model_dir,
    tag="fullmodel.pt", partial=False)`` works as written once the model is
    registered. ``load_optimizer=False`` loads the model only;
    ``load_sharded_optimizer_state`` is accepted and changes nothing (each
    rank always reads its shard, resharded); ``translate_function`` /
    ``key_map`` rename keys of full checkpoints.

    Returns:
        The tag loaded and its ``user_content``.
    """
    manager = CheckpointManager(path, storage_options=storage_options, **kwargs)
    return manager.resume(
        model, optimizer, tag=tag, partial=partial, strict=strict, allow_dtype_cast=allow_dtype_cast,
        load_optimizer=load_optimizer, load_sharded_optimizer_state=load_sharded_optimizer_state,
        key_map=key_map, translate_function=translate_function,
    )
