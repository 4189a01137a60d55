"""The save planner of the partial-checkpoint layout.

:class:`LayoutSavePlanner` is DCP's default save planner (which already
writes each tensor replicated across data-parallel ranks once, giving each
duplicate to the least loaded rank) plus two things: every rank's items go to
files named by kind and rank position (``model_rank3.distcp``,
``optimizer_dp0_tp1.distcp``), and the partition decision is recorded for
``partition.json``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .._runtime import gc_paused
from ..layout import (
    FileAssignment,
    MeshInfo,
    Partition,
    RankPartition,
    data_file_name,
    key_kind,
    position_name,
    spread_name,
)
from ._global_plan import create_global_save_plan
from ._plan_columns import NO_ITEM, CompactSavePlan, compact_plan

__all__ = ["LayoutSavePlanner"]

log = logging.getLogger("dcp_ext.planners")


class LayoutSavePlanner(DefaultSavePlanner):
    """Assigns each rank's items to per-kind files and records the partition.

    Every rank constructs one; the coordinator's ``create_global_plan``
    names the files of all ranks and fills :attr:`partition`.

    Args:
        mesh: The device mesh the state is sharded over; file names then carry
            mesh coordinates (``model_dp0_tp1.distcp``) instead of ranks.
        global_ranks: Global rank of each rank of the saving process group
            (identity when ``None``), to look ranks up in ``mesh``.
        nodes: Tiered saves: the node of each rank, recorded in ``partition.json``.
        partners: Tiered saves with replicas: each node's partner node, recorded too.
        replicated_apart: Put items that are not shards (plain tensors,
            non-tensor values) in ``replicated_*`` files of their own
            (tiered saves copy those to every node).
        key_prefixes: Deal the data files out over this many key prefixes
            (``30/model_rank3.distcp``, :func:`dcp_ext.layout.key_prefix`);
            ``0`` (default) keeps them directly in the checkpoint directory.
            The manager passes ``IOConfig.key_prefixes``.
        enable_plan_caching: DCP's plan caching: a rank whose plan is the
            same as in its previous save sends an empty one, and the
            coordinator reuses its previous global plan and metadata (with
            thousands of ranks, most of a save's planning). Off by default,
            as in DCP.
        plan_cache_name: Keeps this planner's cached plans apart from those of
            planners with another name (in the same process, world and
            layout), so that two states saved in turn (a model and its
            optimizer, say) each find their own previous plan.

    Attributes:
        partition: The partition decision (on the coordinator, after planning).
        gathered_items: Items in the plans the coordinator received in its
            last planning (``0`` when every rank's plan came from the cache).
    """

    # The coordinator's partition of each cached global plan, by cache key.
    _cached_partition: dict[str, Partition] = {}
    # ... and which rank writes each chunk (ChunkWriters), which the metadata carries until commit.
    _cached_writers: dict[str, Any] = {}

    def __init__(
        self,
        mesh: MeshInfo | None = None,
        global_ranks: Sequence[int] | None = None,
        nodes: Sequence[int] = (),
        partners: Sequence[int] = (),
        replicated_apart: bool = False,
        key_prefixes: int = 0,
        enable_plan_caching: bool = False,
        plan_cache_name: str = "",
    ) -> None:
        super().__init__(dedup_save_to_lowest_rank=False, enable_plan_caching=enable_plan_caching)
        self.gathered_items = 0
        self.mesh = mesh
        self.global_ranks = list(global_ranks) if global_ranks is not None else None
        self.nodes, self.partners = tuple(nodes), tuple(partners)
        self.replicated_apart = replicated_apart
        self.key_prefixes = key_prefixes
        self.plan_cache_name = plan_cache_name
        self.partition: Partition | None = None

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Dedup, then name every rank's files and record who wrote what."""
        self.gathered_items = sum(
            len(plan.planner_data) if isinstance(plan.planner_data, CompactSavePlan) else len(plan.items)
            for plan in all_plans
        )
        with gc_paused():  # millions of live objects at scale make each full collection costly
            if not self._enable_plan_caching:
                return self._create_global_plan(all_plans)
            # DCP's caching calls _create_global_plan when a plan changed, and
            # otherwise answers every rank "unchanged" (finish_plan then uses
            # the rank's previous final plan, files included).
            self.partition = None
            answers, metadata = super().create_global_plan(all_plans)
            key = self._cached_plans_key
            if self.partition is None:  # the cached global plan: its partition and chunk writers too
                self.partition = LayoutSavePlanner._cached_partition[key]
                metadata.storage_data = LayoutSavePlanner._cached_writers[key]
            LayoutSavePlanner._cached_partition[key] = self.partition
            LayoutSavePlanner._cached_writers[key] = metadata.storage_data  # the writer's finish replaces it
            return answers, metadata

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """(all ranks) DCP's set-up; the plan cache is kept per layout and world size."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._cached_plans_key = (
            f"{type(self).__name__}/{world}/{self.mesh}/{self.global_ranks}/{self.replicated_apart}/{self.key_prefixes}"
            f"/{self.plan_cache_name}"
        )

    def create_local_plan(self) -> SavePlan:
        """(all ranks) DCP's local plan, sent to the coordinator as a
        :class:`~dcp_ext.planning._plan_columns.CompactSavePlan`; the rank keeps its items."""
        plan = super().create_local_plan()
        if self._enable_plan_caching and not plan.usable:
            return plan  # unchanged since the last save: DCP sends nothing
        return SavePlan([], planner_data=compact_plan(self.plan), usable=plan.usable)

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        planned = create_global_save_plan(all_plans)
        metadata = self.metadata = planned.metadata
        kinds = {
            entry.fqn: key_kind(entry.fqn, entry.kind == WriteItemType.SHARD.value, self.replicated_apart)
            for entry in planned.keys
            if entry.kind != NO_ITEM
        }
        assigned: list[SavePlan] = []
        ranks: list[RankPartition] = []
        named = 0  # files named so far, dealt out over the key prefixes
        by_kind_of: dict[tuple[str, ...], dict[str, tuple[str, ...]]] = {}  # ranks of one layout share them
        for rank, (dropped, written) in enumerate(zip(planned.dropped, planned.written_keys)):
            global_rank = self.global_ranks[rank] if self.global_ranks is not None else rank
            position = position_name(global_rank, self.mesh)
            keys = by_kind_of.get(written)
            if keys is None:
                grouped: dict[str, list[str]] = {}
                for fqn in written:
                    grouped.setdefault(kinds[fqn], []).append(fqn)
                keys = by_kind_of[written] = {kind: tuple(sorted(fqns)) for kind, fqns in sorted(grouped.items())}
            by_kind = tuple(
                (kind, spread_name(data_file_name(kind, position), named + i, self.key_prefixes))
                for i, kind in enumerate(keys)
            )
            named += len(by_kind)
            assignment = FileAssignment(by_kind=by_kind, replicated_apart=self.replicated_apart)
            left = _LeftToOthers(tuple(dropped.tolist()))
            # Each rank keeps its own items (finish_plan): only what it leaves to others travels back.
            # With plan caching DCP compares each answer's items with the
            # cached answer's to tell a rank "unchanged": the answer then
            # carries one stand-in item naming its content.
            items = [_answer_item(all_plans[rank], assignment, left)] if self._enable_plan_caching else []
            assigned.append(SavePlan(items, storage_data=assignment, planner_data=left))
            ranks.append(
                RankPartition(
                    rank=rank,
                    coords=self.mesh.coords(global_rank) if self.mesh is not None else {},
                    files=tuple(name for _, name in by_kind),
                    keys=keys,
                )
            )
        self.partition = Partition(len(all_plans), self.mesh, tuple(ranks), self.nodes, self.partners)
        return assigned, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """(all ranks) This rank's own plan, less the items another rank writes, with its files."""
        left = new_plan.planner_data
        if not isinstance(left, _LeftToOthers):
            return super().finish_plan(new_plan)  # DCP's: with caching, "unchanged" means the previous final plan
        items = self.plan.items
        if left.positions:
            skip = set(left.positions)
            items = [item for i, item in enumerate(items) if i not in skip]
        final = dataclasses.replace(self.plan, items=items, storage_data=new_plan.storage_data)
        return super().finish_plan(final)


@dataclasses.dataclass(frozen=True)
class _LeftToOthers:
    """The coordinator's answer to one rank: the positions, in its local plan,
    of the items another rank writes instead."""

    positions: tuple[int, ...]


def _answer_item(plan: SavePlan, assignment: FileAssignment, left: _LeftToOthers) -> WriteItem:
    """A stand-in item naming an answer: the rank's plan, its files, what it leaves to others."""
    digest = xxhash.xxh3_128()
    sent = plan.planner_data
    if isinstance(sent, CompactSavePlan):
        digest.update(sent.keys)
        digest.update(sent.rows)
    else:
        digest.update(repr(plan.items).encode())
    digest.update(repr((assignment, left.positions)).encode())
    return WriteItem(MetadataIndex(f"dcp_ext answer {digest.hexdigest()}"), WriteItemType.BYTE_IO)


def _sorted_once(cache: dict[frozenset[str], tuple[str, ...]], keys: set[str]) -> tuple[str, ...]:
    frozen = frozenset(keys)
    found = cache.get(frozen)
    if found is None:
        found = cache[frozen] = tuple(sorted(frozen))
    return found
