"""What may not be deleted or rewritten in a checkpoint root now: :func:`scan_root`.

The read half of the root's one rule (:mod:`dcp_ext.root._root`): after a step
that deletes or rewrites has taken the save locks of the directories it
changes, it reads the live leases of saves in flight
(:mod:`dcp_ext.guard._leases`), then what every committed checkpoint refers to.
Used by the root's maintenance and by :class:`~dcp_ext.CheckpointWriter`
before an ``overwrite=True`` save replaces a tag's files. Plain I/O by one
process.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from ..errors import CheckpointNotFoundError
from ..layout import TagInfo, partial_dir, tags_of_partial_dirs
from ..metadata import (
    METADATA_FILE,
    read_created,
    read_incremental_section,
    read_leading_field,
)
from ..metadata.document import INCREMENTAL_VERSION, split_reference
from ..storage import Store
from ._leases import LiveLease, is_lease_name, live_leases

__all__ = ["RootScan", "committed_heads", "scan_root", "HEAD_BYTES"]

#: Enough of a metadata document to hold its leading fields (``created`` among them).
HEAD_BYTES = 512


@dataclass(frozen=True)
class RootScan:
    """What may not be deleted or rewritten in a root, read after the locks were taken.

    Attributes:
        heads: Committed checkpoints (dcp_ext's), oldest first, each with
            the first bytes of its metadata.
        references: For each committed incremental checkpoint, the
            ``(directory, file)`` of every data file it refers to.
        leases: The live leases of saves in flight.
    """

    heads: tuple[tuple[TagInfo, bytes], ...] = ()
    references: dict[str, frozenset[tuple[str, str]]] = field(default_factory=dict)
    leases: tuple[LiveLease, ...] = ()

    @property
    def committed(self) -> set[str]:
        return {info.tag for info, _ in self.heads}

    def referenced(self, exclude: Collection[str] = ()) -> set[tuple[str, str]]:
        """``(directory, file)`` of every data file that a committed
        checkpoint other than those in ``exclude`` refers to."""
        found: set[tuple[str, str]] = set()
        for tag, refs in self.references.items():
            if tag not in exclude:
                found |= refs
        return found

    def pinned_by(self, tag: str) -> str | None:
        """Why ``tag`` must stay as it is (a live save builds on it), or ``None``."""
        for lease in self.leases:
            state = lease.state
            if lease.base is None:
                return (f"a save in progress whose lease {state.where} cannot be read may build on it "
                        f"({state.reason}); {state.advice()}")
            if lease.base == tag:
                record = state.record
                saving = f"{record.tag!r} " if record is not None and record.tag else ""
                return f"the save of {saving}builds on it (lease {state.where}: {state.reason}); {state.advice()}"
        return None

    def referrers(self, tag: str) -> list[str]:
        """The committed tags that refer to data files of ``tag``."""
        directory = partial_dir(tag)
        return sorted(other for other, refs in self.references.items()
                      if other != tag and any(d == directory for d, _ in refs))


def committed_heads(partial_store: Callable[[str], Store], tags: Iterable[str]) -> list[tuple[TagInfo, bytes]]:
    """The committed checkpoints among ``tags``, oldest first, each with the
    first bytes of its metadata (one small read per tag)."""
    found = []
    for tag in tags:
        try:
            head = partial_store(tag).read_head(METADATA_FILE, HEAD_BYTES)
        except CheckpointNotFoundError:
            continue  # never committed (failed or running save), or a torch checkpoint
        found.append((TagInfo(tag, read_created(head) or 0.0), head))
    return sorted(found, key=lambda entry: (entry[0].committed_at, entry[0].tag))


def scan_root(root: Store, partial_store: Callable[[str], Store]) -> RootScan:
    """(one process, after taking the locks of what it changes) The live
    leases of saves in flight and what every committed checkpoint refers to.

    The leases are read before the committed checkpoints, so a save that
    ends meanwhile is seen either by its lease or by its commit. Only
    incremental (version 4) documents are read whole.

    Args:
        root: The root's store.
        partial_store: The store of ``{tag}_partial``.

    Raises:
        CheckpointCorruptError: An incremental checkpoint's metadata cannot
            be read: what it refers to is unknown, so nothing may be deleted.
    """
    names, dirs = root.list_entries()
    listed = [name for name in names if is_lease_name(name)]
    leases = live_leases(root, listed)
    if len(leases) < len(listed):
        # A save ended between the listing and the read of its lease: its
        # committed directory may be newer than the listing.
        dirs = root.list_dirs()
    heads = committed_heads(partial_store, tags_of_partial_dirs(dirs))
    references: dict[str, frozenset[tuple[str, str]]] = {}
    for info, head in heads:
        version = read_leading_field(head, "version")
        if isinstance(version, int) and not isinstance(version, bool) and version != INCREMENTAL_VERSION:
            continue  # only incremental checkpoints (version 4) refer to other files
        store = partial_store(info.tag)
        try:
            data = store.read_file(METADATA_FILE)
        except CheckpointNotFoundError:
            continue  # deleted meanwhile
        section = read_incremental_section(data, store.describe(METADATA_FILE))
        if section is not None:
            references[info.tag] = frozenset(
                split_reference(name, store.describe(METADATA_FILE)) for name in section.references)
    return RootScan(tuple(heads), references, tuple(leases))
