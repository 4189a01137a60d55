"""Which node each rank runs on, for the node-local checkpoint tier.

A rank's node is, in order of precedence:

1. ``DCP_EXT_NODE_RANK`` from the environment (read when the
   :class:`~dcp_ext.CheckpointManager` is created): lets tests and unusual
   launchers say which ranks share a node, e.g. to simulate several nodes on
   one machine with one local-tier directory per simulated node;
2. ``GROUP_RANK``, which ``torchrun`` sets to the node's index;
3. the host name.

Ranks that report the same identity share a node (and its local tier).
Nodes are numbered by the lowest rank on them; the lowest rank of a node is
its *leader*, the one rank that writes the node's shared files. With
replicas, node ``n``'s partner is node ``(n + 1) % nodes``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

from .group import GroupView

__all__ = ["NODE_RANK_ENV", "NodeMap", "local_node_identity"]

NODE_RANK_ENV = "DCP_EXT_NODE_RANK"


def local_node_identity() -> str:
    """This process's node identity (see the module docstring)."""
    explicit = os.environ.get(NODE_RANK_ENV, "").strip()
    if explicit:
        return f"node:{explicit}"
    group_rank = os.environ.get("GROUP_RANK", "").strip()
    if group_rank:
        return f"node:{group_rank}"
    return f"host:{socket.gethostname()}"


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank of a process group.

    Attributes:
        identities: Node identity of each group rank (index = group rank).
    """

    identities: tuple[str, ...]

    @classmethod
    def gather(cls, group: GroupView, identity: str | None = None) -> NodeMap:
        """(all ranks of ``group``) Every rank's node identity."""
        mine = identity if identity is not None else local_node_identity()
        if not group.distributed:
            return cls((mine,))
        every: list[str | None] = [None] * group.world_size
        dist.all_gather_object(every, mine, group=group.group)
        return cls(tuple(str(x) for x in every))

    @property
    def world_size(self) -> int:
        return len(self.identities)

    @property
    def node_count(self) -> int:
        return len(self._order)

    @property
    def _order(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for identity in self.identities:
            seen.setdefault(identity, None)
        return tuple(seen)

    def node_of(self, rank: int) -> int:
        """The node index of group rank ``rank`` (nodes numbered by their lowest rank)."""
        return self._order.index(self.identities[rank])

    def ranks_on(self, node: int) -> list[int]:
        """Group ranks on node ``node``, ascending."""
        identity = self._order[node]
        return [r for r, i in enumerate(self.identities) if i == identity]

    def leader_of(self, node: int) -> int:
        """The lowest group rank on node ``node``: the one that writes its shared files."""
        return self.ranks_on(node)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader_of(self.node_of(rank)) == rank

    def partner_of(self, node: int) -> int:
        """The node that keeps node ``node``'s replicas (itself when there is one node)."""
        return (node + 1) % self.node_count
