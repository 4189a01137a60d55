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
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from .._runtime import gc_paused
from ..errors import PlanCacheError, PlanMismatchError
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
from ._plan_cache import PLAN_CACHE, CachedGlobalPlan, PlanClaim, fingerprint
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
        enable_plan_caching: Plan caching (:mod:`dcp_ext.planning._plan_cache`,
            not DCP's own): a rank whose plan is bit for bit the one of its
            last successful save sends only its fingerprint, and the
            coordinator reuses its previous global plan and metadata when
            every rank's fingerprint matches what it holds (with thousands
            of ranks, most of a save's planning). Dtypes, shapes, chunks and
            keys are all part of the fingerprint; a save that fails leaves
            no cached plan behind. Off by default, as in DCP.
        plan_cache_name: Keeps this planner's cached plans apart from those of
            planners with another name (in the same process, world and
            layout), so that two states saved in turn (a model and its
            optimizer, say) each find their own previous plan.

    Attributes:
        partition: The partition decision (on the coordinator, after planning).
        gathered_items: Items in the plans the coordinator received in its
            last planning (``0`` when every rank's plan came from the cache).
        reused_global_plan: With caching, on the coordinator: its last
            planning reused the whole cached global plan.
        cache_key: Where this planner's cached plans are kept (set up per save).
    """

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
        # DCP's own caching stays off: it compares plans without their dtypes
        # and leaves its caches half updated by a refused save (issue 40).
        # This planner caches by dcp_ext.planning._plan_cache's rule instead.
        super().__init__(dedup_save_to_lowest_rank=False, enable_plan_caching=False)
        self.caching = enable_plan_caching
        """Whether dcp_ext's plan caching is on (``enable_plan_caching``): a save whose plans match
        the last successful one's reuses its global plan and metadata."""
        self.gathered_items = 0
        self.mesh = mesh
        self.global_ranks = list(global_ranks) if global_ranks is not None else None
        self.nodes, self.partners = tuple(nodes), tuple(partners)
        self.replicated_apart = replicated_apart
        self.key_prefixes = key_prefixes
        self.plan_cache_name = plan_cache_name
        self.partition: Partition | None = None
        self.cache_key = ""
        self.reused_global_plan = False
        self._fingerprint: bytes | None = None  # this rank's plan, to keep once the global plan succeeded
        self._planned: CachedGlobalPlan | None = None  # the coordinator's record, likewise

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """(all ranks) DCP's set-up; the plan cache is kept per layout and world size."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.cache_key = (
            f"{type(self).__name__}/{world}/{self.mesh}/{self.global_ranks}/{self.nodes}/{self.partners}"
            f"/{self.replicated_apart}/{self.key_prefixes}/{self.plan_cache_name}"
        )
        self._fingerprint = self._planned = None
        if self.caching:
            PLAN_CACHE.begin(self.cache_key)

    def forget_cached_plans(self) -> None:
        """(every rank) Drop what is cached under this planner's key (after a failed save)."""
        if self.cache_key:
            PLAN_CACHE.drop(self.cache_key)

    def create_local_plan(self) -> SavePlan:
        """(all ranks) DCP's local plan, sent to the coordinator as a
        :class:`~dcp_ext.planning._plan_columns.CompactSavePlan` (with
        caching, only its fingerprint when it is the cached one); the rank
        keeps its items."""
        plan = super().create_local_plan()
        compact = compact_plan(self.plan)
        if self.caching:
            print_ = fingerprint(compact)
            if PLAN_CACHE.claim(self.cache_key, print_):
                return SavePlan([], planner_data=PlanClaim(print_), usable=False)
            self._fingerprint = print_
        return SavePlan([], planner_data=compact, usable=plan.usable)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Dedup, then name every rank's files and record who wrote what.

        Raises:
            PlanCacheError: With caching, a rank claims a cached plan that
                this coordinator does not hold (nothing was locked or written;
                dcp_ext's saves plan again).
        """
        self.reused_global_plan = False
        with gc_paused():  # millions of live objects at scale make each full collection costly
            if not self.caching:
                self.gathered_items = _items_in(all_plans)
                return self._create_global_plan(all_plans)
            cached = PLAN_CACHE.cached_global(self.cache_key)
            plans = _with_claims_resolved(all_plans, cached, self.cache_key)
            self.gathered_items = _items_in(all_plans)
            if cached is not None and all(isinstance(p.planner_data, PlanClaim) for p in all_plans):
                self.reused_global_plan = True
                self.partition = cached.partition
                self.metadata = metadata = cached.fresh_metadata()
                self._planned = cached
                return [dataclasses.replace(answer) for answer in cached.answers], metadata
            answers, metadata = self._create_global_plan(plans)
            compact = tuple(p.planner_data for p in plans)
            self._planned = CachedGlobalPlan(
                plans=compact,
                fingerprints=tuple(fingerprint(p) for p in compact),
                answers=tuple(answers),
                metadata=dataclasses.replace(metadata),
                partition=self.partition,
                writers=metadata.storage_data,
            )
            return answers, metadata

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
            assigned.append(SavePlan([], storage_data=assignment, planner_data=left))
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
        """(all ranks) This rank's own plan, less the items another rank writes, with its files.

        With caching, the global plan (the writer's checks included) has
        succeeded by now: this rank's fingerprint (and the coordinator's
        record) are kept for the next save.
        """
        left = new_plan.planner_data
        if not isinstance(left, _LeftToOthers):
            raise PlanMismatchError(
                f"the coordinator's answer to this rank is a {type(left).__name__}, not a dcp_ext file "
                f"assignment: was the global plan made by a LayoutSavePlanner on every rank?"
            )
        items = self.plan.items
        if left.positions:
            skip = set(left.positions)
            items = [item for i, item in enumerate(items) if i not in skip]
        final = dataclasses.replace(self.plan, items=items, storage_data=new_plan.storage_data)
        if self.caching:
            PLAN_CACHE.promote(self.cache_key, self._fingerprint, self._planned)
            self._fingerprint = self._planned = None
        self.plan = final
        return final


@dataclasses.dataclass(frozen=True)
class _LeftToOthers:
    """The coordinator's answer to one rank: the positions, in its local plan,
    of the items another rank writes instead."""

    positions: tuple[int, ...]


def _items_in(plans: Sequence[SavePlan]) -> int:
    """Items in the plans the coordinator received (claims hold none)."""
    return sum(
        len(plan.planner_data) if isinstance(plan.planner_data, CompactSavePlan) else len(plan.items)
        for plan in plans
    )


def _with_claims_resolved(plans: Sequence[SavePlan], cached: CachedGlobalPlan | None, key: str) -> list[SavePlan]:
    """Every rank's plan, a claim replaced by the cached plan it matches.

    Raises:
        PlanCacheError: A claim matches no cached plan of that rank.
    """
    resolved = []
    for rank, plan in enumerate(plans):
        claim = plan.planner_data
        if not isinstance(claim, PlanClaim):
            resolved.append(plan)
            continue
        if cached is None or len(cached.plans) != len(plans) or cached.fingerprints[rank] != claim.fingerprint:
            PLAN_CACHE.drop(key)
            held = "holds no cached plan" if cached is None else "holds another plan of that rank"
            raise PlanCacheError(
                f"rank {rank} sent only the fingerprint of its cached save plan, but the coordinator "
                f"{held} under {key!r} (a save under this cache name failed on some ranks, or another "
                f"process took the rank's place); nothing was written, and the next save plans afresh"
            )
        resolved.append(SavePlan([], planner_data=cached.plans[rank], usable=True))
    return resolved


def _sorted_once(cache: dict[frozenset[str], tuple[str, ...]], keys: set[str]) -> tuple[str, ...]:
    frozen = frozenset(keys)
    found = cache.get(frozen)
    if found is None:
        found = cache[frozen] = tuple(sorted(frozen))
    return found
