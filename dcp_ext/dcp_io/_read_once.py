"""Read-once planning: stored bytes that several ranks need are read by one of them.

Under DDP every rank loads the whole state; under HSDP every rank of a
replicate group loads the same shard; plain replicated tensors (norms, FSDP2
buffers, ``step``) are needed by every rank in any layout. Read naively, the
storage serves each of those bytes once per rank that needs it.

The coordinator (in :meth:`CheckpointReader.prepare_global_plan`) looks at
every rank's load plan, finds the read items that ask for the same stored
bytes (same key, chunk, offsets and lengths) on several ranks, and makes one
of those ranks the item's *owner*: it reads the bytes from storage and hands
them to the others (:mod:`dcp_ext.dcp_io._read_exchange`): through a shared-memory segment
to the ranks on its own host, over the process group to the rest.

Pure logic, no I/O, no collectives. Ownership is spread evenly and keeps each
owner's reads contiguous: the shared items of one set of ranks are taken in
file order and cut into one consecutive run per rank, with equal bytes; an
item that straddles a cut is split along its first dimension (every rank
that needs it gets the same pieces). Transfers are grouped into batches of
bounded size, each batch holding an equal share of every owner's data so all
ranks send at once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

__all__ = ["GroupSeen", "RankExchange", "Send", "Receive", "plan_read_once", "auto_min_saved", "MIN_PIECE"]

#: Items are not split into pieces smaller than this.
MIN_PIECE = 1024 * 1024
#: With ``read_once=None`` a load of at most this many ranks exchanges only
#: when that spares storage :data:`AUTO_MIN_SAVED_PER_RANK` bytes per rank.
AUTO_SMALL_WORLD = 8
#: See :data:`AUTO_SMALL_WORLD`. Measured: 2 ranks on one host sharing only
#: the two non-tensor values of a state dict (~200 bytes) loaded in 238
#: against 203 ms (16 MiB, GCS emulator, medians of 15) and 367 against
#: 349 ms (256 MiB) with the exchange as without it.
AUTO_MIN_SAVED_PER_RANK = 1024 * 1024


def auto_min_saved(world: int) -> int:
    """(coordinator) The storage bytes a read-once exchange must spare for
    ``read_once=None`` to use it on a load of ``world`` ranks.

    An exchange costs every rank a few collectives and a second round of
    reads (the owned items first); a small load that shares only a few
    small values (``step``, norms, FSDP2 buffers) is faster reading them
    twice. Past :data:`AUTO_SMALL_WORLD` ranks every shared read is
    exchanged however small: all ranks reading one file is a hot spot.
    """
    return AUTO_MIN_SAVED_PER_RANK * world if world <= AUTO_SMALL_WORLD else 0


@dataclass(frozen=True, slots=True)
class GroupSeen:
    """What one rank's reader sees of the group it would exchange over
    (sent with its local plan, so the coordinator can check it is DCP's).

    Attributes:
        rank: The reader's rank in its exchange group.
        size: The group's size.
        host: The rank's host (:func:`dcp_ext.dcp_io._read_exchange.host_identity`).
        shared_memory: Whether it may exchange with ranks on its host
            through ``/dev/shm`` (else over the network only).
    """

    rank: int
    size: int
    host: str = ""
    shared_memory: bool = False


@dataclass(frozen=True, slots=True)
class Send:
    """One item this rank reads and sends.

    Attributes:
        batch: Exchange batch it travels in.
        item: Index of the item in this rank's plan.
        receivers: Ranks that receive it, ascending.
        nbytes: Stored bytes it holds.
        remote: The receivers on other hosts, sent to over the network.
        segment_offset: Where it goes in this rank's shared-memory segment
            of the batch, which the receivers on this host read (``-1``: no
            receiver on this host).
    """

    batch: int
    item: int
    receivers: tuple[int, ...]
    nbytes: int
    remote: tuple[int, ...] = ()
    segment_offset: int = -1


@dataclass(frozen=True, slots=True)
class Receive:
    """One item this rank receives instead of reading it.

    Attributes:
        batch: Exchange batch it travels in.
        item: Index of the item in this rank's plan.
        owner: Rank that reads and sends it.
        nbytes: Stored bytes it holds.
        segment_offset: Where it is in the owner's shared-memory segment of
            the batch (``-1``: it comes over the network).
    """

    batch: int
    item: int
    owner: int
    nbytes: int
    segment_offset: int = -1


@dataclass(frozen=True)
class RankExchange:
    """One rank's part of the read-once plan (its ``LoadPlan.storage_data``).

    ``sends`` and ``receives`` are in the same global order on every rank,
    so a sender and a receiver list the items between them identically.

    Attributes:
        rank: The rank this part is for.
        world_size: Ranks in the load.
        batches: Exchange batches (the same on every rank).
        sends: Items this rank reads and sends, in global order.
        receives: Items this rank receives, in global order.
        exchange_id: Names this load's shared-memory segments.
        segment_bytes: Size of this rank's segment in each batch (0: none).
    """

    rank: int
    world_size: int
    batches: int
    sends: tuple[Send, ...]
    receives: tuple[Receive, ...]
    exchange_id: str = ""
    segment_bytes: tuple[int, ...] = ()

    @functools.cached_property
    def skipped(self) -> frozenset[int]:
        """Plan items this rank does not read from storage."""
        return frozenset(r.item for r in self.receives)



# (fqn, chunk offset, storage offsets, lengths) of a tensor read; (fqn, chunk offset) of bytes.
_Key = tuple[object, ...]


def _key(item: ReadItem) -> _Key:
    index = item.storage_index
    chunk = tuple(index.offset) if index.offset is not None else None
    if item.type == LoadItemType.BYTE_IO:
        return ("bytes", index.fqn, chunk)
    return ("tensor", index.fqn, chunk, tuple(item.storage_offsets), tuple(item.lengths))


def _split(item: ReadItem, start: int, stop: int) -> ReadItem:
    """Rows ``[start, stop)`` (first dimension) of a tensor read item."""
    dest = list(item.dest_offsets)
    stored = list(item.storage_offsets)
    lengths = list(item.lengths)
    dest[0] += start
    stored[0] += start
    lengths[0] = stop - start
    return dataclasses.replace(
        item,
        dest_offsets=torch.Size(dest),
        storage_offsets=torch.Size(stored),
        lengths=torch.Size(lengths),
    )


@dataclass
class _Shared:
    """Stored bytes several ranks need: where each rank's plan asks for them."""

    key: _Key
    nbytes: int
    order: tuple[object, ...]  # file, offset: reading order
    holders: dict[int, ReadItem]  # rank -> its item
    owner: int = -1
    slot: int = -1  # position in the global transfer order


def plan_read_once(
    plans: Sequence[LoadPlan],
    item_bytes: Callable[[ReadItem], int | None],
    item_order: Callable[[ReadItem], tuple[object, ...]],
    batch_bytes: int,
    item_grain: Callable[[ReadItem], int] = lambda item: 1,
    hosts: Sequence[str] = (),
    exchange_id: str = "",
    min_saved: int = 0,
) -> list[LoadPlan]:
    """(coordinator) Give every shared read one owner; the others receive it.

    Args:
        plans: Every rank's load plan, by rank.
        item_bytes: Stored bytes of a read item, or ``None`` for an item
            that must be read by every rank itself (e.g. torch-format items).
        item_order: Where an item's bytes are (file, offset), for reading
            order.
        item_grain: Rows (of the stored chunk, counted from its first row)
            at multiples of which a tensor item may be cut without two
            owners reading the same frame.
        hosts: Each rank's :attr:`GroupSeen.host`: an owner hands items to
            receivers on its host through a shared-memory segment per batch
            (each item copied in once), and sends them to the others.
        exchange_id: Unique name of this load (for the segments).
        batch_bytes: Bytes of shared data per exchange batch (all owners
            together).
        min_saved: Exchange only when that spares storage at least this
            many bytes (summed over the ranks that would receive).

    Returns:
        The plans with shared items possibly split and each plan's
        ``storage_data`` a :class:`RankExchange`; the plans unchanged (their
        ``storage_data`` ``None``) when no rank shares a read, or sharing
        spares less than ``min_saved`` bytes.
    """
    world = len(plans)
    holders_of: dict[_Key, dict[int, ReadItem]] = {}
    keep: list[list[ReadItem]] = [[] for _ in range(world)]  # items read by their rank alone
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders = holders_of.setdefault(_key(item), {})
            if rank in holders:
                keep[rank].append(item)  # the same bytes twice on one rank: read the extra one
            else:
                holders[rank] = item
    # Only reads several ranks share are looked up (the coordinator would
    # otherwise look up every rank's every item: 15 ms for 2 x 357 items).
    groups: dict[tuple[int, ...], list[_Shared]] = {}
    for key, holders in holders_of.items():
        first = next(iter(holders.values()))
        nbytes = item_bytes(first) if len(holders) > 1 else None
        if not nbytes:
            for rank, item in holders.items():
                keep[rank].append(item)
            continue
        groups.setdefault(tuple(sorted(holders)), []).append(_Shared(key, nbytes, item_order(first), holders))
    saved = sum(shared.nbytes * (len(ranks) - 1) for ranks, members in groups.items() for shared in members)
    if not groups or saved < min_saved:
        return [dataclasses.replace(p, storage_data=None) for p in plans]

    assigned: list[_Shared] = []
    for ranks, members in sorted(groups.items()):
        assigned += _assign_owners(ranks, sorted(members, key=lambda s: s.order), item_grain)
    # Transfer order: each owner's items in reading order; batch k holds the
    # k-th equal share of every owner's bytes.
    per_owner: dict[int, list[_Shared]] = {}
    for shared in assigned:
        per_owner.setdefault(shared.owner, []).append(shared)
    share = max(1, batch_bytes // max(1, len(per_owner)))
    batch_of: dict[int, int] = {}
    for owner_items in per_owner.values():
        done = 0
        for shared in owner_items:
            batch_of[id(shared)] = done // share
            done += shared.nbytes
    batches = 1 + max(batch_of.values())
    ordered = sorted(assigned, key=lambda s: (batch_of[id(s)], s.owner, s.order))

    items: list[list[ReadItem]] = [list(k) for k in keep]
    sends: list[list[Send]] = [[] for _ in range(world)]
    receives: list[list[Receive]] = [[] for _ in range(world)]
    segments = [[0] * batches for _ in range(world)]
    host = list(hosts) if hosts else [""] * world
    for shared in ordered:
        batch, owner = batch_of[id(shared)], shared.owner
        receivers = tuple(r for r in sorted(shared.holders) if r != owner)
        near = {r for r in receivers if host[owner] and host[r] == host[owner]}
        offset = -1
        if near:
            offset = segments[owner][batch]
            segments[owner][batch] += shared.nbytes
        for rank, item in sorted(shared.holders.items()):
            position = len(items[rank])
            items[rank].append(item)
            if rank == owner:
                remote = tuple(r for r in receivers if r not in near)
                sends[rank].append(Send(batch, position, receivers, shared.nbytes, remote, offset))
            else:
                via = offset if rank in near else -1
                receives[rank].append(Receive(batch, position, owner, shared.nbytes, via))
    return [
        dataclasses.replace(
            plan,
            items=items[rank],
            storage_data=RankExchange(rank, world, batches, tuple(sends[rank]), tuple(receives[rank]),
                                      exchange_id, tuple(segments[rank])),
        )
        for rank, plan in enumerate(plans)
    ]


def _assign_owners(
    ranks: tuple[int, ...], members: list[_Shared], item_grain: Callable[[ReadItem], int]
) -> list[_Shared]:
    """Cut ``members`` (in reading order) into one consecutive run of equal
    bytes per rank of ``ranks``, splitting an item at a cut when it is large
    enough; return the (possibly split) items with owners set."""
    total = sum(s.nbytes for s in members)
    n = len(ranks)
    out: list[_Shared] = []
    done = 0
    for shared in members:
        start_owner = min(n - 1, done * n // total)
        end_owner = min(n - 1, (done + shared.nbytes - 1) * n // total)
        pieces = [shared]
        if end_owner > start_owner:
            cuts = [(k * total) // n - done for k in range(start_owner + 1, end_owner + 1)]
            pieces = _split_at_cuts(shared, cuts, item_grain)
        for piece in pieces:
            middle = done + piece.nbytes // 2
            piece.owner = ranks[min(n - 1, middle * n // total)]
            out.append(piece)
            done += piece.nbytes
    return out


def _split_at_cuts(shared: _Shared, cuts: list[int], item_grain: Callable[[ReadItem], int]) -> list[_Shared]:
    """Split a shared tensor item at byte positions ``cuts`` (rounded to whole
    rows on the item's grain, pieces of at least :data:`MIN_PIECE`);
    unsplittable items stay whole."""
    some = next(iter(shared.holders.values()))
    if some.type != LoadItemType.TENSOR or len(some.lengths) == 0 or some.lengths[0] < 2:
        return [shared]
    rows = int(some.lengths[0])
    row_bytes = shared.nbytes // rows
    first = int(some.storage_offsets[0])
    grain = max(1, item_grain(some))
    bounds = [0]
    for cut in cuts:
        row = round(cut / row_bytes) if row_bytes else 0
        row = round((first + row) / grain) * grain - first  # on a frame boundary of the chunk
        if (row - bounds[-1]) * row_bytes >= MIN_PIECE and (rows - row) * row_bytes >= MIN_PIECE:
            bounds.append(row)
    bounds.append(rows)
    if len(bounds) == 2:
        return [shared]
    pieces = []
    for start, stop in zip(bounds, bounds[1:]):
        holders = {rank: _split(item, start, stop) for rank, item in shared.holders.items()}
        order = (*shared.order, start)
        pieces.append(_Shared(shared.key + (start,), (stop - start) * row_bytes, order, holders))
    return pieces
