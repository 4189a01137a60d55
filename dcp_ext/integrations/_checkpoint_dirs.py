"""What the framework adapters need of a checkpoint directory, on any storage.

Frameworks test, list and delete checkpoint directories with ``os.path`` or
fsspec without options, so on an S3 endpoint that needs ``storage_options``
(or a compressed dcp_ext checkpoint, which has no torch ``.metadata`` yet)
they see nothing. These helpers do the same through dcp_ext's stores, with
the caller's ``storage_options``. Any rank may call them; none is collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from dcp_ext._runtime import torch_notices_quieted
from dcp_ext.config import IOConfig
from dcp_ext.errors import DcpExtError, PostCommitError, unwrap_checkpoint_exception
from dcp_ext.metadata import METADATA_FILE, TORCH_METADATA_FILE
from dcp_ext.storage import Store, join_path, open_store

__all__ = [
    "COMMIT_MARKERS",
    "open_dir",
    "exists",
    "is_committed",
    "child_dirs",
    "join",
    "remove_checkpoint",
    "torch_notices_quieted",
    "save_alone",
]

log = logging.getLogger("dcp_ext.integrations")

#: Files whose presence means "a committed checkpoint": dcp_ext's commit
#: marker first (every dcp_ext checkpoint, compressed ones included), then
#: torch's ``.metadata`` (torch's writers, and dcp_ext's uncompressed ones),
#: then a Hugging Face index (torchtitan's ``last_save_in_hf``).
COMMIT_MARKERS = (METADATA_FILE, TORCH_METADATA_FILE, "model.safetensors.index.json")


def open_dir(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Store:
    """The dcp_ext store of directory ``path`` (local, ``s3://`` or fsspec)."""
    return open_store(path, IOConfig.from_env(), storage_options)


def join(path: str | os.PathLike[str], name: str) -> str:
    """``path/name`` for local paths and URLs alike (URLs stay URLs)."""
    return join_path(path, name)


def exists(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` is a directory (or a prefix holding objects)."""
    return open_dir(path, storage_options).root_exists()


def is_committed(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``path`` holds a committed checkpoint (any of :data:`COMMIT_MARKERS`)."""
    store = open_dir(path, storage_options)
    return any(store.exists(marker) for marker in COMMIT_MARKERS)


def child_dirs(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Names of the directories directly under ``path`` (``[]`` if it does not exist)."""
    store = open_dir(path, storage_options)
    if not store.root_exists():
        return []
    return sorted(store.list_dirs())


def remove_checkpoint(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> None:
    """Delete the checkpoint directory ``path``: its commit markers first
    (torch's ``.metadata``, then dcp_ext's), so a half-deleted directory is
    never taken for a checkpoint, then every other file, then the directory.
    A missing directory is not an error.
    """
    store = open_dir(path, storage_options)
    if not store.root_exists():
        return
    for marker in (TORCH_METADATA_FILE, METADATA_FILE, "model.safetensors.index.json"):
        store.delete(marker)
    for name in store.list_tree():
        store.delete(name)
    for name in store.list_dirs():  # empty sub-directories (local key prefixes)
        with contextlib.suppress(OSError):
            open_dir(join(path, name), storage_options).remove_root_if_empty()
    store.remove_root_if_empty()


def save_alone(state: dict[str, Any], writer: Any) -> Any:
    """(one rank, on its own) ``dcp.save(..., no_dist=True)`` with ``writer``:
    for frameworks that save from rank 0 only (Lightning's ``CheckpointIO``
    under DDP). Raises dcp_ext's error instead of DCP's ``CheckpointException``
    and deletes the files of a save that failed before its commit.

    Returns:
        The checkpoint's DCP metadata.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    try:
        with torch_notices_quieted():
            return save(state, storage_writer=writer, no_dist=True)
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        inner = unwrap_checkpoint_exception(exc)
        if not isinstance(inner, PostCommitError):
            with contextlib.suppress(Exception):
                writer.remove_own_files()
        if isinstance(inner, Exception):
            raise inner from inner.__cause__
        raise DcpExtError(f"saving {writer.checkpoint_id} failed: {exc}", writer.checkpoint_id) from exc
