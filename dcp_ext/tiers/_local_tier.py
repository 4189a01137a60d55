"""Tiered checkpoints: a node-local tier in front of the persistent root (:class:`LocalTier`).

Each node has its own local-tier directory (NVMe, or ``/dev/shm`` for a
memory tier) with the same layout as the root (:mod:`dcp_ext.layout`). A
tiered save goes there first:

1. every rank streams its shards into ``LOCAL/{tag}_partial/`` on its own
   node (``dcp.save`` with :class:`~dcp_ext.CheckpointWriter`); the
   coordinator's node commits (``partition.json``, ``user_content``, then
   the metadata last);
2. :meth:`LocalTier.spread_commit`: the coordinator sends those small files
   over the process group and every other node's leader writes them, the
   metadata last. The tag is now *locally committed* on every node;
3. with ``replicas=1``, every rank sends its data files to its partner
   node (:mod:`dcp_ext.tiers._replicas`), never by reading another node's path;
4. each node's leader moves the node's ``newest`` and applies local
   retention (``keep_local``);
5. a persisted save is then *drained* (:func:`~dcp_ext.tiers.drain`): each rank copies its
   node's share of the data files to ``ROOT/{tag}_partial/``, then the
   coordinator copies the small files and the metadata last (the commit),
   moves the root's ``newest`` and applies the root's retention. The copies
   are byte for byte, so the checkpoint in the root is the same checkpoint;
   except with ``incremental=True``, whose drains write to the root only the
   frames that differ from the root's newest checkpoint
   (:mod:`dcp_ext.tiers._incremental_drain`: the local tiers keep full copies).

Restore (:func:`~dcp_ext.tiers.plan_restore`) looks at every node's inventory and the root
and picks the newest tag that can be read: from the local tiers when every
saving rank's files are on its node (or, with replicas, on the partner,
which sends them), else from the root. Each rank then reads each file from
its own node's copy if it has one, else from the root
(:class:`~dcp_ext.storage.tiered.TieredStore`); checksums decide whether a
copy is intact, and a damaged one is read again from the next source. A
root copy written by an incremental drain is not the local copy's files, so
such a tag is read wholly from the local tiers (when every saving rank's
files are there) or wholly from the root.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Collection, Sequence

from .._runtime import GroupView, NodeMap, crash_point
from ..config import IOConfig
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, DcpExtError
from ..layout import PARTITION_FILE, USER_CONTENT_FILE, Partition
from ..metadata import METADATA_FILE, TORCH_METADATA_FILE, decode_metadata, read_created
from ..root import CheckpointRoot, KeepLast
from ..storage import Store
from ._replicas import Transfer, replica_transfers, send_files
from ._restore_plan import LocalTagState, NodeInventory, RestorePlan, is_replicated_file

__all__ = ["LocalTier", "COMMIT_FILES", "raise_if_any", "read_commit_files", "write_commit_files"]

log = logging.getLogger("dcp_ext.tiers")

#: Small files of a partial checkpoint, copied with its metadata (which commits).
COMMIT_FILES = (PARTITION_FILE, USER_CONTENT_FILE, TORCH_METADATA_FILE)
_HEAD_BYTES = 512


class LocalTier:
    """One node's local-tier directory.

    Args:
        path: This node's local-tier directory (each rank passes its own node's).
        config: I/O tunables.
        nodes: The node of every rank.
        group: The process group of the saves.
    """

    def __init__(self, path: str, config: IOConfig, nodes: NodeMap, group: GroupView) -> None:
        self.path = path
        self.checkpoints = CheckpointRoot(path, config)
        self.nodes = nodes
        self.group = group

    @property
    def node(self) -> int:
        return self.nodes.node_of(self.group.rank)

    @property
    def is_leader(self) -> bool:
        return self.nodes.is_leader(self.group.rank)

    def partial_url(self, tag: str) -> str:
        return self.checkpoints.partial_url(tag)

    # -- save ---------------------------------------------------------------------
    def lacking_room(self, need: int, capacity: int | None, replicas: int) -> str | None:
        """(all ranks) Why some node's tier cannot hold one more save, or ``None``.

        Each rank brings the bytes it is about to write (``need``); a node
        must hold its own ranks' bytes and, with replicas, those of the nodes
        it is the partner of. Its room is the file system's free space and,
        with a ``capacity`` (the leader's ``local_tier_bytes``), what that
        leaves beside the files already in the tier. The old tags that local
        retention would delete still count: they go only after the new tag
        has committed.

        Returns:
            The same sentence on every rank, naming the node, its directory and
            the bytes, or ``None`` when every node has room.
        """
        free = used = 0
        if self.is_leader:
            try:
                os.makedirs(self.path, exist_ok=True)
                free = shutil.disk_usage(self.path).free
                used = _tree_bytes(self.path) if capacity is not None else 0
            except OSError as err:
                free = -1
                log.warning("cannot read the free space of the local tier %s: %s", self.path, err)
        every = self.group.all_gather((need, free, used, capacity, self.path))
        nodes = self.nodes
        for node in range(nodes.node_count):
            held = [node] + ([n for n in range(nodes.node_count) if n != node and nodes.partner_of(n) == node]
                             if replicas else [])
            wanted = sum(every[rank][0] for n in held for rank in nodes.ranks_on(n))
            _, free, used, cap, path = every[nodes.leader_of(node)]
            if free < 0:
                return f"node {node}'s local tier {path} cannot be inspected"
            room = free if cap is None else min(free, cap - used)
            if wanted > room:
                limit = f"local_tier_bytes={cap} with {used} bytes in use, " if cap is not None else ""
                return (f"node {node}'s local tier {path} has room for {max(room, 0)} bytes ({limit}{free} free "
                        f"on its file system) and this save needs {wanted}")
        return None

    def spread_commit(self, tag: str, done: Callable[[], None] | None = None) -> None:
        """(all ranks) Copy the coordinator's commit files of ``tag`` to every
        other node, the metadata last. Every rank raises the same error if any
        node could not write them. ``done`` is called once this rank's part
        is over (before the exchange of errors), for the caller's watch."""
        payload: dict[str, bytes] | None = None
        if self.group.is_coordinator:
            payload = read_commit_files(self.checkpoints.partial_store(tag))
        payload = self.group.broadcast(payload)
        assert payload is not None
        error: str | None = None
        if self.is_leader and self.node != self.nodes.node_of(0):
            crash_point("mid_local_commit")
            try:
                write_commit_files(self.checkpoints.partial_store(tag), payload)
            except DcpExtError as err:
                error = f"node {self.node} (rank {self.group.rank}): {err}"
        if done is not None:
            done()
        raise_if_any(self.group, error, f"committing {tag!r} in the local tier")

    def after_local_commit(self, tag: str, keep_local: int | None, protect: Collection[str]) -> None:
        """(node leaders) Point the node's ``newest`` at ``tag``, then keep the
        ``keep_local`` newest local tags (never one in ``protect``)."""
        if not self.is_leader:
            return
        self.checkpoints.set_newest(tag)
        if keep_local is not None:
            self.checkpoints.apply_retention(KeepLast(keep_local), protect={tag, *protect})
        try:
            self.checkpoints.remove_leftovers(current=tag)  # what crashed local saves left
        except DcpExtError as err:
            log.warning("could not remove leftovers under %s: %s", self.checkpoints.url, err)

    def _gather_own_files(self, tag: str, replicated: bool) -> tuple[Store, list[list[tuple[str, int]]]]:
        """(all ranks) Every rank's data files of ``tag`` with their sizes, by
        rank: its ``replicated_*`` files if ``replicated``, else the others.

        The names come from each rank's own node's ``partition.json``, checked
        there (:meth:`Partition.from_json`) before any is sized or sent. A rank
        that cannot read them still takes part in the gather, so that every
        rank raises its error instead of the others waiting for it forever.

        Raises:
            DcpExtError: On every rank, of the kind of the first failing rank's
                error (:class:`~dcp_ext._runtime.names.UnsafeNameError` for a name that
                could leave the tier), naming its ``partition.json``.
        """
        store = self.checkpoints.partial_store(tag)
        files: list[tuple[str, int]] = []
        error: DcpExtError | None = None
        try:
            partition = Partition.from_json(store.read_file(PARTITION_FILE), store.describe(PARTITION_FILE))
            own = next((r.files for r in partition.ranks if r.rank == self.group.rank), ())
            files = [(name, store.size(name)) for name in own if is_replicated_file(name) == replicated]
        except DcpExtError as err:
            error = err
        every = self.group.all_gather((files, _carried(error, self.group.rank)))
        raise_if_any(self.group, None, f"reading the data files of {tag!r} in the local tiers",
                     [e for _, e in every], local=error)
        return store, [f for f, _ in every]

    def share_replicated(self, tag: str, sent: Callable[[], None] | None = None) -> None:
        """(all ranks) Copy each rank's ``replicated_*`` file (plain tensors and
        values that every rank loads) to the leader of every other node
        (``sent``: see :func:`~dcp_ext.tiers._replicas.send_files`)."""
        store, every = self._gather_own_files(tag, replicated=True)
        nodes = self.nodes
        transfers = [
            Transfer(name, size, rank, nodes.leader_of(node))
            for rank, files in enumerate(every) for name, size in files
            for node in range(nodes.node_count) if node != nodes.node_of(rank)
        ]
        if transfers:
            send_files(self.group, transfers, store, store, sent)
        elif sent is not None:
            sent()

    def replicate(self, tag: str, sent: Callable[[], None] | None = None) -> None:
        """(all ranks) Send this rank's data files of the locally committed
        ``tag`` to its partner node, which keeps them in its own tier
        (``sent``: see :func:`~dcp_ext.tiers._replicas.send_files`)."""
        store, every = self._gather_own_files(tag, replicated=False)
        nodes = self.nodes
        transfers = replica_transfers(
            every, [nodes.node_of(r) for r in range(nodes.world_size)],
            {n: nodes.partner_of(n) for n in range(nodes.node_count)},
            {n: nodes.ranks_on(n) for n in range(nodes.node_count)},
        )
        send_files(self.group, transfers, store, store, sent)

    def heal(self, plan: RestorePlan, inventories: Sequence[NodeInventory],
             sent: Callable[[], None] | None = None) -> None:
        """(all ranks) Bring the files ``plan.fetches`` names to the ranks'
        nodes from their partners, then commit the tag on the nodes that lacked it
        (``sent``: see :func:`~dcp_ext.tiers._replicas.send_files`)."""
        store = self.checkpoints.partial_store(plan.tag)
        if any(t.target == self.group.rank for t in plan.fetches):
            store.ensure_root()
        send_files(self.group, plan.fetches, store, store, sent)
        # The commit files, from the lowest node that has the tag committed.
        source = min(plan.local_nodes)
        payload = None
        if self.is_leader and self.node == source:
            payload = read_commit_files(store)
        files = next(p for p in self.group.all_gather(payload) if p is not None)
        error = None
        if self.is_leader and self.node in plan.healed_nodes:
            try:
                write_commit_files(store, files)
            except DcpExtError as err:
                error = f"node {self.node}: {err}"
        raise_if_any(self.group, error, f"restoring {plan.tag!r} into the local tier")

    # -- restore --------------------------------------------------------------------
    def inventory(self) -> NodeInventory | None:
        """(any rank; ``None`` except on node leaders) This node's committed tags.

        A data file counts only if its size is the one the tag's metadata
        records: a copy (a replica, say) that was not completely written is
        never a source, even under its own name (a store without atomic
        renames, a power loss before its bytes reached the disk).
        """
        if not self.is_leader:
            return None
        tags: dict[str, LocalTagState] = {}
        if not self.checkpoints.exists():
            return NodeInventory(self.node, tags)
        for tag in self.checkpoints.partial_tags():
            store = self.checkpoints.partial_store(tag)
            try:
                document = store.read_file(METADATA_FILE)
                sizes = decode_metadata(document, store.describe(METADATA_FILE)).files
                partition = Partition.from_json(store.read_file(PARTITION_FILE), store.describe(PARTITION_FILE))
            except CheckpointCorruptError as err:
                # Damaged metadata, a damaged or hostile partition.json (UnsafeNameError):
                # the tag is read from the other nodes or the root, never by the names it gives.
                log.warning("not restoring %r from the local tier %s: %s", tag, self.path, err)
                continue
            except DcpExtError:
                continue  # not committed here, or unreadable: not a source
            rank_files = tuple(tuple(r.files) for r in sorted(partition.ranks, key=lambda r: r.rank))
            # Only the files the record names (checked names), as peers are sent this list.
            named = {name for files in rank_files for name in files}
            files = {}
            for name in store.list_tree():
                if name not in named:
                    continue
                size = store.size(name)
                if name in sizes and size != sizes[name]:
                    log.warning("not using %s as a source: %d bytes where its metadata records %d (not completely "
                                "written)", store.describe(name), size, sizes[name])
                    continue
                files[name] = size
            if len(rank_files) != partition.world_size:
                continue
            tags[tag] = LocalTagState(tag, read_created(document[:_HEAD_BYTES]) or 0.0, files, rank_files)
        return NodeInventory(self.node, tags)

    def gather_inventories(self) -> list[NodeInventory]:
        """(all ranks) Every node's inventory, by node index."""
        mine = self.inventory()
        every = self.group.all_gather(mine)
        found = [inv for inv in every if inv is not None]
        return sorted(found, key=lambda inv: inv.node)


def _tree_bytes(path: str) -> int:
    """Bytes in the files under ``path``."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
            except OSError:
                pass  # removed meanwhile
    return total


def read_commit_files(store: Store) -> dict[str, bytes]:
    """A committed checkpoint's small files in ``store``, by name: dcp_ext's
    metadata (required: :class:`CheckpointNotFoundError` without it) and
    whichever of the other commit files it has."""
    files: dict[str, bytes] = {}
    for name in (*COMMIT_FILES, METADATA_FILE):
        try:
            files[name] = store.read_file(name)
        except CheckpointNotFoundError:
            if name == METADATA_FILE:
                raise
    return files


def write_commit_files(store: Store, files: dict[str, bytes]) -> None:
    """Write a checkpoint's small files into ``store``: dcp_ext's metadata
    (the commit) after the others, torch's ``.metadata`` after it, as a save
    does (a directory with torch's marker alone is never a crashed dcp_ext save)."""
    store.ensure_root()
    for name in COMMIT_FILES:
        if name in files and name != TORCH_METADATA_FILE:
            store.write_file(name, files[name])
    store.write_file(METADATA_FILE, files[METADATA_FILE])
    if TORCH_METADATA_FILE in files:
        store.write_file(TORCH_METADATA_FILE, files[TORCH_METADATA_FILE])


def _carried(error: DcpExtError | None, rank: int) -> DcpExtError | None:
    """``error`` as it travels to the other ranks: its kind and path, its
    message prefixed with the rank (errors pickle by message and path alone)."""
    if error is None:
        return None
    return _of_kind(type(error), f"rank {rank}: {error}", error.path)


def _of_kind(kind: type[DcpExtError], message: str, path: str | None) -> DcpExtError:
    try:
        return kind(message, path)
    except TypeError:  # a subclass with a constructor of its own
        return DcpExtError(message, path)


def raise_if_any(group: GroupView, error: str | DcpExtError | None, doing: str,
                 gathered: Sequence[str | DcpExtError | None] | None = None,
                 local: BaseException | None = None) -> None:
    """(all ranks) Raise on every rank if any rank reports an ``error``.

    The error raised is of the kind of the lowest failing rank's error when
    that is a :class:`DcpExtError` (so ``except UnsafeNameError`` or
    ``except StorageFullError`` work on every rank), else a plain
    :class:`DcpExtError`; its message holds every rank's.

    Args:
        group: The ranks.
        error: This rank's error, or ``None``.
        doing: What failed, for the message.
        gathered: Every rank's error, already gathered by the caller (then
            ``error`` is not sent again).
        local: This rank's own exception, chained as the cause.
    """
    if gathered is None:
        if isinstance(error, DcpExtError):
            local = local or error
            error = _carried(error, group.rank)
        gathered = group.all_gather(error)
    errors = [e for e in gathered if e is not None]
    if not errors:
        return
    message = f"{doing} failed: " + "; ".join(str(e) for e in errors)
    first = next((e for e in errors if isinstance(e, DcpExtError)), None)
    combined = _of_kind(type(first), message, first.path) if first is not None else DcpExtError(message)
    if local is not None:
        raise combined from local
    raise combined
