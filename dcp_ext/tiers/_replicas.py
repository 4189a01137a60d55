"""Peer replicas: data files sent between nodes over the process group.

With ``replicas=1``, node ``n``'s data files of a tag are also kept by its
partner node (:meth:`~dcp_ext._runtime.NodeMap.partner_of`), in the partner's
own local-tier directory for that tag. Files move only over the process
group (gloo point-to-point sends of 64 MiB pieces, both directions at once); no rank ever opens
another node's path.

:func:`send_files` is the one transfer primitive: a list of
:class:`Transfer` records, identical on every rank, says which rank reads
which file from its node's tier and which rank writes it into its own.
Saves use it to replicate; restores use it to bring a wiped node's files
back from its partner before loading.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._runtime import GroupView, crash_point, validate_relative_name
from ..errors import DcpExtError
from ..format import tensor_bytes
from ..storage import ObjectWriter, ReadRequest, Store

__all__ = ["Transfer", "send_files", "replica_transfers", "check_transfers"]

log = logging.getLogger("dcp_ext.replicas")

_PIECE = 64 << 20
#: Largest file a transfer may claim (1 PiB): a size from a peer is checked
#: before pieces are planned from it.
_MAX_FILE = 1 << 50


@dataclass(frozen=True)
class Transfer:
    """One file from one rank's node tier to another rank's.

    Attributes:
        name: The data file.
        size: Its size in bytes.
        source: Group rank that reads it from its node's tier.
        target: Group rank that writes it into its node's tier.
    """

    name: str
    size: int
    source: int
    target: int


def replica_transfers(rank_files: Sequence[Sequence[tuple[str, int]]], node_of: Sequence[int],
                      partner_of: dict[int, int], ranks_on: dict[int, list[int]]) -> list[Transfer]:
    """Every rank's own files to the rank with the same place on its partner node.

    Args:
        rank_files: ``(name, size)`` of each rank's data files, by group rank.
        node_of: Node of each group rank.
        partner_of: Partner node of each node.
        ranks_on: Ranks of each node, ascending.
    """
    out = []
    for rank, files in enumerate(rank_files):
        node = node_of[rank]
        partner = partner_of[node]
        if partner == node:
            continue  # one node: nowhere else to keep a copy
        peers = ranks_on[partner]
        target = peers[ranks_on[node].index(rank) % len(peers)]
        out += [Transfer(name, size, rank, target) for name, size in files]
    return out


def send_files(group: GroupView, transfers: Sequence[Transfer], source: Store | None, target: Store | None,
               sent: Callable[[], None] | None = None) -> None:
    """(all ranks) Run ``transfers``: this rank sends what it is the source of
    (read from ``source``) and writes what it is the target of (into
    ``target``, each file committed whole or not at all: a file whose last
    piece never came is never under its name, so no inventory counts it).

    Sends run on a thread of their own while this thread receives and writes,
    so both directions of a pair of nodes and the disk work overlap; each
    direction keeps one global order, so a send and its receive always match.
    A rank that fails (a read, a write) still exchanges every piece, so no peer
    waits for it forever, then every rank raises the same error.

    Args:
        sent: Called once this rank's own sends and receives are over (before
            the exchange of errors): the caller's watch reports the rank
            there, so a peer still transferring is told from one waiting.

    Raises:
        UnsafeNameError: A file name in ``transfers`` (which peers made from
            their tiers' files) is not a plain relative name; every rank
            raises it before anything is read, sent or written.
        DcpExtError: A transfer is malformed, or a transfer failed.
        RuntimeError: The process group failed (a peer died or was cut off:
            gloo's error at the group's timeout); the caller's watch names the peer.
    """
    rank = group.rank
    check_transfers(transfers, group.world_size)
    pieces = [(tag, transfer, offset) for tag, (transfer, offset) in enumerate(
        (t, offset) for t in transfers for offset in range(0, max(t.size, 1), _PIECE))]
    outgoing = [p for p in pieces if p[1].source == rank]
    incoming = [p for p in pieces if p[1].target == rank]
    errors: list[str] = []
    sender = None
    if outgoing:
        assert source is not None
        sender = threading.Thread(target=_guarded, args=(_send_all, group, outgoing, source, errors),
                                  name="dcp_ext-replica-send", daemon=True)
        sender.start()
    try:
        if incoming:
            assert target is not None
            _guarded(_receive_all, group, incoming, target, errors)
    finally:
        if sender is not None:
            sender.join()
    if sent is not None:
        sent()
    mine = f"rank {rank}: {'; '.join(errors)}" if errors else None
    every = [e for e in group.all_gather(mine) if e is not None]
    if every:
        raise DcpExtError("sending data files between nodes failed: " + "; ".join(every))


def check_transfers(transfers: Sequence[Transfer], world_size: int) -> None:
    """Refuse transfers that are not plain files between two ranks of the group.

    ``transfers`` is identical on every rank, so every rank refuses alike
    without a collective.

    Raises:
        UnsafeNameError: A name that could leave the tier directory.
        DcpExtError: A size or rank out of range, or a rank sending to itself.
    """
    for transfer in transfers:
        where = f"the data files list of rank {transfer.source!r} (sent to rank {transfer.target!r})"
        validate_relative_name(transfer.name, where, "data file")
        size, ranks = transfer.size, (transfer.source, transfer.target)
        if type(size) is not int or not 0 <= size <= _MAX_FILE:
            raise DcpExtError(f"{where}: {transfer.name} has an invalid size {size!r}; refusing the transfer")
        if any(type(r) is not int or not 0 <= r < world_size for r in ranks):
            raise DcpExtError(f"{where}: transfer of {transfer.name} between ranks outside the group of {world_size}")
        if transfer.source == transfer.target:
            raise DcpExtError(f"transfer of {transfer.name} from rank {transfer.source} to itself")


_Piece = tuple[int, Transfer, int]


def _guarded(step: Any, group: GroupView, pieces: Sequence[_Piece], store: Store, errors: list[str]) -> None:
    """Run a send or receive loop; a failure of the process group itself
    (a peer died) is recorded, for the all-gather that follows to report."""
    try:
        step(group, pieces, store, errors)
    except (DcpExtError, OSError, RuntimeError) as err:
        errors.append(f"{step.__name__.strip('_').replace('_', ' ')}: {err}")


def _send_all(group: GroupView, pieces: Sequence[_Piece], source: Store, errors: list[str]) -> None:
    """(sender thread) Read each piece into a buffer and send it; two buffers
    alternate, so the next read runs while the last piece is on the wire."""
    buffers = [torch.empty(min(_PIECE, max(t.size for _, t, _ in pieces)), dtype=torch.uint8) for _ in range(2)]
    in_flight: list[Any] = [None, None]
    for i, (tag, transfer, offset) in enumerate(pieces):
        crash_point("mid_replication")
        slot = i % 2
        if in_flight[slot] is not None:
            in_flight[slot].wait()
        length = min(_PIECE, transfer.size - offset)
        buffer = buffers[slot][:length]
        if length and not errors:
            try:
                source.read([ReadRequest(transfer.name, offset, length, ((0, tensor_bytes(buffer)),))])
            except (DcpExtError, OSError) as err:
                errors.append(f"reading {source.describe(transfer.name)}: {err}")
        in_flight[slot] = dist.isend(buffer, dst=_global(group, transfer.target), group=group.group, tag=tag)
    for work in in_flight:
        if work is not None:
            work.wait()


def _receive_all(group: GroupView, pieces: Sequence[_Piece], target: Store, errors: list[str]) -> None:
    """Receive each piece and write it; the next piece's receive is posted
    before this one is written. After an error the rest is received and dropped."""
    size = min(_PIECE, max(t.size for _, t, _ in pieces))
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    writers: dict[str, ObjectWriter] = {}

    def post(i: int) -> Any:
        tag, transfer, offset = pieces[i]
        length = min(_PIECE, transfer.size - offset)
        return dist.irecv(buffers[i % 2][:length], src=_global(group, transfer.source), group=group.group, tag=tag)

    try:
        pending = post(0)
        for i, (_, transfer, offset) in enumerate(pieces):
            crash_point("mid_replication")
            pending.wait()
            if i + 1 < len(pieces):
                pending = post(i + 1)  # lands in the other buffer while this one is written
            if errors:
                continue
            length = min(_PIECE, transfer.size - offset)
            try:
                writer = writers.get(transfer.name)
                if writer is None:
                    writer = writers[transfer.name] = target.open_writer(transfer.name, size_hint=transfer.size)
                writer.write(tensor_bytes(buffers[i % 2])[:length])
                if offset + _PIECE >= transfer.size:
                    writers.pop(transfer.name).commit()
            except (DcpExtError, OSError) as err:
                errors.append(f"writing {target.describe(transfer.name)}: {err}")
    finally:
        for writer in writers.values():
            writer.abort()


def _global(group: GroupView, rank: int) -> int:
    return dist.get_global_rank(group.group, rank) if group.group is not None else rank
