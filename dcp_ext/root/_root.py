"""A checkpoint root on storage: its committed tags, ``newest``, deletion, leftovers, retention.

Used by :class:`~dcp_ext.CheckpointManager` (on the coordinator) and by the
CLI's ``ls``, ``prune`` and ``compact``; every method is plain I/O by one
process, no collectives. The layout it reads and writes is described in
:mod:`dcp_ext.layout`.

**The one rule for deleting or rewriting files in a root.** A file stays
while any committed checkpoint or any save in progress refers to it, and
only what dcp_ext wrote is ever deleted. Every step that deletes or
rewrites (:meth:`CheckpointRoot.delete`, retention, :meth:`CheckpointRoot.compact`,
leftover cleanup, and an ``overwrite=True`` save through
:class:`~dcp_ext.CheckpointWriter`) goes the same way:

1. take the save lock (:mod:`dcp_ext.guard._save_lock`) of every directory it will
   change, so that no save writes there meanwhile (a directory whose lock a
   live save holds is left alone, or the step is refused);
2. only then read the live leases of saves in flight (:mod:`dcp_ext.guard._leases`)
   and the committed checkpoints' references (:meth:`CheckpointRoot.scan`);
3. leave alone a checkpoint that a live save builds on (``compact`` and an
   overwrite are refused with :class:`~dcp_ext.errors.CheckpointInUseError`),
   and keep every data file a committed checkpoint refers to;
4. un-commit (metadata first), delete, release the locks.

A directory is dcp_ext's to clean up only if it carries dcp_ext's mark: its
metadata, a save lock (live, abandoned or released), or the retired marker.
A directory with torch's ``.metadata`` and no dcp_ext metadata is a torch
checkpoint: it is listed, loadable and never deleted by dcp_ext.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from .._runtime import crash_point
from ..config import IOConfig
from ..errors import (
    CheckpointInUseError,
    CheckpointNotFoundError,
    ForeignCheckpointError,
)
from ..full import FOLDER_SIDECAR
from ..guard import RootScan, SaveLock, committed_heads
from ..hf import HF_CONFIG_FILE, HF_INDEX_FILE, is_shard_name
from ..layout import (
    CHECKSUMS_SUFFIX,
    NEWEST_FILE,
    PARTIAL_SUFFIX,
    RETIRED_FILE,
    TagInfo,
    is_valid_tag,
    partial_dir,
    strays_marker,
    tags_of_partial_dirs,
    user_content_name,
    validate_tag,
)
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE
from ..storage import TMP_MARK, Location, Store
from ._cleanup import LeftoverCleanup, LeftoverReport
from ._compact import CompactReport, compact
from ._deletion import TagDirectories
from ._records import HeldRecord, break_record, list_records
from ._retention import RetentionPolicy, select_for_deletion

__all__ = ["CheckpointRoot", "LeftoverReport", "RetentionReport"]


@dataclass(frozen=True)
class RetentionReport:
    """What one pass of retention did.

    Attributes:
        deleted: The tags deleted (or that would be, in a dry run), oldest first.
        held: The tags due for deletion that were left for a later pass, each
            with why (a save in progress holds or builds on it: the lock or
            lease file, its holder and how to clear it).
    """

    deleted: tuple[str, ...] = ()
    held: tuple[tuple[str, str], ...] = ()


log = logging.getLogger("dcp_ext.root")


class CheckpointRoot:
    """The checkpoints under one root path.

    Args:
        root: Local path, ``s3://bucket/prefix``, any registered or fsspec
            URL, or a :class:`~dcp_ext.storage.Location` (then its storage
            options and config are used).
        config: I/O tunables.
        storage_options: The store's options.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Location,
        config: IOConfig | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        #: The root (URL, storage options, config).
        self.location = Location.of(root, storage_options, config)
        self.url = self.location.url
        """The root's URL or path, normalized."""
        self.config = self.location.config
        """The I/O tunables of every store this root opens."""
        self.storage_options = self.location.storage_options
        """The store's options."""
        self.store = self.location.open()
        """The store of the root directory itself (``newest``, the tag directories, leases)."""
        self._tags = TagDirectories(self.store, self.partial_store, self.partial_url)
        self._cleanup = LeftoverCleanup(self._tags)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the location only: the open store holds clients and sockets, and a copy in
        another process (a process-based upload's after-commit step) opens its own."""
        # The open store holds clients and sockets; a copy in another process
        # (a process-based upload's after-commit step) opens its own.
        return {"location": self.location}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Open the root again from its pickled location."""
        self.__init__(state["location"])  # type: ignore[misc]

    def partial_url(self, tag: str) -> str:
        """Where the partial checkpoint ``tag`` lives."""
        return self.partial_location(tag).url

    def partial_location(self, tag: str) -> Location:
        """The location of the partial checkpoint ``tag`` (this root's options)."""
        return self.location.child(partial_dir(tag))

    def partial_store(self, tag: str) -> Store:
        """The store of the partial checkpoint ``tag``'s directory (opened anew at each call)."""
        return self.partial_location(tag).open()

    def exists(self) -> bool:
        """Whether the root exists at all (a missing one is usually a mistyped path)."""
        return self.store.root_exists()

    # -- what is there ---------------------------------------------------------------
    def partial_tags(self, dirs: Iterable[str] | None = None) -> list[str]:
        """Tags of every ``{tag}_partial`` directory, committed or not
        (``dirs``: the root's directory listing, if the caller has it)."""
        return tags_of_partial_dirs(self.store.list_dirs() if dirs is None else dirs)

    def full_candidates(self) -> list[str]:
        """Files in the root that may be full checkpoints: not ``newest``, user
        content, hidden or temporary files."""
        return [
            name for name in self.store.list_names()
            if name != NEWEST_FILE and not name.startswith(("user_content_", ".")) and TMP_MARK not in name
            and not name.endswith(CHECKSUMS_SUFFIX)
        ]

    def hf_folders(self) -> list[str]:
        """Tags of the committed Hugging Face folders ``ROOT/{tag}/`` (full
        checkpoints saved with ``full_format="hf"``: their index exists)."""
        return [
            name for name in self.store.list_dirs()
            if not name.endswith(PARTIAL_SUFFIX) and is_valid_tag(name) and self.store.exists(f"{name}/{HF_INDEX_FILE}")
        ]

    def hf_store(self, tag: str) -> Store:
        """The folder ``ROOT/{tag}/`` of a Hugging Face export."""
        return self.location.child(validate_tag(tag)).open()

    def delete_hf_folder(self, tag: str) -> None:
        """Delete the files of the Hugging Face export ``ROOT/{tag}/``: the
        index first (the folder is then no committed export), its sidecar,
        the weights files, ``config.json`` and temporaries; any other file
        stays, and so does the folder if it holds one."""
        store = self.hf_store(tag)
        names = store.list_names()
        store.delete(HF_INDEX_FILE)
        for name in names:
            if name in (FOLDER_SIDECAR, HF_CONFIG_FILE) or is_shard_name(name) or TMP_MARK in name:
                store.delete(name)
        store.remove_root_if_empty()

    def committed(self) -> list[TagInfo]:
        """Committed partial checkpoints written by dcp_ext, oldest first."""
        return [info for info, _ in self._committed_heads()]

    def _committed_heads(self, dirs: Iterable[str] | None = None) -> list[tuple[TagInfo, bytes]]:
        """Committed partial checkpoints, oldest first, each with the first
        bytes of its metadata (one listing, one small read per checkpoint)."""
        return committed_heads(self.partial_store, self.partial_tags(dirs))

    def is_torch_checkpoint(self, tag: str) -> bool:
        """Whether ``{tag}_partial`` holds a checkpoint committed by torch's own
        writers (its ``.metadata``, no dcp_ext metadata): loadable, never
        deleted by dcp_ext."""
        store = self.partial_store(tag)
        return not store.exists(METADATA_FILE) and store.exists(TORCH_METADATA_FILE)

    # -- newest --------------------------------------------------------------------
    def newest_record(self) -> str | None:
        """The tag ``newest`` names, as written (``None`` if there is no ``newest``)."""
        try:
            return self.store.read_file(NEWEST_FILE).decode(errors="replace").strip()
        except CheckpointNotFoundError:
            return None

    def newest(self) -> str | None:
        """The tag named by ``newest`` if it is committed, else the newest committed
        tag (with a warning), else ``None``."""
        committed = self.committed()
        recorded = self.newest_record()
        if recorded in {t.tag for t in committed}:
            return recorded
        if not committed:
            return None
        fallback = committed[-1].tag
        warnings.warn(
            f"{self.store.describe(NEWEST_FILE)} "
            + ("is missing" if recorded is None else f"names {recorded!r}, which is not a committed checkpoint")
            + f"; using the newest committed tag {fallback!r}",
            stacklevel=3,
        )
        return fallback

    def set_newest(self, tag: str) -> None:
        """Point ``newest`` at ``tag`` (one atomic write)."""
        crash_point("before_newest")
        self.store.write_file(NEWEST_FILE, f"{validate_tag(tag)}\n".encode())

    # -- what must stay ----------------------------------------------------------------
    def scan(self) -> RootScan:
        """What may not be deleted or rewritten now (:func:`dcp_ext.guard.scan_root`):
        call it *after* taking the save locks of the directories you will change."""
        return self._tags.scan()

    def referenced_files(
        self, exclude: Collection[str] = (), heads: list[tuple[TagInfo, bytes]] | None = None
    ) -> set[tuple[str, str]]:
        """``(directory, file)`` of every data file that a committed checkpoint
        (other than those in ``exclude``) refers to (incremental saves).

        A query: a caller that deletes uses :meth:`scan` after taking its locks.

        Raises:
            CheckpointCorruptError: An incremental checkpoint's metadata cannot be read.
        """
        del heads  # the scan lists and reads the heads itself
        return self.scan().referenced(exclude)

    def retired_tags(self) -> list[str]:
        """Tags whose directory is retired: deleted, but holding data files a
        committed incremental checkpoint refers to."""
        return [t for t in self.partial_tags()
                if self.partial_store(t).exists(RETIRED_FILE) and not self.partial_store(t).exists(METADATA_FILE)]

    # -- deletion --------------------------------------------------------------------
    def delete(self, tag: str, *, partial: bool = True, full: bool = True) -> None:
        """Delete a checkpoint's files written by dcp_ext (nothing else).

        Data files of the partial checkpoint that other committed checkpoints
        refer to (incremental saves) stay, in a retired directory, until
        nothing refers to them.

        Raises:
            ValueError: ``tag`` is the target of ``newest`` (partial).
            CheckpointInUseError: A save to ``tag`` or one that builds on it is in progress.
            ForeignCheckpointError: ``{tag}_partial`` was written by torch's own writers.
        """
        validate_tag(tag)
        if partial:
            if self.newest_record() == tag:
                raise ValueError(f"{tag!r} is the newest checkpoint; save a newer one before deleting it")
            if self.is_torch_checkpoint(tag):
                raise ForeignCheckpointError(
                    f"{self.partial_url(tag)} was written by torch's own writer (it has .metadata and no "
                    f"{METADATA_FILE}); dcp_ext deletes only what it wrote: delete it yourself",
                    self.partial_url(tag),
                )
            self._delete_tags([tag], refuse=True)
            self.sweep_retired()
        if full:
            if tag in self.store.list_dirs():  # a Hugging Face folder (full_format="hf")
                self.delete_hf_folder(tag)
            else:
                # The sidecar first: checksums never outlive the file they describe.
                self.store.delete(tag + CHECKSUMS_SUFFIX)
                self.store.delete(tag)
            self.store.delete(user_content_name(tag))

    def delete_partial(self, tag: str) -> None:
        """Delete ``{tag}_partial`` by the one rule (see :meth:`delete`); a
        committed ``tag`` stays if a save in progress builds on it.

        Raises:
            CheckpointInUseError: A save to ``tag`` or one that builds on it is in progress.
        """
        self._delete_tags([validate_tag(tag)], refuse=True)

    def _delete_tags(
        self, tags: Iterable[str], *, refuse: bool, heads: dict[str, bytes] | None = None,
        held: dict[str, str] | None = None,
    ) -> list[str]:
        """Delete the committed checkpoints ``tags`` by the one rule: lock,
        scan, leave a leased base (or refuse), un-commit, delete what no
        kept checkpoint refers to.

        Args:
            tags: The tags to delete.
            refuse: Raise :class:`CheckpointInUseError` for a tag that cannot
                go now (else it is left for a later pass).
            heads: The first bytes of each tag's metadata when it was chosen
                (retention): a tag that changed since (overwritten) stays.
            held: Receives, for each tag left for a later pass, why.

        Returns:
            The tags deleted.
        """
        held = {} if held is None else held
        locks: dict[str, SaveLock] = {}
        try:
            for tag in tags:
                lock = self._tags.lock(tag, "delete", refuse, held)
                if lock is not None:
                    locks[tag] = lock
            if not locks:
                return []
            scan = self.scan()
            # Retention chose from heads it read after newest: a tag saved again since
            # shows in its head. An explicit delete checked newest before the lock.
            newest = self.newest_record() if heads is None else None
            current = {info.tag: head for info, head in scan.heads}
            doomed = []
            for tag in locks:
                reason = scan.pinned_by(tag)
                if reason is None and heads is not None and current.get(tag, heads.get(tag)) != heads.get(tag):
                    reason = "it was saved again since it was chosen"
                if reason is None and tag == newest:
                    reason = "it is the newest checkpoint now"
                if reason is not None:
                    if refuse:
                        raise CheckpointInUseError(f"cannot delete {tag!r} now: {reason}", self.partial_url(tag))
                    log.info("not deleting %s now: %s", partial_dir(tag), reason)
                    held[tag] = reason
                    continue
                doomed.append(tag)
            referenced = scan.referenced(exclude=doomed)
            for tag in doomed:
                self._tags.clear(tag, referenced, locks.pop(tag))
            return doomed
        finally:
            for lock in locks.values():
                lock.release()

    def sweep_retired(self, retired: Collection[str] | None = None) -> list[str]:
        """Delete what no committed checkpoint (nor save in flight) refers to
        any more in retired directories, and the directories left empty.

        Args:
            retired: The retired tags, if the caller has just found them (default: :meth:`retired_tags`).

        Returns:
            The tags whose retired directory was removed entirely.
        """
        retired = self.retired_tags() if retired is None else list(retired)
        if not retired:
            return []
        return list(self._cleanup.sweep({tag: "retired" for tag in retired}, {}).retired)

    def apply_retention(self, policy: RetentionPolicy, protect: Collection[str] = (), *, dry_run: bool = False) -> list[str]:
        """Delete the committed checkpoints ``policy`` does not keep (see
        :meth:`retain`, which also says which were left for a later pass and why).

        Returns:
            The tags deleted (or that would be, with ``dry_run``), oldest first.
        """
        return list(self.retain(policy, protect, dry_run=dry_run).deleted)

    def retain(self, policy: RetentionPolicy, protect: Collection[str] = (), *, dry_run: bool = False) -> RetentionReport:
        """Delete the committed checkpoints ``policy`` does not keep; never the
        ``newest`` target, a tag in ``protect``, or one that a save in
        progress holds or builds on (it goes in a later pass, and the report
        says why: the lock or lease file, its holder and how to clear it).
        Data files that a kept (incremental) checkpoint refers to stay (see
        :meth:`delete`); older retired directories this frees are removed by
        :meth:`remove_leftovers`, which every caller runs next (one sweep per
        save, not two).

        Returns:
            A :class:`RetentionReport`.
        """
        newest = self.newest_record()
        keep = set(protect) | ({newest} if newest else set())
        heads = self._committed_heads()
        doomed = select_for_deletion([info for info, _ in heads], policy, protect=keep)
        if dry_run or not doomed:
            return RetentionReport(tuple(doomed))
        first = {info.tag: head for info, head in heads}
        held: dict[str, str] = {}
        deleted = self._delete_tags(doomed, refuse=False, heads={tag: first[tag] for tag in doomed}, held=held)
        return RetentionReport(tuple(deleted), tuple(sorted(held.items())))

    def compact(self, tag: str) -> CompactReport:
        """(one process) Rewrite the incremental checkpoint ``tag``
        self-contained (:func:`dcp_ext.root.compact`) under its save lock,
        by the one rule: refused while a save to it or one that builds on it
        is in progress; the files it replaces stay while another checkpoint
        refers to them (then leftover cleanup removes them, as it removes
        the new files of a compaction killed before its commit).

        Returns:
            The :class:`~dcp_ext.root.CompactReport`.

        Raises:
            CheckpointInUseError: A save to ``tag``, or one that builds on it, is in progress.
            CheckpointNotFoundError: ``tag`` is not a committed checkpoint.
        """
        lock = self._tags.lock(validate_tag(tag), "compact", refuse=True)
        assert lock is not None
        marker = strays_marker(tag)
        try:
            scan = self.scan()
            reason = scan.pinned_by(tag)
            if reason is not None:
                raise CheckpointInUseError(
                    f"cannot compact {tag!r} now: {reason}; run compact when that save has finished",
                    self.partial_url(tag),
                )
            if tag not in scan.committed:
                raise CheckpointNotFoundError(f"no committed checkpoint {self.partial_url(tag)} to compact",
                                              self.partial_url(tag))
            directory = partial_dir(tag)
            others = {file for d, file in scan.referenced(exclude={tag}) if d == directory}
            report = compact(self.partial_location(tag), referenced_elsewhere=others,
                             before_write=lambda: self.store.write_file(marker, b"{}"))
            if report.changed and not report.kept_old:
                self.store.delete(marker)
        finally:
            lock.release()
        self.sweep_retired()
        return report

    def records(self) -> list[HeldRecord]:
        """(one process) Every save lock and lease under the root, judged by
        the one liveness rule: who holds what (``dcp-ext locks ROOT``)."""
        return list_records(self.store, self.partial_store, self.partial_tags(), self.config)

    def break_record(self, name: str, *, force: bool = False) -> HeldRecord:
        """(one process) Remove the lock or lease ``name`` (as :meth:`records`
        names it) by hand; refused while the rule judges its holder alive,
        unless ``force``.

        Raises:
            CheckpointInUseError: Its holder is alive (the message says who).
            CheckpointNotFoundError: No such lock or lease.
        """
        return break_record(self.store, self.partial_store, name, self.config, force=force)

    def remove_leftovers(self, current: str | None = None) -> LeftoverReport:
        """Delete what crashed saves, deletions and compactions left, by the
        one rule (:meth:`dcp_ext.root._cleanup.LeftoverCleanup.remove_leftovers`);
        the tag ``current`` being saved is never touched."""
        return self._cleanup.remove_leftovers(current)
