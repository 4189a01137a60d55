"""Locking and clearing a tag's directory by the root's one rule: :class:`TagDirectories`.

The primitives every deleting step of :mod:`dcp_ext.root` shares (deletion,
retention, compaction, leftover cleanup): take a directory's save lock, read
what must stay (:func:`dcp_ext.guard.scan_root`), un-commit and delete.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Collection

from .._runtime import crash_point
from ..errors import CheckpointInProgressError, CheckpointInUseError
from ..guard import RootScan, SaveLock, scan_root
from ..layout import (
    DATA_SUFFIX,
    PARTITION_FILE,
    RETIRED_FILE,
    USER_CONTENT_FILE,
    partial_dir,
)
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE
from ..storage import TMP_MARK, Store

__all__ = ["TagDirectories"]

log = logging.getLogger("dcp_ext.root")

# Files dcp_ext writes in a partial checkpoint directory beside its data
# files; deletion touches nothing else. Torch's .metadata is removed first
# when a checkpoint is un-committed, dcp_ext's own metadata (the commit) last.
_OWN_FILES = (TORCH_METADATA_FILE, METADATA_FILE, PARTITION_FILE, USER_CONTENT_FILE)


class TagDirectories:
    """The ``{tag}_partial`` directories of one root, as deleting steps change them (one process).

    Args:
        root: The root's store.
        partial_store: The store of ``{tag}_partial``.
        partial_url: Its URL.
    """

    def __init__(self, root: Store, partial_store: Callable[[str], Store], partial_url: Callable[[str], str]) -> None:
        self.root = root
        self.partial_store = partial_store
        self.partial_url = partial_url

    def scan(self) -> RootScan:
        """What may not be deleted or rewritten now (:func:`dcp_ext.guard.scan_root`):
        call it *after* taking the save locks of the directories you will change."""
        return scan_root(self.root, self.partial_store)

    def lock(self, tag: str, purpose: str, refuse: bool, held: dict[str, str] | None = None) -> SaveLock | None:
        """Take the save lock of ``{tag}_partial`` for a deleting step (taking
        over an abandoned one); ``None`` (or, with ``refuse``,
        :class:`CheckpointInUseError`) when a live save holds it, whose
        reason then goes into ``held`` under ``tag``."""
        lock = SaveLock(self.partial_store(tag), f"{purpose}-{uuid.uuid4().hex}")
        try:
            lock.acquire()
        except CheckpointInProgressError as err:
            if refuse:
                raise CheckpointInUseError(f"cannot {purpose} {tag!r} now: {err}", self.partial_url(tag)) from err
            log.info("not touching %s now (%s): %s", partial_dir(tag), purpose, err)
            if held is not None:
                held[tag] = str(err)
            return None
        return lock

    def clear(self, tag: str, referenced: Collection[tuple[str, str]], lock: SaveLock) -> None:
        """(holding ``lock``) Un-commit ``{tag}_partial`` (torch's metadata,
        then dcp_ext's: a half-deleted checkpoint is never mistaken for a
        committed one) and delete its files except the data files in
        ``referenced``: the directory then keeps only those, marked retired
        (:data:`RETIRED_FILE`, written before anything is deleted), until
        nothing refers to them. Releases ``lock``."""
        store = self.partial_store(tag)
        directory = partial_dir(tag)
        keep = {file for d, file in referenced if d == directory}
        try:
            if keep:
                store.write_file(RETIRED_FILE, json.dumps({"tag": tag, "kept": sorted(keep)}).encode())
            for name in _OWN_FILES:
                store.delete(name)
            crash_point("mid_retention")
            for name in store.list_tree():  # data files under key prefixes too
                if name in keep:
                    continue
                if name.endswith(DATA_SUFFIX) or TMP_MARK in name:
                    store.delete(name)
            if not keep:
                store.delete(RETIRED_FILE)
        finally:
            lock.release(verify=False)  # ours for the few requests above
        if not keep:
            store.remove_root_if_empty()
