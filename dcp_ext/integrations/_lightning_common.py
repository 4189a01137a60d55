"""What dcp_ext's Lightning plug-ins do, for both namespaces.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same classes twice
(``CheckpointIO``, ``ModelParallelStrategy``) and check plug-ins with
``isinstance``, so each namespace needs its own subclasses:
:mod:`dcp_ext.integrations.lightning` and
:mod:`dcp_ext.integrations.pytorch_lightning` define them as these mixins
plus that namespace's base class. Nothing here imports either namespace.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

import torch

import dcp_ext
from dcp_ext.errors import CheckpointNotFoundError, InvalidOptionError, InvalidPathError
from dcp_ext.storage import Location
from dcp_ext.whole_state import load_whole

from . import _checkpoint_dirs as dirs
from ._io_options import io_config
from ._lightning_resume import checkpoint_dir
from ._planning import save_planner

__all__ = ["CheckpointIOMixin", "ModelParallelMixin", "META_FILE"]

#: Where Lightning's ``ModelParallelStrategy`` keeps everything of a
#: distributed checkpoint that is not model or optimizer state (loops,
#: callbacks, hyper-parameters): a ``torch.save`` file beside the shards
#: (``lightning.fabric.utilities.load._METADATA_FILENAME``).
META_FILE = "meta.pt"


def _options(base: dict[str, Any], extra: Any) -> dict[str, Any]:
    """``base`` with ``extra`` (Lightning's per-call ``storage_options``) on top."""
    if extra is None:
        return dict(base)
    if not isinstance(extra, dict):
        raise InvalidOptionError(f"storage_options must be a dict of fsspec/s3fs options, not {type(extra).__name__}")
    return {**base, **extra}


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class CheckpointIOMixin:
    """What ``DcpExtCheckpointIO`` does, for both Lightning namespaces (documented in
    :mod:`dcp_ext.integrations.lightning`)."""

    def __init__(self, storage_options: dict[str, Any] | None = None, compression: Any = None,
                 overwrite: bool = True, **writer_options: Any) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.compression = compression
        self.overwrite = overwrite
        self.writer_options = writer_options

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        """(global rank 0) Save ``checkpoint`` as a dcp_ext checkpoint at ``path``."""
        writer = dcp_ext.CheckpointWriter(path, storage_options=_options(self.storage_options, storage_options),
                                          overwrite=self.overwrite, compression=self.compression,
                                          **self.writer_options)
        dirs.save_alone(checkpoint, writer)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """(each rank, independently) The whole checkpoint at ``path``.

        Args:
            path: A checkpoint this plug-in (or any DCP writer) saved, or
                a file Lightning's ``TorchCheckpointIO`` saved (read with
                ``torch.load``), so switching plug-ins keeps old checkpoints.
            map_location: ``None`` (tensors on the CPU), a device or device
                string to move every tensor to.
            weights_only: Decode non-tensor values as plain data only
                (``None``: torch's default, ``True``). Lightning registers
                its own types as safe; ``False`` for trusted checkpoints
                holding other objects.

        Raises:
            CheckpointNotFoundError: Nothing at ``path`` (Lightning expects
                a ``FileNotFoundError``).
            InvalidOptionError: A ``map_location`` other than ``None``, a
                device or a string.
        """
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise InvalidOptionError(
                f"map_location for a dcp_ext checkpoint must be None, a device or a device string, "
                f"not {type(map_location).__name__} ({os.fspath(path)})", os.fspath(path))
        text = checkpoint_dir(path)
        weights_only = True if weights_only is None else weights_only
        location = Location.of(text, self.storage_options)
        if not dirs.is_committed(location):
            plain = _read_plain_file(location)
            if plain is not None:  # a file TorchCheckpointIO wrote: switching plug-ins keeps it loadable
                loaded: dict[str, Any] = torch.load(io.BytesIO(plain), map_location=map_location or "cpu",
                                                    weights_only=weights_only)
                return loaded
        state = load_whole(text, storage_options=self.storage_options, weights_only=weights_only)
        if map_location is not None:
            device = torch.device(map_location)
            state = _map_tensors(state, device)
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """(global rank 0) Delete the checkpoint ``path`` by dcp_ext's one
        deletion rule (:func:`dcp_ext.root.delete_checkpoint_dir`).

        A link (``ModelCheckpoint(save_last="link")``'s ``last.ckpt``) is
        removed and its target kept; a checkpoint this plug-in saved is
        un-committed, then its files go (a file of yours in it stays, and
        with it the directory).

        Raises:
            ForeignCheckpointError: ``path`` holds no checkpoint dcp_ext
                wrote (a plain directory, torch's own checkpoint, a file
                ``TorchCheckpointIO`` saved): nothing was deleted.
            CheckpointInUseError: A save to ``path`` is in progress.
        """
        dirs.remove_checkpoint(Location.of(path, self.storage_options))


def _read_plain_file(location: Location) -> bytes | None:
    """The bytes at ``location`` if it is a file (not a directory), else ``None``."""
    path = location.url  # normalized: without ``file://``
    if not _is_url(path):
        if not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            return f.read()
    parent, _, name = path.rstrip("/").rpartition("/")
    store = location.at(parent).open()
    return store.read_file(name) if name and store.exists(name) else None


def _map_tensors(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _map_tensors(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_tensors(v, device) for v in value]
    return value


class ModelParallelMixin:
    """What ``DcpExtModelParallelStrategy`` does, for both Lightning namespaces (documented in
    :mod:`dcp_ext.integrations.lightning`)."""

    def __init__(self, *args: Any, storage_options: dict[str, Any] | None = None, compression: Any = None,
                 overwrite: bool = True, io_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_options = dict(storage_options or {})
        self.compression = compression
        self.overwrite = overwrite
        self.io_config = io_config(io_options, "io_options")

    # These come from the strategy class this is mixed into.
    _save_distributed_checkpoint: bool
    model: Any
    optimizers: list[Any]
    lightning_module: Any
    is_global_zero: bool
    broadcast: Callable[..., Any]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        """(all ranks) Save a distributed checkpoint at ``filepath`` (every
        rank writes its shards; the coordinator ``meta.pt`` and the commit)."""
        path = str(self.broadcast(os.fspath(filepath)))
        if not self._save_distributed_checkpoint:
            if _is_url(path):
                raise InvalidPathError(
                    f"{path}: save_distributed_checkpoint=False writes one local file with torch.save; use "
                    f"save_distributed_checkpoint=True (the default) to save to a URL through dcp_ext", path)
            super().save_checkpoint(checkpoint, path)  # type: ignore[misc]
            return
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        meta = buffer.getvalue()
        dcp_ext.save(state, path, storage_options=_options(self.storage_options, storage_options),
                     overwrite=self.overwrite, compression=self.compression,
                     before_commit=_MetaWriter(meta), planner=save_planner("lightning", self.io_config),
                     config=self.io_config)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        """(all ranks) Load a distributed checkpoint into the model and
        optimizers in place (resharded to the current layout) and return the
        rest of it (``meta.pt``), as the stock strategy does.

        A path that is not a DCP checkpoint directory goes to the stock
        strategy (a full checkpoint file, local only).
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = checkpoint_dir(str(self.broadcast(os.fspath(checkpoint_path))))
        location = Location.of(path, self.storage_options)
        if not dirs.is_committed(location):
            if _is_url(path) or not os.path.isfile(path):
                raise CheckpointNotFoundError(
                    f"no checkpoint at {path}: neither a committed distributed checkpoint (no "
                    f"dcp_ext.metadata.json or .metadata) nor a checkpoint file", path)
            return super().load_checkpoint(path, weights_only)  # type: ignore[misc, no-any-return]
        strict = bool(getattr(self.lightning_module, "strict_loading", True))
        optimizers = [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, opt) for i, opt in enumerate(optimizers)})
        keys = {k for key in state for k in (key, f"{key}.")}
        dcp_ext.load(state, path, storage_options=self.storage_options,
                     planner=dcp_ext.LayoutLoadPlanner(strict=strict, keys=keys), config=self.io_config)
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(strict=strict))
        for i, opt in enumerate(optimizers):
            set_optimizer_state_dict(self.model, opt, optim_state_dict=state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        raw = location.open().read_file(META_FILE)
        metadata: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=weights_only)
        return metadata

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """(global rank 0) Delete the checkpoint at ``filepath`` by dcp_ext's
        one deletion rule (see ``DcpExtCheckpointIO.remove_checkpoint``),
        ``meta.pt`` with it; with ``save_distributed_checkpoint=False``, a
        single-file checkpoint (the stock strategy's ``torch.save`` file)
        goes as the stock strategy deletes it.

        Raises:
            ForeignCheckpointError: ``filepath`` holds no checkpoint dcp_ext
                wrote: nothing was deleted.
            CheckpointInUseError: A save to ``filepath`` is in progress.
        """
        if not self.is_global_zero:
            return
        path = os.fspath(filepath)
        if not self._save_distributed_checkpoint and not _is_url(path) and os.path.isfile(path) \
                and not os.path.islink(path):
            super().remove_checkpoint(filepath)  # type: ignore[misc]
            return
        dirs.remove_checkpoint(Location.of(path, self.storage_options), extra_files=(META_FILE,))


class _MetaWriter:
    """``before_commit`` hook: ``meta.pt`` into the checkpoint, before its
    commit marker (a class, not a closure, so the writer still pickles)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __call__(self, store: Any) -> None:
        store.write_file(META_FILE, self.data)
