"""A checkpoint root on storage: its committed tags, ``newest``, deletion, leftovers, retention.

Used by :class:`~dcp_ext.CheckpointManager` (on the coordinator) and by the
CLI's ``ls`` and ``prune``; every method is plain I/O by one process, no
collectives. The layout it reads and writes is described in :mod:`dcp_ext.layout`.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from . import save_lock
from ._failpoints import crash_point
from .config import IOConfig
from .errors import CheckpointNotFoundError, DcpExtError
from .full_checksums import FOLDER_SIDECAR
from .hf_layout import HF_CONFIG_FILE, HF_INDEX_FILE, is_shard_name
from .layout import (
    CHECKSUMS_SUFFIX,
    DATA_SUFFIX,
    NEWEST_FILE,
    PARTIAL_SUFFIX,
    PARTITION_FILE,
    USER_CONTENT_FILE,
    TagInfo,
    partial_dir,
    user_content_name,
    validate_tag,
)
from .metadata import METADATA_FILE, TORCH_METADATA_FILE, read_created, read_incremental_section, read_leading_field
from .metadata.document import INCREMENTAL_VERSION, split_reference
from .retention import RetentionPolicy, select_for_deletion
from .storage import TMP_MARK, Store, join_path, normalize_path, open_store

__all__ = ["CheckpointRoot", "LeftoverReport", "RETIRED_FILE"]

log = logging.getLogger("dcp_ext.root")

# Files dcp_ext writes in a partial checkpoint directory; deletion touches nothing else.
_OWN_FILES = (METADATA_FILE, TORCH_METADATA_FILE, PARTITION_FILE, USER_CONTENT_FILE)
# Enough of the metadata document to hold its "created" field (written near its start).
_HEAD_BYTES = 512
#: Written in a partial directory whose checkpoint was deleted while later
#: (incremental) checkpoints still refer to some of its data files: the
#: directory keeps only those, and is removed once nothing refers to them.
RETIRED_FILE = "dcp_ext.retired.json"


@dataclass(frozen=True)
class LeftoverReport:
    """What :meth:`CheckpointRoot.remove_leftovers` removed.

    Attributes:
        temp_files: Temporary files in the root (crashed full saves, ``newest`` writes).
        uncommitted: Tags whose partial directory never committed and whose lock is not live.
        uploads: Incomplete multipart uploads aborted (object stores), by object name.
        retired: Retired directories removed because no committed checkpoint
            refers to their files any more (incremental saves).
    """

    temp_files: tuple[str, ...] = ()
    uncommitted: tuple[str, ...] = ()
    uploads: tuple[str, ...] = ()
    retired: tuple[str, ...] = ()


class CheckpointRoot:
    """The checkpoints under one root path.

    Args:
        root: Local path, ``s3://bucket/prefix`` or fsspec URL.
        config: I/O tunables.
        storage_options: fsspec/s3fs options.
    """

    def __init__(
        self,
        root: str,
        config: IOConfig | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = normalize_path(root)
        self.config = config or IOConfig.from_env()
        self.storage_options = dict(storage_options or {})
        self.store = open_store(self.url, self.config, self.storage_options)

    def __getstate__(self) -> dict[str, Any]:
        # The open store holds clients and sockets; a copy in another process
        # (a process-based upload's after-commit step) opens its own.
        return {"url": self.url, "config": self.config, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["config"], state["storage_options"])  # type: ignore[misc]

    def partial_url(self, tag: str) -> str:
        """Where the partial checkpoint ``tag`` lives."""
        return join_path(self.url, partial_dir(tag))

    def partial_store(self, tag: str) -> Store:
        return open_store(self.partial_url(tag), self.config, self.storage_options)

    def exists(self) -> bool:
        """Whether the root exists at all (a missing one is usually a mistyped path)."""
        return self.store.root_exists()

    # -- what is there ---------------------------------------------------------------
    def partial_tags(self) -> list[str]:
        """Tags of every ``{tag}_partial`` directory, committed or not."""
        tags = []
        for name in self.store.list_dirs():
            if name.endswith(PARTIAL_SUFFIX):
                try:
                    tags.append(validate_tag(name[: -len(PARTIAL_SUFFIX)]))
                except DcpExtError:
                    continue  # not ours
        return tags

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
            if not name.endswith(PARTIAL_SUFFIX) and _valid(name) and self.store.exists(f"{name}/{HF_INDEX_FILE}")
        ]

    def hf_store(self, tag: str) -> Store:
        """The folder ``ROOT/{tag}/`` of a Hugging Face export."""
        return open_store(join_path(self.url, validate_tag(tag)), self.config, self.storage_options)

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
        """Committed partial checkpoints, oldest first."""
        return [info for info, _ in self._committed_heads()]

    def _committed_heads(self) -> list[tuple[TagInfo, bytes]]:
        """Committed partial checkpoints, oldest first, each with the first
        bytes of its metadata (one listing, one small read per checkpoint)."""
        found = []
        for tag in self.partial_tags():
            try:
                head = self.partial_store(tag).read_head(METADATA_FILE, _HEAD_BYTES)
            except CheckpointNotFoundError:
                continue  # never committed (failed or running save)
            found.append((TagInfo(tag, read_created(head) or 0.0), head))
        return sorted(found, key=lambda entry: (entry[0].committed_at, entry[0].tag))

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

    # -- deletion --------------------------------------------------------------------
    def delete(self, tag: str, *, partial: bool = True, full: bool = True) -> None:
        """Delete a checkpoint's files written by dcp_ext (nothing else).

        Raises:
            ValueError: ``tag`` is the target of ``newest`` (partial).
        """
        validate_tag(tag)
        if partial:
            if self.newest_record() == tag:
                raise ValueError(f"{tag!r} is the newest checkpoint; save a newer one before deleting it")
            referenced = self.referenced_files(exclude={tag})
            self.delete_partial(tag, referenced)
            self.sweep_retired(referenced)
        if full:
            if tag in self.store.list_dirs():  # a Hugging Face folder (full_format="hf")
                self.delete_hf_folder(tag)
            else:
                # The sidecar first: checksums never outlive the file they describe.
                self.store.delete(tag + CHECKSUMS_SUFFIX)
                self.store.delete(tag)
            self.store.delete(user_content_name(tag))

    def delete_partial(self, tag: str, referenced: Collection[tuple[str, str]] | None = None) -> None:
        """Delete ``{tag}_partial``: the commit marker first, so a half-deleted
        checkpoint is never mistaken for a committed one.

        Data files that another committed checkpoint refers to (incremental
        saves) stay: the directory then keeps only them, marked retired
        (:data:`RETIRED_FILE`, written before anything is deleted), until
        nothing refers to them.

        Args:
            tag: The checkpoint to delete.
            referenced: ``(directory, file)`` of every data file the
                checkpoints that stay refer to (default: read from every
                other committed checkpoint's metadata).
        """
        if referenced is None:
            referenced = self.referenced_files(exclude={tag})
        store = self.partial_store(tag)
        directory = partial_dir(tag)
        keep = {file for d, file in referenced if d == directory}
        if keep:
            store.write_file(RETIRED_FILE, json.dumps({"tag": tag, "kept": sorted(keep)}).encode())
        for name in _OWN_FILES:
            store.delete(name)
        crash_point("mid_retention")
        for name in store.list_tree():  # data files under key prefixes too
            if name in keep:
                continue
            if name.endswith(DATA_SUFFIX) or TMP_MARK in name or name == save_lock.LOCK_FILE:
                store.delete(name)
        if not keep:
            store.delete(RETIRED_FILE)
            store.remove_root_if_empty()

    def referenced_files(
        self, exclude: Collection[str] = (), heads: list[tuple[TagInfo, bytes]] | None = None
    ) -> set[tuple[str, str]]:
        """``(directory, file)`` of every data file that a committed checkpoint
        (other than those in ``exclude``) refers to (incremental saves).
        Only incremental (version 4) documents are read whole: the first bytes
        of the others (``heads``, from the listing, if the caller has them)
        already say that they refer to nothing.

        Raises:
            CheckpointCorruptError: An incremental checkpoint's metadata cannot
                be read: what it refers to is unknown, so nothing may be deleted.
        """
        found: set[tuple[str, str]] = set()
        for info, head in self._committed_heads() if heads is None else heads:
            if info.tag in exclude:
                continue
            version = read_leading_field(head, "version")
            if isinstance(version, int) and not isinstance(version, bool) and version != INCREMENTAL_VERSION:
                continue  # only incremental checkpoints (version 4) refer to other files
            store = self.partial_store(info.tag)
            try:
                data = store.read_file(METADATA_FILE)
            except CheckpointNotFoundError:
                continue  # deleted meanwhile
            section = read_incremental_section(data, store.describe(METADATA_FILE))
            if section is not None:
                found.update(split_reference(name, store.describe(METADATA_FILE)) for name in section.references)
        return found

    def retired_tags(self) -> list[str]:
        """Tags whose directory is retired: deleted, but holding data files a
        committed incremental checkpoint refers to."""
        return [t for t in self.partial_tags()
                if self.partial_store(t).exists(RETIRED_FILE) and not self.partial_store(t).exists(METADATA_FILE)]

    def sweep_retired(
        self, referenced: Collection[tuple[str, str]] | None = None, retired: Collection[str] | None = None
    ) -> list[str]:
        """Delete what no committed checkpoint refers to any more in retired
        directories (and the directories left empty).

        Args:
            referenced: As for :meth:`delete_partial` (default: read).
            retired: The retired tags, if the caller has just found them (default: :meth:`retired_tags`).

        Returns:
            The tags whose retired directory was removed entirely.
        """
        retired = self.retired_tags() if retired is None else list(retired)
        if not retired:
            return []
        if referenced is None:
            referenced = self.referenced_files()
        removed = []
        for tag in retired:
            self.delete_partial(tag, referenced)
            if not self.partial_store(tag).exists(RETIRED_FILE):
                removed.append(tag)
        return removed

    def apply_retention(self, policy: RetentionPolicy, protect: Collection[str] = (), *, dry_run: bool = False) -> list[str]:
        """Delete the committed checkpoints ``policy`` does not keep; never the
        ``newest`` target or a tag in ``protect``. Data files that a kept
        (incremental) checkpoint refers to stay (see :meth:`delete_partial`);
        older retired directories this frees are removed by
        :meth:`remove_leftovers`, which every caller runs next (one sweep per
        save, not two).

        Returns:
            The tags deleted (or that would be, with ``dry_run``), oldest first.
        """
        newest = self.newest_record()
        keep = set(protect) | ({newest} if newest else set())
        heads = self._committed_heads()
        doomed = select_for_deletion([info for info, _ in heads], policy, protect=keep)
        if not dry_run:
            referenced = self.referenced_files(exclude=set(doomed), heads=heads)
            for tag in doomed:
                self.delete_partial(tag, referenced)
        return doomed

    def remove_leftovers(self, current: str | None = None) -> LeftoverReport:
        """Delete what crashed saves left: temporary files in the root, partial
        directories that never committed, and incomplete multipart uploads
        older than the stale-lock limit; and the files of retired directories
        that no committed checkpoint refers to any more. A directory whose save lock is live
        (:mod:`dcp_ext.save_lock`), and the tag ``current`` being saved, are
        never touched."""
        temp_files = [n for n in self.store.list_names() if TMP_MARK in n]
        for name in temp_files:
            self.store.delete(name)
        locked: dict[str, bool] = {}

        def lock_live(tag: str) -> bool:
            if tag not in locked:
                state = save_lock.lock_state(self.partial_store(tag))
                locked[tag] = state is not None and state.live
            return locked[tag]

        uncommitted: list[str] = []
        retired: list[str] = []
        for tag in self.partial_tags():
            if tag == current or self.partial_store(tag).exists(METADATA_FILE) or lock_live(tag):
                continue  # being saved now, committed, or another job's save in flight
            if self.partial_store(tag).exists(RETIRED_FILE):
                retired.append(tag)  # deleted, keeping files a committed checkpoint refers to: swept below
                continue
            log.info("removing %s: a save that never committed", partial_dir(tag))
            self.delete_partial(tag)
            uncommitted.append(tag)
        uploads = []
        now = time.time()
        for upload in self.store.list_incomplete_uploads():
            directory = upload.name.partition("/")[0]
            tag = directory[: -len(PARTIAL_SUFFIX)] if directory.endswith(PARTIAL_SUFFIX) else ""
            if now - upload.initiated < float(save_lock.STALE_LOCK_SECONDS):
                continue  # may belong to a save in flight
            if tag and (tag == current or (_valid(tag) and lock_live(tag))):
                continue
            log.info("aborting incomplete upload of %s started %.0f s ago", upload.name, now - upload.initiated)
            self.store.abort_upload(upload)
            uploads.append(upload.name)
        removed = self.sweep_retired(retired=retired)  # the retired tags just found: no second look at each tag
        return LeftoverReport(tuple(temp_files), tuple(uncommitted), tuple(uploads), tuple(removed))


def _valid(tag: str) -> bool:
    try:
        validate_tag(tag)
    except DcpExtError:
        return False
    return True
