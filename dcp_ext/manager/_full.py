"""Full checkpoints under a root: single files and Hugging Face folders saved, resumed and exported."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)

from .._runtime import flatten_state_dict
from ..errors import CheckpointExistsError, CheckpointNotFoundError
from ..format import decode_user_content
from ..full import (
    KeyMap,
    TranslateFunction,
    export_partial,
    load_pretrained,
    save_full,
)
from ..hf import HF_INDEX_FILE, write_live_state, write_partial
from ..layout import USER_CONTENT_FILE, user_content_name, validate_tag
from ..storage import normalize_path
from ._context import ManagerContext
from ._requests import NO_MODEL, ResumeResult, read_optional

__all__ = ["FullCheckpoints", "full_state"]


class FullCheckpoints:
    """Full (single-file or Hugging Face) checkpoints ``ROOT/{tag}``.

    Args:
        ctx: Where and how the manager saves.
    """

    def __init__(self, ctx: ManagerContext) -> None:
        self.ctx = ctx

    def save(
        self,
        tag: str,
        state: dict[str, Any],
        user_content: bytes | None,
        *,
        full_format: str,
        overwrite: bool,
        max_shard_size: int | str,
        dtype: torch.dtype | None,
        hf_config: dict[str, Any] | str | None,
    ) -> None:
        """(all ranks) ``state`` as one file ``ROOT/{tag}`` (``"safetensors"``,
        ``"torch"``) or as the Hugging Face folder ``ROOT/{tag}/`` (``"hf"``)."""
        ctx = self.ctx
        if full_format == "hf":
            self._save_hf(tag, state, user_content, overwrite, max_shard_size, dtype, hf_config)
            return
        save_full(ctx.group, ctx.checkpoints.store, tag, state, fmt=full_format, user_content=user_content,
                  overwrite=overwrite, frame_size=ctx.config.frame_size)

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
        ctx = self.ctx
        ctx.group.run_on_coordinator(lambda: self._clear_full_file(tag, overwrite))
        store = ctx.checkpoints.store
        write_live_state(
            state, ctx.location.child(tag), max_shard_size=max_shard_size, dtype=dtype, config_json=hf_config,
            overwrite=overwrite, process_group=ctx.process_group,
            extra=None if user_content is None else (store, user_content_name(tag), user_content),
        )

    def _clear_full_file(self, tag: str, overwrite: bool) -> None:
        """(coordinator) Refuse, or with ``overwrite`` delete, a single-file
        full checkpoint ``ROOT/{tag}`` where a folder of that name is to go."""
        store = self.ctx.checkpoints.store
        if not store.exists(tag):
            return
        if not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists: the full checkpoint {store.describe(tag)}; pass overwrite=True",
                store.describe(tag),
            )
        self.ctx.checkpoints.delete(tag, partial=False)

    def resume(
        self,
        tag: str,
        model: nn.Module | None,
        strict: bool,
        key_map: KeyMap | None = None,
        translate_function: TranslateFunction | None = None,
    ) -> ResumeResult:
        """(all ranks) Load the full checkpoint ``ROOT/{tag}`` into ``model`` (see :func:`~dcp_ext.load_pretrained`)."""
        ctx = self.ctx
        if model is None:
            raise ValueError(NO_MODEL.format(call="resume from a full checkpoint"))
        store = ctx.checkpoints.store
        if not store.exists(tag) and not store.exists(f"{tag}/{HF_INDEX_FILE}"):
            raise CheckpointNotFoundError(
                f"no full checkpoint {store.describe(tag)}; saved tags with partial=False live at ROOT/<tag>",
                store.describe(tag),
            )
        folder = ctx.location.child(tag)
        load_pretrained(
            model, folder.url, strict=strict, key_map=key_map, translate_function=translate_function,
            storage_options=folder.storage_options, process_group=ctx.process_group, config=folder.config,
        )
        raw = read_optional(store, user_content_name(tag))
        content = None if raw is None else decode_user_content(raw, store.describe(user_content_name(tag)))
        return ResumeResult(tag, content, False)

    def export(
        self,
        tag: str,
        out: str | None,
        full_format: str,
        include_optimizer: bool,
        overwrite: bool,
        progress: Callable[[int, int], None] | None,
    ) -> str:
        """(one process) The partial checkpoint ``tag`` as one full file (see
        :meth:`CheckpointManager.export <dcp_ext.CheckpointManager.export>`); where it went."""
        ctx = self.ctx
        root_store = ctx.checkpoints.store
        if out is None or "/" not in out:
            target_store, target_name = root_store, validate_tag(out or tag)
        else:
            parent, _, target_name = normalize_path(out).rstrip("/").rpartition("/")
            target_store = ctx.checkpoints.location.at(parent).open()
        if target_store.exists(target_name) and not overwrite:
            raise CheckpointExistsError(
                f"Checkpoint already exists at {target_store.describe(target_name)}; pass overwrite=True",
                target_store.describe(target_name),
            )
        export_partial(ctx.checkpoints.partial_location(tag), target_store, target_name, full_format=full_format,
                       include_optimizer=include_optimizer, progress=progress)
        content = read_optional(ctx.checkpoints.partial_store(tag), USER_CONTENT_FILE)
        if content is not None and target_store is root_store:
            root_store.write_file(user_content_name(target_name), content)
        return target_store.describe(target_name)

    def export_hf(
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
        """(all ranks, or one process) The partial checkpoint ``tag`` as a Hugging Face folder; where it went."""
        ctx = self.ctx
        extra = None
        if out is None or "/" not in out:
            name = validate_tag(out or tag)
            folder = ctx.location.child(name)
            ctx.group.run_on_coordinator(lambda: self._clear_full_file(name, overwrite))
            content = ctx.group.run_on_coordinator(
                lambda: read_optional(ctx.checkpoints.partial_store(tag), USER_CONTENT_FILE))
            if content is not None:
                extra = (ctx.checkpoints.store, user_content_name(name), content)
        else:
            folder = ctx.location.at(out)
        write_partial(
            ctx.checkpoints.partial_location(tag), folder, include_optimizer=include_optimizer,
            max_shard_size=max_shard_size, dtype=dtype, config_json=hf_config, overwrite=overwrite,
            process_group=ctx.process_group, extra=extra, progress=progress,
        )
        return folder.url


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's state dict, plus the optimizer's tensors under flattened ``optimizer.`` keys."""
    state = dict(get_model_state_dict(model))
    if optimizer is not None:
        flat, _ = flatten_state_dict({"optimizer": get_optimizer_state_dict(model, optimizer)})
        state.update({k: v for k, v in flat.items() if isinstance(v, torch.Tensor)})
    return state
