"""What the framework adapters need of a checkpoint directory, on any storage.

Frameworks test, list and delete checkpoint directories with ``os.path`` or
fsspec without options, so on an S3 endpoint that needs ``storage_options``
(or a compressed dcp_ext checkpoint, which has no torch ``.metadata`` yet)
they see nothing. These helpers do the same through dcp_ext's stores, on a
:class:`~dcp_ext.storage.Location` the adapter makes of the path and its
``storage_options``; deletion goes by dcp_ext's one rule
(:func:`dcp_ext.root.delete_checkpoint_dir`), never by a recursive delete.
Any rank may call them; none is collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection
from typing import Any

from dcp_ext._runtime import torch_notices_quieted
from dcp_ext.errors import DcpExtError, PostCommitError, unwrap_checkpoint_exception
from dcp_ext.metadata import METADATA_FILE, TORCH_METADATA_FILE
from dcp_ext.root import delete_checkpoint_dir
from dcp_ext.storage import Location, join_path

__all__ = [
    "COMMIT_MARKERS",
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


def join(path: str | os.PathLike[str], name: str) -> str:
    """``path/name`` for local paths and URLs alike (URLs stay URLs)."""
    return join_path(path, name)


def exists(location: Location) -> bool:
    """Whether ``location`` is a directory (or a prefix holding objects)."""
    return location.open().root_exists()


def is_committed(location: Location) -> bool:
    """Whether ``location`` holds a committed checkpoint (any of :data:`COMMIT_MARKERS`)."""
    store = location.open()
    return any(store.exists(marker) for marker in COMMIT_MARKERS)


def child_dirs(location: Location) -> list[str]:
    """Names of the directories directly under ``location`` (``[]`` if it does not exist)."""
    store = location.open()
    if not store.root_exists():
        return []
    return sorted(store.list_dirs())


def remove_checkpoint(location: Location, extra_files: Collection[str] = ()) -> None:
    """Delete the checkpoint directory at ``location`` by dcp_ext's one deletion rule
    (:func:`dcp_ext.root.delete_checkpoint_dir`): a symbolic link is removed,
    not followed; only a checkpoint dcp_ext wrote is deleted, un-committed
    first, and of it only the files dcp_ext (or the adapter, ``extra_files``)
    wrote. A missing directory is not an error.

    Raises:
        ForeignCheckpointError: ``location`` holds no checkpoint dcp_ext wrote
            (torch's own, a plain directory, a file); nothing was deleted.
        CheckpointInUseError: A save to ``location`` is in progress; nothing was deleted.
    """
    delete_checkpoint_dir(location, extra_files=extra_files)


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
