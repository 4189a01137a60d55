"""Deleting one standalone checkpoint directory by the one rule: :func:`delete_checkpoint_dir`.

A standalone checkpoint is a directory a framework names and deletes itself,
outside any checkpoint root: Lightning's ``epoch=3-step=800.ckpt`` (and its
``last.ckpt`` link), torchtitan's ``step-500``. The framework adapters delete
them only through :func:`delete_checkpoint_dir`, which applies the rule
:class:`~dcp_ext.root._deletion.TagDirectories` applies inside a root:

* delete only a checkpoint dcp_ext wrote: a directory holding dcp_ext's
  commit marker (``dcp_ext.metadata.json``) or a save lock
  (``.dcp_ext.saving``, which a failed save leaves as its mark); anything
  else, torch's own checkpoints included, is refused with
  :class:`~dcp_ext.errors.ForeignCheckpointError` and left untouched;
* a symbolic link is removed, never followed: its target stays whole;
* take the directory's save lock (a live save there:
  :class:`~dcp_ext.errors.CheckpointInUseError`), un-commit (torch's
  ``.metadata``, then dcp_ext's) before any data file goes, so a deletion
  cut off at any point never leaves a directory that looks committed;
* then delete the data files the metadata names, dcp_ext's own files and
  temporaries, and the files the caller's adapter wrote through dcp_ext
  (Lightning's ``meta.pt``): nothing else, so a user's file in the
  directory stays, and with it the directory.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .._runtime import crash_point
from ..config import IOConfig
from ..errors import (
    CheckpointCorruptError,
    CheckpointInProgressError,
    CheckpointInUseError,
    CheckpointNotFoundError,
    ForeignCheckpointError,
    InvalidPathError,
    UnsupportedCodecError,
)
from ..guard import LOCK_FILE, SaveLock, file_state, stale_lock_seconds
from ..layout import DATA_SUFFIX, NEWEST_FILE, PARTIAL_SUFFIX, PARTITION_FILE, USER_CONTENT_FILE
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE, decode_metadata
from ..metadata.document import REFERENCE_PREFIX
from ..storage import Location, Store, TMP_MARK

__all__ = ["DirDeletion", "delete_checkpoint_dir"]

log = logging.getLogger("dcp_ext.root")

#: dcp_ext's files beside the data, deleted with it, after the commit
#: markers (see :func:`delete_checkpoint_dir`).
_OWN_FILES = (PARTITION_FILE, USER_CONTENT_FILE)
#: The commit markers and the lock, which go at their own moments.
_MARKERS = frozenset((TORCH_METADATA_FILE, METADATA_FILE, LOCK_FILE))


@dataclass(frozen=True)
class DirDeletion:
    """What :func:`delete_checkpoint_dir` did.

    Attributes:
        path: The path as given (normalized).
        unlinked: ``path`` was a symbolic link: the link alone was removed.
        deleted: The files deleted, in the order they went (commit markers first).
        kept: Files left in the directory because dcp_ext did not write
            them (the directory stays with them; without any, it is gone).
    """

    path: str
    unlinked: bool = False
    deleted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def delete_checkpoint_dir(
    path: str | os.PathLike[str] | Location,
    storage_options: dict[str, Any] | None = None,
    *,
    extra_files: Collection[str] = (),
    config: IOConfig | None = None,
) -> DirDeletion:
    """(one process) Delete the standalone checkpoint directory ``path`` by the one rule (module doc).

    Args:
        path: Local path (a symbolic link is removed, not followed),
            ``s3://`` or fsspec URL; a trailing ``/`` changes nothing. Or a
            :class:`~dcp_ext.storage.Location` (then its storage options and
            config are used).
        storage_options: fsspec/s3fs options.
        extra_files: Names the caller's adapter wrote into the checkpoint
            through dcp_ext besides DCP's items (Lightning's ``meta.pt``,
            written before the commit), deleted with it.
        config: I/O tunables (default: from the environment).

    Returns:
        What was deleted and kept. A missing directory deletes nothing and
        is not an error.

    Raises:
        ForeignCheckpointError: ``path`` holds no checkpoint dcp_ext wrote:
            a checkpoint of torch's own writer, a plain directory, a file.
            Nothing was deleted.
        CheckpointInUseError: A live save holds the directory's save lock.
            Nothing was deleted.
        InvalidPathError: ``path`` is a tag directory of a checkpoint root
            (delete it with :meth:`CheckpointRoot.delete`, which keeps the
            files the root's other checkpoints refer to).
    """
    location = Location.of(path, storage_options, config)
    text = location.url
    is_url = "://" in text
    if not is_url:
        bare = text.rstrip("/") or text  # "last.ckpt/" would resolve the link; the user named the link
        if os.path.islink(bare):
            target = os.readlink(bare)
            os.unlink(bare)
            log.info("removed the link %s; its target %s stays", bare, target)
            return DirDeletion(text, unlinked=True)
        if os.path.lexists(bare) and not os.path.isdir(bare):
            raise ForeignCheckpointError(
                f"{bare} is a file, not a checkpoint directory dcp_ext wrote (a torch.save file, such as "
                f"Lightning's TorchCheckpointIO writes?); dcp_ext deletes only checkpoints it wrote and deleted "
                f"nothing: delete it yourself if you mean to", bare)
    store = location.open()
    if not store.root_exists():
        if is_url:
            _refuse_object(location)
        return DirDeletion(text)
    _check_ours(location, store)
    lock = SaveLock(store, f"delete-{uuid.uuid4().hex}", store.config)
    try:
        lock.acquire()  # an abandoned one is taken over: a failed save's leftovers
    except CheckpointInProgressError as err:
        raise CheckpointInUseError(
            f"cannot delete {store.url} now: {err} Nothing was deleted; delete it once that save has ended.",
            store.url) from err
    deleted: list[str] = []
    uncommitted = finished = False
    try:
        listed = store.list_tree()  # stable while we hold the lock; local: never inside a linked directory
        if METADATA_FILE not in listed and TORCH_METADATA_FILE in listed:
            _check_ours(location, store)  # a torch writer's meanwhile: refused, nothing changed
        own = _files_to_delete(store, listed, extra_files)  # read before the commit markers go
        for name in (TORCH_METADATA_FILE, METADATA_FILE):  # un-commit: the reverse of the commit order
            uncommitted = True
            if name in listed:
                store.delete(name)
                deleted.append(name)
        crash_point("mid_retention")
        for name in listed:
            if name not in _MARKERS and (name in own or _is_temporary(store, name)):
                store.delete(name)
                deleted.append(name)
        _abort_stale_uploads(store)
        kept = tuple(name for name in listed if name not in _MARKERS and name not in deleted)
        finished = True
    finally:
        # Cut short after the un-commit, the lock stays (released) as dcp_ext's
        # mark on what is left, so that the next attempt deletes it.
        lock.release(keep_mark=uncommitted and not finished, verify=False)
    store.remove_root_if_empty()
    if kept:
        log.info("deleted the checkpoint %s but kept %d file(s) dcp_ext did not write: %s", store.url, len(kept),
                 ", ".join(kept[:5]) + (" ..." if len(kept) > 5 else ""))
    return DirDeletion(text, deleted=tuple(deleted), kept=kept)


def _check_ours(location: Location, store: Store) -> None:
    """Raise unless ``store`` (opened at ``location``) holds dcp_ext's commit marker or a save lock
    (see :func:`delete_checkpoint_dir`)."""
    if store.exists(METADATA_FILE):
        return
    if store.exists(TORCH_METADATA_FILE):  # dcp_ext writes torch's marker after its own, removes it first
        raise ForeignCheckpointError(
            f"{store.url} is a checkpoint written by torch's own writer (it has {TORCH_METADATA_FILE} and no "
            f"{METADATA_FILE}); dcp_ext deletes only checkpoints it wrote and deleted nothing: delete it "
            f"yourself if you mean to", store.url)
    if store.exists(LOCK_FILE):
        return
    name = location.name
    parent = _parent(location.url)
    if name.endswith(PARTIAL_SUFFIX) and parent is not None:
        if location.at(parent).open().exists(NEWEST_FILE):
            tag = name[: -len(PARTIAL_SUFFIX)]
            raise InvalidPathError(
                f"{store.url} is the directory of tag {tag!r} in the checkpoint root {parent}; delete it with "
                f"dcp_ext.CheckpointRoot({parent!r}).delete({tag!r}), which keeps the files the root's other "
                f"checkpoints refer to. Nothing was deleted.", store.url)
    raise ForeignCheckpointError(
        f"{store.url} holds no checkpoint dcp_ext wrote (neither {METADATA_FILE} nor a save lock "
        f"{LOCK_FILE}); dcp_ext deletes only checkpoints it wrote and deleted nothing: check the path, or "
        f"delete the directory yourself if you mean to", store.url)


def _parent(text: str) -> str | None:
    """The directory holding ``text`` (``None``: ``text`` is a bucket)."""
    bare = text.rstrip("/")
    if "://" not in bare:
        return os.path.dirname(bare) or "."
    parent = bare.rpartition("/")[0]
    return parent if parent.partition("://")[2] else None


def _refuse_object(location: Location) -> None:
    """(a URL naming no directory) Raise if it names a file (object): not a checkpoint dcp_ext wrote."""
    text = location.url
    parent = _parent(text)
    name = location.name
    if parent is not None and location.at(parent).open().exists(name):
        raise ForeignCheckpointError(
            f"{text} is a file, not a checkpoint directory dcp_ext wrote (a torch.save file, such as "
            f"Lightning's TorchCheckpointIO writes?); dcp_ext deletes only checkpoints it wrote and deleted "
            f"nothing: delete it yourself if you mean to", text)


def _files_to_delete(store: Store, listed: Collection[str], extra_files: Collection[str]) -> set[str]:
    """(holding the lock) The names in ``store`` that dcp_ext wrote: the data
    files its metadata names (not those of other checkpoints it refers to),
    its own files and ``extra_files``. Without readable metadata (a failed
    save's leftovers, or damaged metadata), the data files are the files
    named like dcp_ext's (``*.distcp``), as leftover cleanup takes them."""
    names = {*_OWN_FILES, *extra_files}
    if METADATA_FILE in listed:
        data = store.read_file(METADATA_FILE)
        where = store.describe(METADATA_FILE)
        try:
            files = decode_metadata(data, where).files
        except (CheckpointCorruptError, UnsupportedCodecError) as err:
            log.warning("deleting %s by its file names (*%s): its metadata cannot be read: %s", store.url,
                        DATA_SUFFIX, err)
        else:
            return names | {name for name in files if not name.startswith(REFERENCE_PREFIX)}
    return names | {name for name in listed if name.endswith(DATA_SUFFIX)}


def _is_temporary(store: Store, name: str) -> bool:
    """``name`` is a temporary file of dcp_ext's; a lock's temporary only once
    its writer is gone (a save racing for the lock may be linking it now)."""
    if TMP_MARK not in name:
        return False
    if not name.startswith(LOCK_FILE + TMP_MARK):
        return True
    try:
        state = file_state(store, name)
    except CheckpointNotFoundError:
        return False
    return state is not None and not state.live


def _abort_stale_uploads(store: Store) -> None:
    """(object stores) Abort the incomplete multipart uploads under the
    directory older than the stale-lock limit (younger ones may still belong
    to a rank of a failed save that has not stopped yet)."""
    now = time.time()
    for upload in store.list_incomplete_uploads():
        if now - upload.initiated >= stale_lock_seconds():
            log.info("aborting incomplete upload of %s", store.describe(upload.name))
            store.abort_upload(upload)
