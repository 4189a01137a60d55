"""Choosing what a tiered restore reads: every node's inventory and the root's tags -> :class:`RestorePlan`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._runtime import NodeMap
from ..layout import DATA_SUFFIX, REPLICATED_KIND, TagInfo
from ._replicas import Transfer

__all__ = ["LocalTagState", "NodeInventory", "RestorePlan", "plan_restore", "local_fetches", "is_replicated_file"]


@dataclass(frozen=True)
class LocalTagState:
    """One node's committed copy of one tag.

    Attributes:
        tag: The tag.
        created: When it was saved (the metadata's time).
        files: Data files present on the node (own and replicas), with their sizes.
        rank_files: Data files of each saving rank (from ``partition.json``).
    """

    tag: str
    created: float
    files: dict[str, int]
    rank_files: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class NodeInventory:
    """What a node's local tier holds: its committed tags (by the node's leader)."""

    node: int
    tags: dict[str, LocalTagState] = field(default_factory=dict)


def is_replicated_file(name: str) -> bool:
    """Whether data file ``name`` holds the replicated items of a tiered save."""
    base = name.rpartition("/")[2]  # under a key prefix (IOConfig.key_prefixes) or not
    return base.startswith(f"{REPLICATED_KIND}_") and base.endswith(DATA_SUFFIX)


@dataclass(frozen=True)
class RestorePlan:
    """Where a restore reads ``tag`` from.

    Attributes:
        tag: The tag to load.
        local_nodes: Nodes whose local tier has the tag committed.
        in_root: Whether the persistent root has it committed.
        local_complete: Every saving rank's files are on its own node or,
            as replicas, on its partner (the current world is the saving
            one), so no byte need come from the root.
        fetches: Files to bring from partners before loading (wiped nodes).
        healed_nodes: Nodes that get the tag committed by those fetches.
        gathered: The tag is only in the local tiers and the current world
            is not the saving one: every node is sent every file it lacks
            (more bytes than a load reads, but none from the root).
    """

    tag: str
    local_nodes: frozenset[int]
    in_root: bool
    local_complete: bool
    fetches: tuple[Transfer, ...] = ()
    healed_nodes: frozenset[int] = frozenset()
    gathered: bool = False


def local_fetches(tag: str, inventories: Sequence[NodeInventory], nodes: NodeMap,
                  every_file: bool = False) -> tuple[Transfer, ...] | None:
    """The files to bring from partner nodes so that every saving rank's files of
    ``tag`` are on its own node (empty: none missing); ``None`` if the local
    tiers cannot provide them (or the world is not the saving one).

    With ``every_file`` (a world other than the saving one, which may read any
    file), every node is to hold every file, each received by one of its ranks.
    """
    by_node = {inv.node: inv.tags.get(tag) for inv in inventories}
    states = [s for s in by_node.values() if s is not None]
    if not states:
        return None
    rank_files = states[0].rank_files
    if (len(rank_files) == nodes.world_size) == every_file:
        return None
    shared = sorted(name for files in rank_files for name in files if is_replicated_file(name))
    fetches = []
    for node in range(nodes.node_count):
        state = by_node.get(node)
        have = state.files if state is not None else {}
        # A node needs its ranks' files and every replicated file.
        ranks = nodes.ranks_on(node)
        if every_file:
            names = sorted({name for files in rank_files for name in files})
            needed = [(name, ranks[i % len(ranks)]) for i, name in enumerate(names)]
        else:
            needed = [(name, rank) for rank in ranks for name in rank_files[rank] if not is_replicated_file(name)]
            needed += [(name, nodes.leader_of(node)) for name in shared]
        for name, receiver in needed:
            if name in have:
                continue
            # From the partner (which keeps the node's replicas), else any node that has it.
            sources = [nodes.partner_of(node)] + [n for n in range(nodes.node_count) if n != node]
            source = next((n for n in sources if n != node and by_node.get(n) is not None
                           and name in by_node[n].files), None)  # type: ignore[union-attr]
            if source is None:
                return None
            peers = nodes.ranks_on(source)
            sender = peers[nodes.ranks_on(node).index(receiver) % len(peers)]
            fetches.append(Transfer(name, by_node[source].files[name], sender, receiver))  # type: ignore[union-attr]
    return tuple(fetches)


def plan_restore(
    inventories: Sequence[NodeInventory],
    root_tags: Sequence[TagInfo],
    nodes: NodeMap,
    tag: str | None = None,
) -> RestorePlan | None:
    """The newest tag readable from the local tiers or the root (or ``tag``);
    ``None`` if there is none. Pure: every rank computes the same plan."""
    created: dict[str, float] = {t.tag: t.committed_at for t in root_tags}
    for inv in inventories:
        for state in inv.tags.values():
            created[state.tag] = max(created.get(state.tag, 0.0), state.created)
    in_root = {t.tag for t in root_tags}
    candidates = [tag] if tag is not None else sorted(created, key=lambda t: (created[t], t), reverse=True)
    for candidate in candidates:
        local_nodes = frozenset(inv.node for inv in inventories if candidate in inv.tags)
        fetches = local_fetches(candidate, inventories, nodes)
        if fetches is not None:
            healed = frozenset(nodes.node_of(t.target) for t in fetches) - local_nodes
            return RestorePlan(candidate, local_nodes, candidate in in_root, True, fetches, healed)
        if candidate in in_root:
            return RestorePlan(candidate, local_nodes, True, False)
        fetches = local_fetches(candidate, inventories, nodes, every_file=True)
        if fetches is not None:
            healed = frozenset(nodes.node_of(t.target) for t in fetches) - local_nodes
            return RestorePlan(candidate, local_nodes, False, True, fetches, healed, gathered=True)
    return None
