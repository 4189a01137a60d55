"""What crashed saves, deletions and compactions left in a root, removed by the one rule: :class:`LeftoverCleanup`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError
from ..guard import LOCK_FILE, RootScan, SaveLock, file_state, lock_state, stale_lock_seconds
from ..layout import (
    DATA_SUFFIX,
    PARTIAL_SUFFIX,
    RETIRED_FILE,
    is_valid_tag,
    partial_dir,
    strays_marker_tag,
    tags_of_partial_dirs,
)
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE, decode_metadata
from ..metadata.document import REFERENCE_PREFIX
from ..storage import TMP_MARK, Store
from ._deletion import TagDirectories

__all__ = ["LeftoverCleanup", "LeftoverReport"]

log = logging.getLogger("dcp_ext.root")


@dataclass(frozen=True)
class LeftoverReport:
    """What :meth:`CheckpointRoot.remove_leftovers` removed.

    Attributes:
        temp_files: Temporary files in the root (crashed full saves, ``newest`` writes).
        uncommitted: Tags whose partial directory never committed and whose lock is not live.
        uploads: Incomplete multipart uploads aborted (object stores), by object name.
        retired: Retired directories removed because no committed checkpoint
            refers to their files any more (incremental saves).
        strays: Data files removed from committed directories that no longer
            name them (killed compactions and overwrites), as ``dir/file``.
    """

    temp_files: tuple[str, ...] = ()
    uncommitted: tuple[str, ...] = ()
    uploads: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()
    strays: tuple[str, ...] = ()


class LeftoverCleanup:
    """Leftovers of one root (one process; every save's coordinator runs it after its commit).

    Args:
        tags: The root's tag directories.
    """

    def __init__(self, tags: TagDirectories) -> None:
        self.tags = tags
        self.store = tags.root

    def remove_leftovers(self, current: str | None = None) -> LeftoverReport:
        """Delete what crashed saves, deletions and compactions left, by the one rule.

        * temporary files in the root older than the stale-lock limit;
        * partial directories that never committed and carry dcp_ext's mark
          (an abandoned or released save lock), or are empty;
        * incomplete multipart uploads older than the stale-lock limit;
        * files of retired directories that nothing refers to any more;
        * data files of committed directories that their metadata no longer
          names (a compaction or overwrite killed before its tidying step,
          marked in the root by :func:`strays_marker`).

        A directory whose save lock is live, the tag ``current`` being saved,
        any directory with torch's ``.metadata`` and any without dcp_ext's
        mark are never touched.
        """
        names, dirs = self.store.list_entries()
        temp_files = self._remove_stale_temp_files(names)
        candidates: dict[str, str] = {}
        for tag in tags_of_partial_dirs(dirs):
            if tag == current:
                continue
            kind = self._leftover_kind(self.tags.partial_store(tag))
            if kind is not None:
                candidates[tag] = kind
        markers: dict[str, str] = {}
        for name in names:
            marked = strays_marker_tag(name)
            if marked is not None and marked != current:
                if partial_dir(marked) in dirs:
                    markers[marked] = name
                else:
                    self.store.delete(name)  # its directory is gone
        swept = self.sweep(candidates, markers) if candidates or markers else LeftoverReport()
        uploads = []
        now = time.time()
        for upload in self.store.list_incomplete_uploads():
            directory = upload.name.partition("/")[0]
            tag = directory[: -len(PARTIAL_SUFFIX)] if directory.endswith(PARTIAL_SUFFIX) else ""
            if now - upload.initiated < stale_lock_seconds():
                continue  # may belong to a save in flight
            if tag and (tag == current or (is_valid_tag(tag) and _lock_live(self.tags.partial_store(tag)))):
                continue
            log.info("aborting incomplete upload of %s started %.0f s ago", upload.name, now - upload.initiated)
            self.store.abort_upload(upload)
            uploads.append(upload.name)
        return LeftoverReport(tuple(temp_files), swept.uncommitted, tuple(uploads), swept.retired, swept.strays)

    def _remove_stale_temp_files(self, names: list[str]) -> list[str]:
        """Delete temporary files in the root older than the stale-lock limit
        (a younger one may be another job's write in flight)."""
        removed = []
        for name in names:
            if TMP_MARK not in name:
                continue
            try:
                modified = self.store.modified(name)
            except CheckpointNotFoundError:
                continue
            if modified is not None and time.time() - modified < stale_lock_seconds():
                continue
            self.store.delete(name)
            removed.append(name)
        return removed

    @staticmethod
    def _leftover_kind(store: Store) -> str | None:
        """``"crashed"``, ``"retired"``, ``"empty"``, or ``None`` when the
        directory is not a leftover: committed (by dcp_ext or torch), saved
        by a live save, or without dcp_ext's mark."""
        if store.exists(METADATA_FILE) or store.exists(TORCH_METADATA_FILE):
            _remove_dead_lock_temporaries(store)
            return None
        if store.exists(RETIRED_FILE):
            return "retired"
        state = lock_state(store)
        if state is not None:
            return None if state.live else "crashed"
        names = store.list_tree()
        if names and all(_is_dead_lock_temporary(store, name) for name in names):
            return "crashed"  # killed between writing its lock record and linking it into place
        return None if names else "empty"

    def sweep(self, candidates: dict[str, str], markers: dict[str, str]) -> LeftoverReport:
        """Lock the leftover ``candidates`` (tag -> kind) and the directories
        with strays ``markers`` (tag -> root-level marker), scan, and delete
        what the one rule allows."""
        locks: dict[str, SaveLock] = {}
        try:
            for tag in {*candidates, *markers}:
                lock = self.tags.lock(tag, "clean up", refuse=False)
                if lock is not None:
                    locks[tag] = lock
            if not locks:
                return LeftoverReport()
            scan = self.tags.scan()
            uncommitted: list[str] = []
            retired: list[str] = []
            strays: list[str] = []
            for tag in sorted(locks):
                store = self.tags.partial_store(tag)
                if tag in markers:
                    strays += self._remove_strays(tag, scan, markers[tag])
                kind = candidates.get(tag)
                if kind is None or tag in scan.committed or store.exists(TORCH_METADATA_FILE):
                    continue  # committed meanwhile (a save took the abandoned lock over)
                if kind != "retired":
                    log.info("removing %s: a save that never committed", partial_dir(tag))
                self.tags.clear(tag, scan.referenced(), locks.pop(tag))
                if kind != "retired":
                    uncommitted.append(tag)
                elif not store.exists(RETIRED_FILE):
                    retired.append(tag)
            return LeftoverReport(uncommitted=tuple(uncommitted), retired=tuple(retired), strays=tuple(strays))
        finally:
            for lock in locks.values():
                lock.release()

    def _remove_strays(self, tag: str, scan: RootScan, marker: str) -> list[str]:
        """(holding the lock of ``{tag}_partial``) Delete the data files of the
        committed ``tag`` that its metadata does not name and nothing refers
        to, then the root-level ``marker``; a marker of a directory that is
        gone is deleted, one of an uncommitted directory stays for its cleanup."""
        store = self.tags.partial_store(tag)
        if tag not in scan.committed:
            if not store.list_tree():
                self.store.delete(marker)
            return []
        if scan.pinned_by(tag) is not None:
            return []
        where = store.describe(METADATA_FILE)
        own = {name for name in decode_metadata(store.read_file(METADATA_FILE), where).files
               if not name.startswith(REFERENCE_PREFIX)}
        directory = partial_dir(tag)
        referenced = {file for d, file in scan.referenced(exclude={tag}) if d == directory}
        removed = []
        for name in store.list_tree():
            if name.endswith(DATA_SUFFIX) and name not in own and name not in referenced:
                store.delete(name)
                removed.append(f"{directory}/{name}")
        if not any(n.endswith(DATA_SUFFIX) and n not in own for n in store.list_tree()):
            self.store.delete(marker)
        return removed


def _lock_live(store: Store) -> bool:
    state = lock_state(store)
    return state is not None and state.live


def _remove_dead_lock_temporaries(store: Store) -> None:
    """(local file systems) Delete the temporary files of save locks that a
    killed process left in the committed directory ``store`` (a lock appears
    whole through a temporary file ``link``ed into place; a process killed
    in between leaves it). Each holds its lock record: it goes once the
    lock rule says its writer is gone. Object stores write locks in one
    conditional PUT and leave none."""
    if store.kind != "local":
        return
    for name in store.list_names():
        if _is_dead_lock_temporary(store, name):
            log.info("removing %s: a lock temporary whose writer is gone", store.describe(name))
            store.delete(name)


def _is_dead_lock_temporary(store: Store, name: str) -> bool:
    """``name`` is the temporary file of a save lock (local file systems)
    whose writer, by the lock rule, is gone."""
    if store.kind != "local" or not name.startswith(LOCK_FILE + TMP_MARK):
        return False
    state = file_state(store, name)
    return state is not None and not state.live
