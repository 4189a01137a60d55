"""Peer replicas: data files sent between nodes over the process group.

With ``replicas=1``, node ``n``'s data files of a tag are also kept by its
partner node (:meth:`~dcp_ext.nodes.NodeMap.partner_of`), in the partner's
own local-tier directory for that tag. Files move only over the process
group (gloo point-to-point sends of 64 MiB pieces); no rank ever opens
another node's path.

:func:`send_files` is the one transfer primitive: a list of
:class:`Transfer` records, identical on every rank, says which rank reads
which file from its node's tier and which rank writes it into its own.
Saves use it to replicate; restores use it to bring a wiped node's files
back from its partner before loading.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._failpoints import crash_point
from .errors import DcpExtError
from .process_group import GroupView
from .storage import ObjectWriter, Store

__all__ = ["Transfer", "send_files", "replica_transfers"]

log = logging.getLogger("dcp_ext.replicas")

_PIECE = 64 << 20


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


def send_files(group: GroupView, transfers: Sequence[Transfer], source: Store | None, target: Store | None) -> None:
    """(all ranks) Run ``transfers``: this rank sends what it is the source of
    (read from ``source``) and writes what it is the target of (into
    ``target``, each file committed whole or not at all).

    Every rank raises the same error if any transfer failed on any rank.
    """
    rank = group.rank
    error: str | None = None
    try:
        _run(group, rank, transfers, source, target)
    except (DcpExtError, OSError, RuntimeError) as err:
        error = f"rank {rank}: {err}"
    errors = [e for e in group.all_gather(error) if e is not None]
    if errors:
        raise DcpExtError("sending data files between nodes failed: " + "; ".join(errors))


def _run(group: GroupView, rank: int, transfers: Sequence[Transfer], source: Store | None,
         target: Store | None) -> None:
    # Pieces go in one global order, so a send and its receive always match.
    pieces = [(t, offset) for t in transfers for offset in range(0, max(t.size, 1), _PIECE)
              if rank in (t.source, t.target)]
    writers: dict[str, ObjectWriter] = {}
    try:
        for transfer, offset in pieces:
            crash_point("mid_replication")
            length = min(_PIECE, transfer.size - offset)
            if transfer.source == transfer.target:
                raise DcpExtError(f"transfer of {transfer.name} from rank {rank} to itself")
            if transfer.source == rank:
                assert source is not None
                data = source.read_range(transfer.name, offset, length) if length else b""
                tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
                dist.send(tensor, dst=_global(group, transfer.target), group=group.group)
            else:
                assert target is not None
                buffer = torch.empty(length, dtype=torch.uint8)
                dist.recv(buffer, src=_global(group, transfer.source), group=group.group)
                writer = writers.get(transfer.name)
                if writer is None:
                    writer = writers[transfer.name] = target.open_writer(transfer.name, size_hint=transfer.size)
                writer.write(memoryview(buffer.numpy()))
                if offset + _PIECE >= transfer.size:
                    writers.pop(transfer.name).commit()
    finally:
        for writer in writers.values():
            writer.abort()


def _global(group: GroupView, rank: int) -> int:
    return dist.get_global_rank(group.group, rank) if group.group is not None else rank
