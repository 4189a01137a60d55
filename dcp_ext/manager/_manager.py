"""``CheckpointManager``: partial and full checkpoints under one root, SageMaker style (a facade).

The manager checks each call and hands it to one part, each with one job:
partial checkpoints in the root (:mod:`._partial`: saves, incremental bases,
resumes), tiered ones, made only when ``local_tier`` is given
(:mod:`._tiered`), full single-file and Hugging Face ones (:mod:`._full`),
and the save in flight with its stager and exit hook (:mod:`._in_flight`).
The root's tags, ``newest``, retention and deletion by the one rule are
:mod:`dcp_ext.root`'s. The order of a partial save is in :mod:`._partial`.

An asynchronous save (``async_save=True``) stops the caller only while the
state is walked; the manager's :class:`~dcp_ext.Stager` copies it into
reused buffers in the background, and the upload runs in a thread or, with
``async_uploads="process"``, in DCP's checkpoint process. The returned
:class:`~dcp_ext.AsyncSaveHandle` has DCP's two futures:
``staging_completion`` (wait before changing the state) and
``upload_completion`` (committed, ``newest`` moved, retention done).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import IOConfig
from ..dcp_io import AsyncSaveHandle, CheckpointReader, Stager
from ..format import Codec, encode_user_content, resolve_codec
from ..full import KeyMap, TranslateFunction, translate_state
from ..incremental import DEFAULT_MAX_CHAIN
from ..layout import PARTITION_FILE, MeshInfo, Partition, TagInfo, validate_tag
from ..planners import LayoutLoadPlanner
from ..planning import RankStateRule, encode_rank_state
from ..root import CheckpointRoot, CompactReport, KeepLast, RetentionPolicy
from ..storage import Location
from ..tiers import LocalTier, RestorePlan
from ._context import Groups, ManagerContext
from ._full import FullCheckpoints, full_state
from ._in_flight import InFlight, watch_at_exit
from ._options import ASYNC_UPLOADS, FullSaveOptions, IncrementalOptions, TierOptions
from ._partial import PartialCheckpoints
from ._registry import with_registered
from ._requests import NO_MODEL, ResumeResult, SaveRequest
from ._tiered import TieredCheckpoints

__all__ = ["CheckpointManager"]


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
        retention: Default :mod:`dcp_ext.root._retention` policy applied after each
            partial save (``None``: keep everything unless a save says otherwise).
        async_uploads: Where an asynchronous save's upload runs: ``"thread"``
            (default) or ``"process"`` (DCP's checkpoint process, one per
            rank, started on the first such save; the upload's Python work
            then does not compete with training for the GIL). With
            ``"process"``, retention policies must pickle (no lambdas).
        stager: The :class:`~dcp_ext.dcp_io.Stager` for asynchronous saves
            (default: one made on the first, with background staging); its
            buffers hold one copy of the state per rank until :meth:`close`.
        local_tier: This node's local-tier directory (NVMe, ``/dev/shm``;
            each rank passes its own node's path): partial saves commit
            there first and reach ``root`` only when persisted (see
            :mod:`dcp_ext.tiers._local_tier`). Which ranks share a node:
            :mod:`dcp_ext._runtime.nodes` (``DCP_EXT_NODE_RANK`` overrides). Creating
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
            tier may hold (the node leader's value counts). A save that does
            not fit in some node's tier (this cap or its free space) goes
            straight to ``root``, and raises
            :class:`~dcp_ext.errors.StorageFullError` naming the node.
        incremental: ``True`` (or an :class:`~dcp_ext.IncrementalOptions`):
            partial saves write only the frames that changed since
            the newest checkpoint (:mod:`dcp_ext.incremental._save`): unchanged
            frames (frozen weights, untouched embedding rows) are referred
            to in the earlier checkpoint's files. Off by default. Retention
            and deletion keep every file a kept checkpoint refers to. With
            ``local_tier``, the local tiers hold full copies (with frame
            hashes) and each drain writes to ``root`` only the frames that
            differ from the root's newest checkpoint
            (:mod:`dcp_ext.tiers._incremental_drain`).
        max_chain: With ``incremental``: after this many incremental saves
            in a row, a save writes every frame again (a checkpoint needs
            the files of at most ``max_chain + 1`` saves); earlier when most
            bytes its base refers to are dead
            (:func:`~dcp_ext.incremental.restart_reason`).
        tiers: The five tier settings above as one :class:`~dcp_ext.TierOptions`.

    Attributes:
        checkpoints: The :class:`~dcp_ext.root.CheckpointRoot` (tags, ``newest``, deletion).
        last_load_planner: The planner of the last partial resume (fast-path and key reports).
        last_reader: Its reader; ``last_reader.store.stats`` has the bytes and files read.
        last_restore_plan: With ``local_tier``: where the last resume read its tag from.
        local: With ``local_tier``: this node's :class:`~dcp_ext.tiers.LocalTier` (``None`` without).
        stager: The stager of asynchronous saves (``None`` until the first one, or after :meth:`close`).
        group: The process group the manager saves and loads with, as a view.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Location,
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
        incremental: bool | IncrementalOptions = False,
        max_chain: int = DEFAULT_MAX_CHAIN,
        tiers: TierOptions | None = None,
    ) -> None:
        if async_uploads not in ASYNC_UPLOADS:
            raise ValueError(f"async_uploads must be 'thread' or 'process', got {async_uploads!r}")
        tier_options = TierOptions.given(tiers, local_tier, persist_every, keep_local, replicas, local_tier_bytes)
        self.incremental_options = IncrementalOptions.given(incremental, max_chain)
        """Whether partial saves are incremental, and the longest chain (from ``incremental=``
        and ``max_chain=``)."""
        location = Location.of(root, storage_options, config)
        self.root = location.url
        self.retention = retention
        self.async_uploads = async_uploads
        groups = Groups(process_group, location.config.collective_timeout)
        if tier_options.local_tier is not None:
            groups = groups.for_tiers()
        self.checkpoints = CheckpointRoot(location)
        self._ctx = ManagerContext(
            location, groups, MeshInfo.from_device_mesh(mesh) if mesh is not None else None,
            resolve_codec(compression), self.checkpoints,
        )
        self.storage_options, self.config = location.storage_options, location.config
        self.compression = self._ctx.compression
        self.process_group, self.group = groups.process_group, groups.view
        self._in_flight = InFlight(stager)
        self._partial = PartialCheckpoints(self._ctx, self._in_flight, self.incremental_options, async_uploads)
        self._full = FullCheckpoints(self._ctx)
        self._tiered = None if tier_options.local_tier is None else TieredCheckpoints(
            self._ctx, self._in_flight, self._partial, tier_options, self.incremental_options, async_uploads)
        watch_at_exit(self)

    # -- what the parts hold ---------------------------------------------------------
    @property
    def stager(self) -> Stager | None:
        return self._in_flight.stager

    @property
    def local(self) -> LocalTier | None:
        return None if self._tiered is None else self._tiered.local

    @property
    def last_load_planner(self) -> LayoutLoadPlanner | None:
        return self._partial.last_load_planner

    @property
    def last_reader(self) -> CheckpointReader | None:
        return self._partial.last_reader

    @property
    def last_restore_plan(self) -> RestorePlan | None:
        return None if self._tiered is None else self._tiered.last_restore_plan

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

    # -- saves in flight ---------------------------------------------------------------
    def wait(self) -> None:
        """(all ranks) Block until an asynchronous save in flight is done (or failed).

        Also runs at interpreter exit for every live manager, so a process
        that ends right after ``save(async_save=True)`` still commits that
        save and moves ``newest``.
        """
        self._in_flight.wait()

    def wait_for_persist(self) -> None:
        """(all ranks) :meth:`wait`, then wait for the drains to the persistent root (tiered saves)."""
        self.wait()
        if self._tiered is not None:
            self._tiered.wait_for_drains(forget=True)

    def close(self) -> None:
        """(all ranks) Wait for a save (and drain) in flight, then free the
        staging buffers of the manager's own stager."""
        self.wait_for_persist()
        if self._tiered is not None:
            self._tiered.close()
        self._in_flight.close()

    def __enter__(self) -> CheckpointManager:
        """The manager itself: ``with CheckpointManager(...) as manager:`` closes it at the end."""
        return self

    def __exit__(self, *exc: object) -> None:
        """(all ranks) :meth:`close`: wait for saves in flight, then free the manager's
        resources."""
        self.close()

    # -- save -------------------------------------------------------------------------
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
        full: FullSaveOptions | None = None,
        rank_state: Any = None,
    ) -> AsyncSaveHandle | None:
        """(all ranks) Save a checkpoint under ``tag``.

        Args:
            tag: The checkpoint's name (see :func:`dcp_ext.layout.validate_tag`).
            model: Plain, DDP, FSDP2 or tensor-parallel module (default: the
                one given to :func:`dcp_ext.register_model`, with its optimizer).
            optimizer: Its optimizer (partial checkpoints only, unless
                ``include_optimizer``).
            user_content: Extra state (see :mod:`dcp_ext.format._user_content`);
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
            retention: A :mod:`dcp_ext.root._retention` policy for this save
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
            translate_function: Full checkpoints, SageMaker's state-dict
                translation: called with the state dict being saved
                (``{key: tensor}``), returns the state dict to write (keys
                renamed, tensors split or transposed), e.g. back to the
                original implementation's layout. Not for partial saves.
            max_shard_size: ``full_format="hf"``: most bytes of tensor data per file.
            dtype: ``full_format="hf"``: cast floating tensors to this dtype.
            hf_config: ``full_format="hf"``: the ``config.json`` to write (dict or JSON string).
            full: The seven full-save settings above, as one :class:`~dcp_ext.FullSaveOptions`.
            rank_state: This rank's own state (dataloader position, RNG states; the types of
                ``user_content``), for :meth:`resume`. Partial saves without ``local_tier`` only.

        Returns:
            The save's handle when ``async_save``, else ``None``.

        Raises:
            PostCommitError: (every rank) The checkpoint committed, but moving
                ``newest`` or retention failed.
        """
        validate_tag(tag)
        full = FullSaveOptions.given(full, full_format, include_optimizer, translate_if_full, translate_function,
                                     max_shard_size, dtype, hf_config)
        model, optimizer = with_registered(model, optimizer)
        if model is None and optimizer is None:
            raise ValueError(NO_MODEL.format(call="save"))
        policy = _save_policy(partial, full, num_kept_partial_checkpoints, retention, self.retention)
        encoded = None if user_content is None else encode_user_content(user_content)
        rank_bytes = _rank_state_bytes(rank_state, partial, self._tiered is not None)
        self.wait()  # one save at a time
        if not partial:
            if async_save:
                raise ValueError("async_save is only supported for partial checkpoints")
            if model is None:
                raise ValueError("a full checkpoint needs the model")
            state = full_state(model, optimizer if full.include_optimizer else None)
            if full.translate_if_full and full.translate_function is not None:
                state = translate_state(state, full.translate_function, f"full checkpoint {tag!r}")
            self._full.save(tag, state, encoded, full_format=full.full_format, overwrite=overwrite,
                            max_shard_size=full.max_shard_size, dtype=full.dtype, hf_config=full.hf_config)
            return None
        request = SaveRequest(tag, model, optimizer, encoded, policy, async_save, overwrite, persist, rank_bytes)
        if self._tiered is not None:
            return self._tiered.save(request)
        return self._partial.save(request)

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
        rank_state_rule: RankStateRule | None = None,
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
                (a callable, ``None`` skipping a key, a dict, or a
                :class:`~dcp_ext.KeyList` given all keys at once: SageMaker's
                key-list form; see :func:`dcp_ext.load_pretrained`). Each rank
                still reads only its slices.
            translate_function: Full checkpoints, SageMaker's state-dict
                translation: called with the checkpoint's state dict
                (``{key: tensor}``, every tensor whole), returns the state dict
                to load (keys renamed, tensors fused or transposed), e.g. from
                the original implementation's layout to a tensor-parallel
                model's (see :func:`~dcp_ext.load_pretrained`).
            rank_state_rule: How to carry a saved ``rank_state`` to another world size ``M``: ``rule(states,
                M)`` -> ``M`` states, or :func:`~dcp_ext.redistribute_dataloader` (default: refuse).

        The checkpoint may have been saved by any world size and parallel
        layout (resharding); when ``partition.json`` shows the same world size
        and mesh, each rank reads its own chunks without overlap computation.

        Raises:
            CheckpointNotFoundError: No such tag, or nothing committed under the root.
            CheckpointKeyError: Missing / unexpected keys (``strict``).
            ReshardError: A shape or dtype differs, or the layout cannot be filled.
            RankStateMismatchError: ``rank_state`` of another world size and no ``rank_state_rule``.
        """
        _check_resume(partial, self._tiered is not None, key_map, translate_function, load_sharded_optimizer_state,
                      rank_state_rule)
        model, optimizer = with_registered(model, optimizer)
        if not load_optimizer:
            optimizer = None
        if not partial:
            if tag is None:
                tag = self.group.run_on_coordinator(self._partial.newest_or_raise)
            return self._full.resume(validate_tag(tag), model, strict, key_map, translate_function)
        if model is None:
            raise ValueError(NO_MODEL.format(call="resume"))
        if self._tiered is not None:
            return self._tiered.resume(tag, model, optimizer, strict, allow_dtype_cast)
        return self._partial.resume(tag, model, optimizer, strict, allow_dtype_cast, rank_state_rule)

    # -- maintenance (coordinator or a single process) -------------------------------
    def delete(self, tag: str, *, partial: bool = True, full: bool = True) -> None:
        """Delete a checkpoint's files written by dcp_ext, by the root's one
        rule (:meth:`dcp_ext.root.CheckpointRoot.delete`, which says what it raises)."""
        self.checkpoints.delete(tag, partial=partial, full=full)

    def compact(self, tag: str) -> CompactReport:
        """(one process, e.g. the coordinator) Rewrite the incremental
        checkpoint ``tag`` self-contained: the frames it refers to in earlier
        checkpoints' files are copied into new files of its own (see
        :func:`dcp_ext.root.compact`). Earlier checkpoints' files that nothing
        refers to any more are then removed. Safe while other jobs save to
        the root (:meth:`dcp_ext.root.CheckpointRoot.compact`).

        Returns:
            What was rewritten (nothing for a checkpoint that refers to no other).

        Raises:
            CheckpointInUseError: A save to ``tag``, or one that builds on it, is in progress.
        """
        validate_tag(tag)
        self.wait()
        return self.checkpoints.compact(tag)

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
            return self._full.export_hf(tag, out, include_optimizer, overwrite, progress, max_shard_size, dtype, hf_config)
        return self._full.export(tag, out, full_format, include_optimizer, overwrite, progress)


def _save_policy(partial: bool, full: FullSaveOptions, num_kept: int | None, retention: RetentionPolicy | None,
                 default: RetentionPolicy | None) -> RetentionPolicy | None:
    """(each rank) ``save``'s option checks; the retention policy to apply after its commit."""
    if partial and full.translate_function is not None:
        raise ValueError("translate_function applies to full checkpoints (partial=False) only")
    if num_kept is not None and retention is not None:
        raise ValueError("pass num_kept_partial_checkpoints or retention, not both")
    return KeepLast(num_kept) if num_kept is not None else retention or default


def _rank_state_bytes(rank_state: Any, partial: bool, tiered: bool) -> bytes | None:
    """(each rank) ``save``'s ``rank_state`` encoded, before anything is written."""
    if rank_state is None:
        return None
    if not partial or tiered:
        raise ValueError("rank_state is saved with partial checkpoints of a manager without local_tier only")
    return encode_rank_state(rank_state)


def _check_resume(partial: bool, tiered: bool, key_map: KeyMap | None, translate_function: TranslateFunction | None,
                  load_sharded_optimizer_state: object, rank_state_rule: RankStateRule | None) -> None:
    """(each rank) ``resume``'s argument checks, before any collective."""
    if not isinstance(load_sharded_optimizer_state, bool):
        raise TypeError(f"load_sharded_optimizer_state must be a bool, got {load_sharded_optimizer_state!r}")
    if partial and (key_map is not None or translate_function is not None):
        raise ValueError(
            "key_map / translate_function apply to full checkpoints (partial=False); a partial "
            "checkpoint is loaded by the keys it was saved with"
        )
    if rank_state_rule is not None and (not partial or tiered):
        raise ValueError("rank_state_rule applies to partial checkpoints of a manager without local_tier")
