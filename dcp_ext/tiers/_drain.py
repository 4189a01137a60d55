"""Draining a locally committed tag to the persistent root: :func:`drain`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from .._runtime import GroupView, crash_point, validate_relative_name
from ..errors import DcpExtError
from ..guard import Lease, SaveLock
from ..layout import PARTITION_FILE, Partition
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE, decode_metadata, read_created, torch_reader_marker
from ..root import CheckpointRoot, RetentionPolicy
from ..storage import Store
from ._incremental_drain import (
    DrainBase,
    RewrittenFiles,
    choose_base,
    rewrite_files,
    root_document,
)
from ._local_tier import LocalTier, raise_if_any, read_commit_files, write_commit_files

__all__ = ["drain", "copy_file", "DRAIN_PHASES"]

log = logging.getLogger("dcp_ext.tiers")

_COPY_CHUNK = 16 << 20
#: The steps of a drain, in order, as :func:`drain` reports them to its ``phase``.
DRAIN_PHASES = ("drain_lock", "drain_copy", "drain_copied", "drain_commit", "done")
_HEAD_BYTES = 512


def copy_file(source: Store, target: Store, name: str) -> int:
    """Stream data file ``name`` from ``source`` to ``target`` (committed there
    on success, aborted on failure); returns its size.

    Raises:
        UnsafeNameError: ``name`` is not a plain relative name (nothing is read or written).
    """
    validate_relative_name(name, source.describe(PARTITION_FILE), "data file")
    size = source.size(name)
    with target.open_writer(name, size_hint=size) as writer:
        for offset in range(0, size, _COPY_CHUNK):
            writer.write(source.read_range(name, offset, min(_COPY_CHUNK, size - offset)))
        writer.commit()
    return size


def drain(
    tier: LocalTier,
    persistent: CheckpointRoot,
    tag: str,
    group: GroupView,
    policy: RetentionPolicy | None,
    max_chain: int | None = None,
    phase: Callable[[str], None] | None = None,
) -> int:
    """(all ranks of ``group``) Copy the locally committed ``tag`` to the
    persistent root with the usual commit protocol.

    Each rank copies its share of its node's data files (the files of the
    node's saving ranks, split over the node's ranks); then the coordinator
    copies the small files and the metadata (the commit), points the root's
    ``newest`` at ``tag`` unless the root already has a newer one, and
    applies ``policy`` there. On any failure the root's ``newest`` is not
    moved and every rank raises the same error.

    With ``max_chain`` (incremental managers) the drain writes to the root
    only the frames that differ from the root's newest checkpoint, and the
    root's metadata refers to that checkpoint's files for the others
    (:mod:`dcp_ext.tiers._incremental_drain`); without a usable base it copies
    byte for byte.

    Every store of the root is opened from ``persistent``'s location (its
    storage options and I/O config).

    ``phase`` is told each step this rank enters (:data:`DRAIN_PHASES`), for
    the caller's watch (:mod:`dcp_ext._runtime.rank_watch`): a peer still
    copying is told from one waiting for the others.

    Returns:
        Bytes this rank wrote to the root's data files.
    """
    target = persistent.partial_store(tag)
    lock = SaveLock(target, uuid.uuid4().hex)

    def take_lock() -> None:
        target.ensure_root()
        if target.exists(METADATA_FILE):
            raise DcpExtError(f"{target.describe(METADATA_FILE)} exists: {tag!r} is already in the persistent root",
                              target.describe(METADATA_FILE))
        lock.acquire()

    step = phase or (lambda name: None)
    group.run_on_coordinator(take_lock)
    step("drain_copy")
    written = 0
    leases: list[Lease] = []  # (coordinator) the root lease on an incremental drain's base
    try:
        error: DcpExtError | None = None
        local = tier.checkpoints.partial_store(tag)
        where = local.describe(METADATA_FILE)
        base = DrainBase()
        if max_chain is not None:
            base = group.run_on_coordinator(
                lambda: choose_base(persistent, tag, local.read_file(METADATA_FILE), where, max_chain, leases))
        share_of: RewrittenFiles | None = None
        try:
            partition = Partition.from_json(local.read_file(PARTITION_FILE), local.describe(PARTITION_FILE))
            node_ranks = set(tier.nodes.ranks_on(tier.node))
            mine = sorted(f for r in partition.ranks if r.rank in node_ranks for f in r.files)
            share = tier.nodes.ranks_on(tier.node).index(group.rank)
            if base.tag is None:
                for name in mine[share::len(node_ranks)]:
                    written += copy_file(local, target, name)
                    crash_point("mid_drain")
            else:
                decoded = decode_metadata(local.read_file(METADATA_FILE), where)
                share_of = rewrite_files(local, target, mine[share::len(node_ranks)], decoded, base, persistent)
                written = share_of.written
        except DcpExtError as err:
            error = err
        step("drain_copied")
        raise_if_any(group, error, f"copying {tag!r} to {persistent.url}")
        shares = group.all_gather(share_of) if base.tag is not None else []
        crash_point("before_drain_commit")

        def commit() -> None:
            files = read_commit_files(local)
            if base.tag is not None:
                # The root's copy refers to the base's files: its own document, and
                # torch's marker instead of the local .metadata (which describes the
                # local files' layout).
                files[TORCH_METADATA_FILE] = torch_reader_marker("it refers to earlier checkpoints' files")
                decoded = decode_metadata(files[METADATA_FILE], where)
                files[METADATA_FILE] = root_document(
                    decoded, [s for s in shares if s is not None], base, persistent, target.describe(METADATA_FILE))
            write_commit_files(target, files)
            for lease in leases:  # committed: our metadata now refers to the base's files
                lease.end()
            lock.release()  # committed: as after a save's commit, no lock outlives a kill during retention
            created = read_created(files[METADATA_FILE][:_HEAD_BYTES]) or 0.0
            newest = persistent.newest_record()
            newer = [t for t in persistent.committed() if t.tag == newest and t.committed_at > created]
            if not newer:
                persistent.set_newest(tag)
            if policy is not None:
                persistent.apply_retention(policy, protect={tag})
            try:
                persistent.remove_leftovers(current=tag)
            except DcpExtError as err:
                log.warning("could not remove leftovers under %s: %s", persistent.url, err)

        step("drain_commit")
        group.run_on_coordinator(commit)
    finally:
        if group.is_coordinator:
            for lease in leases:
                lease.end()
            # After a failure the lock stays, released, as dcp_ext's mark on the
            # files copied so far: the next save's leftover cleanup removes them.
            lock.release(keep_mark=True)
    return written
