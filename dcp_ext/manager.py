"""The checkpoint API: ``CheckpointManager``, ``save_checkpoint`` and ``resume_from_checkpoint``.

The SageMaker model-parallel workflow on open PyTorch (DCP with plain, DDP,
FSDP2 and tensor-parallel models) in the layout of :mod:`dcp_ext.layout`.

Order of a partial save (each step only after the previous one succeeded):

1. every rank streams its shards into ``{tag}_partial/`` (``dcp.save`` with
   :class:`~dcp_ext.CheckpointWriter` and :class:`~dcp_ext.planners.LayoutSavePlanner`);
2. the coordinator writes ``user_content.safetensors`` and ``partition.json``,
   then the metadata, which commits the checkpoint;
3. the coordinator points ``newest`` at the tag (atomic replace locally, one
   PUT on S3);
4. retention deletes the oldest committed partial checkpoints beyond
   ``num_kept_partial_checkpoints``, never the ``newest`` target and never a
   file dcp_ext did not write.

A failure at any step leaves ``newest`` on the previous tag and deletes nothing.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ._metadata_format import METADATA_FILE, TORCH_METADATA_FILE
from .config import IOConfig
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    DcpExtError,
    NotACheckpointError,
    raise_unwrapped,
    unwrap_checkpoint_exception,
)
from .codecs import Codec, resolve_codec
from ._failpoints import crash_point
from ._gc import gc_paused
from ._quiet import torch_notices_quieted
from .full import FULL_FORMATS, full_layout, spec_of, stream_full_checkpoint
from .layout import (
    NEWEST_FILE,
    PARTIAL_SUFFIX,
    PARTITION_FILE,
    USER_CONTENT_FILE,
    MeshInfo,
    Partition,
    TagInfo,
    partial_dir,
    select_for_deletion,
    user_content_name,
    validate_tag,
)
from .planners import LayoutLoadPlanner, LayoutSavePlanner
from .pretrained import load_pretrained
from .reader import CheckpointReader
from .storage import Store, join_path, normalize_path, open_store
from .storage.local import TMP_MARK
from .user_content import decode_user_content, encode_user_content
from .writer import DATA_SUFFIX, LOCK_FILE, STALE_LOCK_SECONDS, CheckpointWriter, lock_holder_running

__all__ = ["CheckpointManager", "ResumeResult", "save_checkpoint", "resume_from_checkpoint"]

log = logging.getLogger("dcp_ext.manager")

# Files dcp_ext writes in a partial checkpoint directory; deletion touches nothing else.
_OWN_FILES = (METADATA_FILE, TORCH_METADATA_FILE, PARTITION_FILE, USER_CONTENT_FILE)
_CREATED = re.compile(rb'"created":([0-9.eE+-]+)')


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
    ) -> None:
        self.root = normalize_path(root)
        self.compression = resolve_codec(compression)
        self.storage_options = dict(storage_options or {})
        self.config = config or IOConfig.from_env()
        self.process_group = process_group
        self.mesh = MeshInfo.from_device_mesh(mesh) if mesh is not None else None
        self._root_store = open_store(self.root, self.config, self.storage_options)
        self._pending: concurrent.futures.Future[None] | None = None
        self._lock = threading.Lock()
        #: The planner and reader of the last partial resume: fast-path and
        #: key reports, and ``last_reader.store.stats`` (bytes and files read).
        self.last_load_planner: LayoutLoadPlanner | None = None
        self.last_reader: CheckpointReader | None = None

    # -- process-group helpers -----------------------------------------------------
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._distributed() else 0

    def _is_coordinator(self) -> bool:
        return self._rank() == 0

    def _broadcast(self, value: Any) -> Any:
        """The coordinator's ``value`` on every rank."""
        if not self._distributed():
            return value
        holder = [value]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(holder, src=src, group=self.process_group)
        return holder[0]

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self.process_group)

    def _global_ranks(self) -> list[int] | None:
        if not self._distributed() or self.process_group is None:
            return None
        return [dist.get_global_rank(self.process_group, r) for r in range(dist.get_world_size(self.process_group))]

    def _store(self, name: str) -> Store:
        return open_store(join_path(self.root, name), self.config, self.storage_options)

    # -- queries (any rank) ------------------------------------------------------------
    def committed(self) -> list[TagInfo]:
        """Committed partial checkpoints, oldest first."""
        infos = []
        for name in self._root_store.list_dirs():
            if not name.endswith(PARTIAL_SUFFIX):
                continue
            tag = name[: -len(PARTIAL_SUFFIX)]
            try:
                validate_tag(tag)
            except DcpExtError:
                continue
            store = self._store(name)
            try:
                head = store.read_head(METADATA_FILE, 512)
            except CheckpointNotFoundError:
                continue  # never committed (failed or running save)
            match = _CREATED.search(head)
            infos.append(TagInfo(tag, float(match.group(1)) if match else 0.0))
        return sorted(infos, key=lambda t: (t.committed_at, t.tag))

    def tags(self) -> list[str]:
        """Tags of the committed partial checkpoints, oldest first."""
        return [t.tag for t in self.committed()]

    def read_newest(self) -> str | None:
        """The tag named by ``newest`` if it is committed, else the newest committed
        tag (with a warning), else ``None``."""
        committed = self.committed()
        names = {t.tag for t in committed}
        try:
            recorded = self._root_store.read_file(NEWEST_FILE).decode().strip()
        except CheckpointNotFoundError:
            recorded = None
        if recorded in names:
            return recorded
        if not committed:
            return None
        fallback = committed[-1].tag
        warnings.warn(
            f"{self._root_store.describe(NEWEST_FILE)} "
            + ("is missing" if recorded is None else f"names {recorded!r}, which is not a committed checkpoint")
            + f"; using the newest committed tag {fallback!r}",
            stacklevel=2,
        )
        return fallback

    # -- save -------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until an asynchronous save in flight has committed (or failed)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException as err:  # reported by that save's own future
                log.warning("the previous asynchronous save failed: %s", err)

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
    ) -> concurrent.futures.Future[None] | None:
        """(all ranks) Save a checkpoint under ``tag``.

        Args:
            tag: The checkpoint's name (see :func:`dcp_ext.layout.validate_tag`).
            model: Plain, DDP, FSDP2 or tensor-parallel module.
            optimizer: Its optimizer (partial checkpoints only, unless
                ``include_optimizer``).
            user_content: Extra state (see :mod:`dcp_ext.user_content`);
                the coordinator's value is stored.
            partial: ``True``: sharded ``{tag}_partial/`` for resuming;
                ``False``: one full model file ``ROOT/{tag}`` for inference.
            num_kept_partial_checkpoints: After this save commits, delete the
                oldest partial checkpoints beyond this many.
            async_save: Return a future at once; ``newest`` and retention are
                applied when the background save commits.
            overwrite: Replace an existing checkpoint with this tag.
            full_format: ``"safetensors"`` or ``"torch"`` (full checkpoints).
            include_optimizer: Also put the optimizer state in a full checkpoint.

        Returns:
            A future when ``async_save``, else ``None``.
        """
        validate_tag(tag)
        if model is None and optimizer is None:
            raise ValueError("save needs a model and/or an optimizer")
        if num_kept_partial_checkpoints is not None and num_kept_partial_checkpoints < 1:
            raise ValueError(f"num_kept_partial_checkpoints must be >= 1, got {num_kept_partial_checkpoints}")
        encoded = None if user_content is None else encode_user_content(user_content)
        self.wait()  # one save at a time
        if not partial:
            if async_save:
                raise ValueError("async_save is only supported for partial checkpoints")
            self._save_full(tag, model, optimizer if include_optimizer else None, encoded, full_format, overwrite)
            return None
        return self._save_partial(tag, model, optimizer, encoded, num_kept_partial_checkpoints, async_save, overwrite)

    def _app_state(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if model is None:
            raise ValueError("a model is needed to name the optimizer's state")
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def _save_partial(
        self,
        tag: str,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        user_content: bytes | None,
        keep: int | None,
        async_save: bool,
        overwrite: bool,
    ) -> concurrent.futures.Future[None] | None:
        from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        state = self._app_state(model, optimizer)
        planner = LayoutSavePlanner(self.mesh, self._global_ranks())

        def before_commit(store: Store) -> None:
            if user_content is not None:
                store.write_file(USER_CONTENT_FILE, user_content)
            if planner.partition is not None:
                store.write_file(PARTITION_FILE, planner.partition.to_json())

        writer = CheckpointWriter(
            join_path(self.root, partial_dir(tag)), storage_options=self.storage_options,
            overwrite=overwrite, config=self.config, before_commit=before_commit,
            compression=self.compression,
        )
        if not async_save:
            try:
                with gc_paused(), torch_notices_quieted():
                    dcp_save(state, storage_writer=writer, planner=planner, process_group=self.process_group)
            except CheckpointException as exc:
                writer.remove_own_files()
                raise_unwrapped(exc)
            error = self._after_commit(tag, keep) if self._is_coordinator() else None
            error = self._broadcast(error)
            if error is not None:
                raise DcpExtError(f"checkpoint {tag!r} committed, but {error}")
            return None

        result: concurrent.futures.Future[None] = concurrent.futures.Future()
        with torch_notices_quieted():
            inner = dcp_async_save(state, storage_writer=writer, planner=planner, process_group=self.process_group)
        upload = inner.upload_completion if hasattr(inner, "upload_completion") else inner

        def done(future: concurrent.futures.Future[Any]) -> None:
            try:
                future.result()
            except BaseException as exc:
                writer.remove_own_files()
                inner_error = unwrap_checkpoint_exception(exc)
                result.set_exception(inner_error if isinstance(inner_error, Exception) else exc)
                return
            error = self._after_commit(tag, keep) if self._is_coordinator() else None
            if error is not None:
                result.set_exception(DcpExtError(f"checkpoint {tag!r} committed, but {error}"))
            else:
                result.set_result(None)

        upload.add_done_callback(done)
        with self._lock:
            self._pending = result
        return result

    def _after_commit(self, tag: str, keep: int | None) -> str | None:
        """(coordinator) Move ``newest``, then apply retention; returns an error text."""
        crash_point("before_newest")
        try:
            self._root_store.write_file(NEWEST_FILE, f"{tag}\n".encode())
        except DcpExtError as err:
            return f"updating {NEWEST_FILE} failed: {err}"
        if keep is not None:
            try:
                for doomed in select_for_deletion(self.committed(), keep, protect={tag}):
                    self._delete_partial(doomed)
            except DcpExtError as err:
                return f"retention failed: {err}"
        try:
            self._remove_leftovers(tag)
        except DcpExtError as err:  # the checkpoint is committed; this is tidying
            log.warning("could not remove leftovers under %s: %s", self._root_store.url, err)
        return None

    def _remove_leftovers(self, current: str) -> None:
        """(coordinator, after a commit) Delete what crashed saves left: partial
        directories that never committed (no metadata) and temporary files in
        the root. The tag being saved, and any directory a live process on
        this host is saving right now (its lock), are never touched; one job
        saves to a root at a time."""
        for name in self._root_store.list_names():
            if TMP_MARK in name:
                self._root_store.delete(name)
        for name in self._root_store.list_dirs():
            if not name.endswith(PARTIAL_SUFFIX) or name == partial_dir(current):
                continue
            tag = name[: -len(PARTIAL_SUFFIX)]
            try:
                validate_tag(tag)
            except DcpExtError:
                continue  # not ours
            store = self._store(name)
            if store.exists(METADATA_FILE) or _lock_is_live(store):
                continue  # committed, or another job is saving it right now
            log.info("removing %s: a save that never committed", name)
            self._delete_partial(tag)

    def _save_full(
        self,
        tag: str,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        user_content: bytes | None,
        fmt: str,
        overwrite: bool,
    ) -> None:
        if fmt not in FULL_FORMATS:
            raise ValueError(f"unknown full_format {fmt!r}; use one of {FULL_FORMATS}")
        if model is None:
            raise ValueError("a full checkpoint needs the model")
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = dict(get_model_state_dict(model))
        if optimizer is not None:
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            flat, _ = flatten_state_dict({"optimizer": get_optimizer_state_dict(model, optimizer)})
            state.update({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
        tensors = [(k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
        specs = [spec_of(k, v) for k, v in tensors]
        coordinator = self._is_coordinator()
        error: str | None = None
        if coordinator and not overwrite and self._root_store.exists(tag):
            error = f"a full checkpoint {self._root_store.describe(tag)} exists; pass overwrite=True"
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointExistsError(error, self._root_store.describe(tag))
        layout = full_layout(specs, fmt)
        writer = None
        if coordinator:
            self._root_store.ensure_root()
            writer = self._root_store.open_writer(tag, size_hint=layout.total_bytes(specs))
        failure: BaseException | None = None

        def fetch(index: int) -> torch.Tensor | None:
            value = tensors[index][1]
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            return full if coordinator else None

        try:
            stream_full_checkpoint(writer, specs, layout, fetch)
            if writer is not None:
                if user_content is not None:
                    self._root_store.write_file(user_content_name(tag), user_content)
                writer.commit()
        except BaseException as err:
            failure = err
            if writer is not None:
                writer.abort()
        message = self._broadcast(None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure
        if message is not None:
            raise DcpExtError(f"saving full checkpoint {tag!r} failed on the coordinator: {message}")

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
    ) -> ResumeResult:
        """(all ranks) Load a checkpoint into ``model`` / ``optimizer`` in place.

        Args:
            model: Plain, DDP, FSDP2 or tensor-parallel module (for full
                checkpoints it may be on the meta device).
            optimizer: Its optimizer (partial checkpoints).
            tag: Which checkpoint; ``None`` means the newest committed one.
            partial: Load ``{tag}_partial/`` (``True``) or the full file ``ROOT/{tag}``.
            strict: Refuse a checkpoint that lacks keys of the model/optimizer,
                or holds model/optimizer keys they do not have. Without an
                optimizer only the model is loaded (a selective load).
            allow_dtype_cast: Load tensors saved in another dtype by casting.

        The checkpoint may have been saved by any world size and parallel
        layout (resharding); when ``partition.json`` shows the same world size
        and mesh, each rank reads its own chunks without overlap computation.

        Raises:
            CheckpointNotFoundError: No such tag, or nothing committed under the root.
            CheckpointKeyError: Missing / unexpected keys (``strict``).
            ReshardError: A shape or dtype differs, or the layout cannot be filled.
        """
        follow_newest = tag is None
        if tag is None:
            tag = self._broadcast(self.read_newest() if self._is_coordinator() else None)
            if tag is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self._root_store.url}: nothing to resume from",
                    self._root_store.url,
                )
        validate_tag(tag)
        if not partial:
            return self._resume_full(tag, model, strict)
        if model is None:
            raise ValueError("resume needs the model (and optionally its optimizer)")
        for attempt in range(_RESUME_ATTEMPTS):
            try:
                return self._resume_partial(tag, model, optimizer, strict, allow_dtype_cast)
            except (CheckpointNotFoundError, NotACheckpointError) as err:
                # Retention of a concurrent save can delete the tag we are
                # reading (every rank sees the failure: DCP propagates it).
                # If newest has moved on, load that one instead.
                if not follow_newest or attempt == _RESUME_ATTEMPTS - 1:
                    raise
                newer = self._broadcast(self.read_newest() if self._is_coordinator() else None)
                if newer is None or newer == tag:
                    raise
                log.warning("checkpoint %s disappeared while loading (%s); loading the newest, %s", tag, err, newer)
                tag = newer
        raise AssertionError("unreachable")

    def _resume_partial(
        self,
        tag: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strict: bool,
        allow_dtype_cast: bool,
    ) -> ResumeResult:
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        url = join_path(self.root, partial_dir(tag))
        reader = CheckpointReader(url, storage_options=self.storage_options, config=self.config)
        state = self._app_state(model, optimizer)
        # The small files are read by the coordinator, before the data, and
        # shared, so that a tag deleted meanwhile fails on every rank alike.
        extras: tuple[bytes | None, bytes | None, bool] | None = None
        if self._is_coordinator():
            extras = (
                _read_optional(reader.store, PARTITION_FILE),
                _read_optional(reader.store, USER_CONTENT_FILE),
                reader.store.exists(METADATA_FILE),
            )
        partition_raw, user_content_raw, committed = self._broadcast(extras)
        if not committed:
            raise reader.missing_metadata_error()
        partition = (
            None if partition_raw is None
            else Partition.from_json(partition_raw, reader.store.describe(PARTITION_FILE))
        )
        world = dist.get_world_size(self.process_group) if self._distributed() else 1
        # A parameter that had no gradient when the checkpoint was saved has
        # no optimizer state in it; get_state_dict has made some here.
        per_param = state.get("optimizer", {}).get("state", {})
        planner = LayoutLoadPlanner(
            strict, allow_dtype_cast=allow_dtype_cast, partition=partition, world_size=world, mesh=self.mesh,
            optional_prefixes=[f"optimizer.state.{fqn}." for fqn in per_param],
        )
        self.last_load_planner = planner
        self.last_reader = reader
        try:
            with gc_paused(), torch_notices_quieted():
                dcp_load(state, storage_reader=reader, planner=planner, process_group=self.process_group)
        except CheckpointException as exc:
            raise_unwrapped(exc, reader.last_error)
        for prefix in planner.absent_prefixes:
            # As when it was saved: no state until the parameter's first step.
            del per_param[prefix[len("optimizer.state."):-1]]
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

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

    def _resume_full(self, tag: str, model: nn.Module | None, strict: bool) -> ResumeResult:
        if model is None:
            raise ValueError("resume from a full checkpoint needs the model")
        if not self._root_store.exists(tag):
            raise CheckpointNotFoundError(
                f"no full checkpoint {self._root_store.describe(tag)}; saved tags with "
                f"partial=False live at ROOT/<tag>",
                self._root_store.describe(tag),
            )
        load_pretrained(
            model, join_path(self.root, tag), strict=strict, storage_options=self.storage_options,
            process_group=self.process_group, config=self.config,
        )
        return ResumeResult(tag, self._read_user_content(self._root_store, user_content_name(tag)), False)

    @staticmethod
    def _read_user_content(store: Store, name: str) -> Any:
        try:
            data = store.read_file(name)
        except CheckpointNotFoundError:
            return None
        return decode_user_content(data, store.describe(name))

    # -- maintenance (coordinator or a single process) -------------------------------
    def partition(self, tag: str) -> Partition:
        """The partition record of a partial checkpoint."""
        store = self._store(partial_dir(tag))
        return Partition.from_json(store.read_file(PARTITION_FILE), store.describe(PARTITION_FILE))

    def delete(self, tag: str, *, partial: bool = True, full: bool = True) -> None:
        """Delete a checkpoint's files written by dcp_ext (nothing else).

        Raises:
            ValueError: ``tag`` is the target of ``newest`` (partial).
        """
        validate_tag(tag)
        if partial:
            try:
                recorded = self._root_store.read_file(NEWEST_FILE).decode().strip()
            except CheckpointNotFoundError:
                recorded = None
            if recorded == tag:
                raise ValueError(f"{tag!r} is the newest checkpoint; save a newer one before deleting it")
            self._delete_partial(tag)
        if full:
            self._root_store.delete(tag)
            self._root_store.delete(user_content_name(tag))

    def _delete_partial(self, tag: str) -> None:
        store = self._store(partial_dir(tag))
        # The commit marker goes first: a half-deleted checkpoint is never
        # mistaken for a committed one.
        for name in _OWN_FILES:
            store.delete(name)
        crash_point("mid_retention")
        for name in store.list_names():
            if name.endswith(DATA_SUFFIX) or TMP_MARK in name or name == LOCK_FILE:
                store.delete(name)
        store.remove_root_if_empty()

    def export(
        self,
        tag: str,
        *,
        out: str | None = None,
        full_format: str = "safetensors",
        include_optimizer: bool = False,
        overwrite: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> str:
        """Write a full checkpoint from a partial one, one tensor in memory at a time.

        Runs in one process (no process group needed); reads each tensor's
        chunks with ranged reads and streams it into the output.

        Args:
            tag: The partial checkpoint.
            out: Output tag under the root (default: ``tag``), or a path/URL
                containing ``/``.
            full_format: ``"safetensors"`` or ``"torch"``.
            include_optimizer: Also export the optimizer's tensors.
            overwrite: Replace an existing output.
            progress: Called as ``progress(bytes_done, bytes_total)`` as
                tensors are written (the CLI draws its progress bar with it).

        Returns:
            Where the full checkpoint was written.
        """
        validate_tag(tag)
        from .export import export_partial

        if out is None or "/" not in out:
            name = validate_tag(out or tag)
            target_store, target_name = self._root_store, name
        else:
            parent, _, target_name = normalize_path(out).rstrip("/").rpartition("/")
            target_store = open_store(parent, self.config, self.storage_options)
        if target_store.exists(target_name) and not overwrite:
            raise CheckpointExistsError(
                f"{target_store.describe(target_name)} exists; pass overwrite=True", target_store.describe(target_name)
            )
        source = join_path(self.root, partial_dir(tag))
        export_partial(source, target_store, target_name, full_format=full_format,
                       include_optimizer=include_optimizer, storage_options=self.storage_options,
                       config=self.config, progress=progress)
        try:
            content = self._store(partial_dir(tag)).read_file(USER_CONTENT_FILE)
        except CheckpointNotFoundError:
            content = None
        if content is not None and target_store is self._root_store:
            self._root_store.write_file(user_content_name(target_name), content)
        return target_store.describe(target_name)


# -- SageMaker-style functions ------------------------------------------------------
_RESUME_ATTEMPTS = 4


def _read_optional(store: Store, name: str) -> bytes | None:
    try:
        return store.read_file(name)
    except CheckpointNotFoundError:
        return None


def _lock_is_live(store: Store) -> bool:
    """Whether ``store``'s checkpoint is being saved right now by a running
    save on this host. A lock from another host cannot be checked and counts
    as abandoned: one job saves to a root at a time."""
    try:
        record = json.loads(store.read_file(LOCK_FILE))
        if time.time() - float(record["started"]) >= STALE_LOCK_SECONDS:
            return False
    except (DcpExtError, ValueError, KeyError, TypeError):
        return False
    return lock_holder_running(record) is True


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
    **kwargs: Any,
) -> concurrent.futures.Future[None] | None:
    """(all ranks) ``smp.save_checkpoint`` on DCP; see :meth:`CheckpointManager.save`.

    Extra keyword arguments: ``process_group``, ``mesh``, ``config`` (for the
    manager) and ``overwrite``, ``full_format``, ``include_optimizer``.
    An asynchronous save keeps its manager alive through the returned future.
    """
    manager_args = {
        k: kwargs.pop(k) for k in ("process_group", "mesh", "config", "compression") if k in kwargs
    }
    manager = CheckpointManager(path, storage_options=storage_options, **manager_args)
    return manager.save(
        tag, model, optimizer, user_content, partial=partial,
        num_kept_partial_checkpoints=num_kept_partial_checkpoints, async_save=async_save, **kwargs,
    )


def resume_from_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    tag: str | None = None,
    partial: bool = True,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
    allow_dtype_cast: bool = False,
    **kwargs: Any,
) -> ResumeResult:
    """(all ranks) ``smp.resume_from_checkpoint`` on DCP; see :meth:`CheckpointManager.resume`.

    Returns:
        The tag loaded and its ``user_content``.
    """
    manager = CheckpointManager(path, storage_options=storage_options, **kwargs)
    return manager.resume(
        model, optimizer, tag=tag, partial=partial, strict=strict, allow_dtype_cast=allow_dtype_cast
    )

