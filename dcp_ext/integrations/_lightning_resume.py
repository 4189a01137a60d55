"""Resuming Lightning runs from checkpoints on S3 and other URLs, for both namespaces.

Lightning resolves ``fit(ckpt_path="last")`` with fsspec and no options: its
``ModelCheckpoint`` lists ``dirpath`` (and drops the ``s3://`` of what it
lists), then the trainer asks each candidate's file system when it was
modified. On an object store that found nothing, and the run started over
from step 0 without an error (issue 43). :class:`ModelCheckpointMixin` (the
``DcpExtModelCheckpoint`` callbacks) fixes both halves:

* it gives Lightning's fsspec calls the ``storage_options`` (endpoint,
  credentials) of its ``dirpath``'s scheme, by installing them as fsspec's
  defaults for that scheme (``fsspec.config.conf``) when it is made: Lightning
  builds its file systems without options, and these are what it then gets;
* it finds the ``last`` checkpoints itself, through dcp_ext's stores, and
  names each committed checkpoint directory by its commit marker
  (``.../last.ckpt/dcp_ext.metadata.json``), a file whose modification time an
  object store can tell; the plug-in and the strategy load a marker's directory.

:func:`load_module` is ``LightningModule.load_from_checkpoint`` for directory
checkpoints, local or on any URL.
"""

from __future__ import annotations

import importlib
import io
import logging
import os
import re
from typing import Any

import fsspec
import torch

from dcp_ext.errors import CheckpointNotFoundError
from dcp_ext.metadata import METADATA_FILE
from dcp_ext.storage import Location
from dcp_ext.whole_state import load_whole

from . import _checkpoint_dirs as dirs

__all__ = ["ModelCheckpointMixin", "checkpoint_dir", "install_fsspec_defaults", "load_module"]

log = logging.getLogger("dcp_ext.integrations")

#: ``meta.pt`` of the strategy's distributed checkpoints (see :mod:`dcp_ext.integrations._lightning_common`).
_META_FILE = "meta.pt"


def checkpoint_dir(path: str | os.PathLike[str]) -> str:
    """The checkpoint directory a path names: itself, or the directory of a
    commit marker (what :meth:`ModelCheckpointMixin._find_last_checkpoints` gives)."""
    text = os.fspath(path)
    marker = "/" + METADATA_FILE
    return text[: -len(marker)] if text.endswith(marker) else text


def install_fsspec_defaults(location: Location) -> None:
    """Make ``location``'s storage options fsspec's defaults for its URL's
    scheme, so that file systems Lightning builds without options reach the
    same endpoint with the same credentials. Defaults already set for the
    scheme that differ are replaced, with a warning."""
    url, storage_options = location.url, location.storage_options
    if "://" not in url or url.startswith("file://") or not storage_options:
        return
    protocol = url.split("://", 1)[0]
    conf = fsspec.config.conf
    current = conf.get(protocol)
    if current == storage_options:
        return
    if current:
        log.warning("replacing fsspec's defaults for %s:// with the storage_options of %s", protocol, url)
    conf[protocol] = dict(storage_options)


class ModelCheckpointMixin:
    """What ``DcpExtModelCheckpoint`` adds to Lightning's ``ModelCheckpoint``
    (documented in :mod:`dcp_ext.integrations.lightning`).

    Args:
        storage_options: Options of ``dirpath``'s store (S3 endpoint,
            credentials...): given to Lightning's own fsspec calls too (see
            the module docstring). The plug-in's or strategy's options.
    """

    # These come from Lightning's ModelCheckpoint.
    dirpath: Any
    CHECKPOINT_NAME_LAST: str
    FILE_EXTENSION: str

    def __init__(self, *args: Any, storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.storage_options = dict(storage_options or {})
        dirpath = kwargs.get("dirpath", args[0] if args else None)
        if dirpath is not None and "://" in os.fspath(dirpath):  # a local dirpath needs no fsspec defaults
            install_fsspec_defaults(Location.of(dirpath, self.storage_options))
        super().__init__(*args, **kwargs)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """(every rank) The ``last`` checkpoints in ``dirpath``, as paths the
        trainer can ask the modification time of (commit markers on URLs)."""
        dirpath = None if self.dirpath is None else os.fspath(self.dirpath)
        if dirpath is None or "://" not in dirpath or dirpath.startswith("file://"):
            return super()._find_last_checkpoints(trainer)  # type: ignore[misc, no-any-return]
        pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?{re.escape(self.FILE_EXTENSION)}$")
        where = Location.of(dirpath, self.storage_options)
        store = where.open()
        if not store.root_exists():
            return set()
        names, directories = store.list_entries()
        found = {f"{dirpath.rstrip('/')}/{name}/{METADATA_FILE}" for name in directories
                 if pattern.match(name) and where.child(name).open().exists(METADATA_FILE)}
        found |= {f"{dirpath.rstrip('/')}/{name}" for name in names if pattern.match(name)}  # TorchCheckpointIO files
        return found


def load_module(cls: Any, path: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None,
                strict: bool | None = None, weights_only: bool = True, **kwargs: Any) -> Any:
    """(one process) ``cls.load_from_checkpoint(path)`` for a checkpoint
    directory written by ``DcpExtCheckpointIO`` or ``DcpExtModelParallelStrategy``,
    local or on any URL (Lightning's own reads one file with ``torch.load``:
    ``IsADirectoryError`` locally, ``FileNotFoundError`` on S3).

    Args:
        cls: The ``LightningModule`` subclass.
        path: The checkpoint directory (or its commit marker).
        storage_options: Its store's options.
        strict: As for ``load_from_checkpoint``.
        weights_only: Decode non-tensor values as plain data only (the
            default; ``False`` for checkpoints you trust).
        kwargs: Hyper-parameters that replace the saved ones.

    Returns:
        The module, on the CPU, with the checkpoint's weights.

    Raises:
        CheckpointNotFoundError: No committed checkpoint at ``path``.
    """
    namespace = "pytorch_lightning" if any(c.__module__.split(".")[0] == "pytorch_lightning"
                                           for c in cls.__mro__) else "lightning.pytorch"
    _load_state = importlib.import_module(f"{namespace}.core.saving")._load_state

    text = checkpoint_dir(path)
    location = Location.of(text, storage_options)
    if not dirs.is_committed(location):
        raise CheckpointNotFoundError(f"no committed dcp_ext checkpoint at {text}", text)
    state = load_whole(text, storage_options=location.storage_options, weights_only=weights_only)
    store = location.open()
    if store.exists(_META_FILE):  # the strategy's layout: tensors in the shards, the rest in meta.pt
        meta = torch.load(io.BytesIO(store.read_file(_META_FILE)), weights_only=weights_only)
        state = {**meta, "state_dict": state["state_dict"]}
    state.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    state[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    return _load_state(cls, state, strict=strict, **kwargs)
