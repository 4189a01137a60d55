"""The SageMaker-style functions: ``save_checkpoint``, ``resume_from_checkpoint``, ``close_checkpoints``.

``save_checkpoint`` calls with the same root and manager arguments share
one :class:`~dcp_ext.CheckpointManager` for the life of the process (kept
here), so that a save waits for the asynchronous one in flight and reuses
its staging buffers.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..config import IOConfig
from ..dcp_io import AsyncSaveHandle
from ..full import KeyMap, TranslateFunction
from ..storage import Location
from ._manager import CheckpointManager
from ._requests import ResumeResult

__all__ = ["save_checkpoint", "resume_from_checkpoint", "close_checkpoints"]


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
    ``translate_if_full`` / ``translate_function``: full saves translate the
    state dict before writing (``{key: tensor} -> {key: tensor}``, as SMP's
    translators; dcp_ext has no built-in ones: without a
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

    Args:
        path: The checkpoint root: local path, ``s3://`` or fsspec URL.
        tag: The checkpoint's name (``{tag}_partial/`` for a partial save).
        model: The model; by default the registered one.
        optimizer: Its optimizer; by default the registered one's.
        user_content: JSON-able data or tensors saved with the checkpoint and
            returned by :func:`resume_from_checkpoint`.
        partial: ``True``: each rank writes its shards (``{tag}_partial/``);
            ``False``: one full checkpoint for inference or fine-tuning.
        num_kept_partial_checkpoints: Keep only this many newest partial
            checkpoints (SageMaker's retention).
        async_save: Return at once with a handle; the save runs in the background.
        storage_options: fsspec/s3fs options (S3 endpoint, credentials...).
        translate_if_full: Full saves: apply ``translate_function``.
        translate_function: Full saves: ``{key: tensor} -> {key: tensor}``.
        **kwargs: The manager and save arguments listed above.

    Returns:
        The asynchronous save's handle, or ``None`` for a synchronous save.

    Raises:
        CheckpointExistsError: ``tag`` is committed and ``overwrite`` is not set.
        CheckpointInUseError: The save would rewrite files another tag refers to.
        InvalidTagError: ``tag`` is not a valid checkpoint name.
        DcpExtError: Storage and checkpoint errors, as for :meth:`CheckpointManager.save`.
    """
    manager_args = {
        k: kwargs.pop(k) for k in _MANAGER_ARGS if k in kwargs
    }
    manager = _shared_manager(Location.of(path, storage_options, manager_args.get("config")), manager_args)
    return manager.save(
        tag, model, optimizer, user_content, partial=partial,
        num_kept_partial_checkpoints=num_kept_partial_checkpoints, async_save=async_save,
        translate_if_full=translate_if_full, translate_function=translate_function, **kwargs,
    )


_MANAGER_ARGS = ("process_group", "mesh", "config", "compression", "async_uploads", "local_tier", "persist_every",
                 "keep_local", "replicas", "local_tier_bytes", "incremental", "max_chain")

# Managers of save_checkpoint(), by root and manager arguments (see there).
_SHARED_MANAGERS: dict[tuple[Any, ...], CheckpointManager] = {}


def _shared_manager(root: Location, manager_args: dict[str, Any]) -> CheckpointManager:
    """The manager of ``root`` (its URL and storage options) and ``manager_args``, made on first use."""

    def identity(value: Any) -> Any:
        # Process groups, meshes and codecs by identity: the cached manager
        # holds them, so their ids cannot be reused while it exists.
        return value if isinstance(value, (str, int, float, bool, type(None), IOConfig)) else ("id", id(value))

    key = (
        root.url,
        repr(sorted(root.storage_options.items())),
        tuple(sorted((k, identity(v)) for k, v in manager_args.items())),
    )
    manager = _SHARED_MANAGERS.get(key)
    if manager is None:
        manager = _SHARED_MANAGERS[key] = CheckpointManager(root, **manager_args)
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

    Args:
        path: The checkpoint root (or, with ``partial=False``, the folder of a
            full checkpoint or Hugging Face model).
        model: The model to load into; by default the registered one.
        optimizer: Its optimizer; by default the registered one's.
        tag: The checkpoint to load; by default the one ``newest`` names (or
            the newest committed one).
        partial: Load a partial checkpoint (``True``) or a full one.
        strict: Refuse a checkpoint that lacks keys of the model.
        storage_options: fsspec/s3fs options (S3 endpoint, credentials...).
        allow_dtype_cast: Load tensors stored in another dtype, cast.
        load_optimizer: Also load the optimizer (``False``: the model only).
        load_sharded_optimizer_state: Accepted for SageMaker's API; no effect.
        translate_function: Full loads: ``{key: tensor} -> {key: tensor}``.
        key_map: Full loads: rename keys without reading whole tensors.
        **kwargs: :class:`CheckpointManager` arguments.

    Returns:
        The tag loaded and its ``user_content``.

    Raises:
        CheckpointNotFoundError: No committed checkpoint (or no ``tag``) at ``path``.
        CheckpointKeyError: With ``strict``, the checkpoint lacks keys of the model.
        DcpExtError: Storage and checkpoint errors, as for :meth:`CheckpointManager.resume`.
    """
    manager = CheckpointManager(path, storage_options=storage_options, **kwargs)
    return manager.resume(
        model, optimizer, tag=tag, partial=partial, strict=strict, allow_dtype_cast=allow_dtype_cast,
        load_optimizer=load_optimizer, load_sharded_optimizer_state=load_sharded_optimizer_state,
        key_map=key_map, translate_function=translate_function,
    )
