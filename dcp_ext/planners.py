"""Save and load planners for the partial-checkpoint layout.

:class:`LayoutSavePlanner` is DCP's default save planner (which already
writes each tensor replicated across data-parallel ranks once, giving each
duplicate to the least loaded rank) plus two things: every rank's items go to
files named by kind and rank position (``model_rank3.distcp``,
``optimizer_dp0_tp1.distcp``), and the partition decision is recorded for
``partition.json``.

:class:`LayoutLoadPlanner` is DCP's default load planner, which works from
the checkpoint's metadata and so handles a changed partition, with two
changes: non-tensor values are unpickled with ``weights_only=True`` (a
checkpoint cannot run code on load), and ``strict=False`` tolerates keys the
checkpoint lacks.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import FLATTEN_MAPPING
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem, SavePlan

from .errors import CheckpointCorruptError
from .layout import MeshInfo, Partition, RankPartition, kind_of, position_name
from .writer import DATA_SUFFIX, FileAssignment

__all__ = ["LayoutSavePlanner", "LayoutLoadPlanner"]


class LayoutSavePlanner(DefaultSavePlanner):
    """Assigns each rank's items to per-kind files and records the partition.

    Every rank constructs one; the coordinator's ``create_global_plan``
    names the files of all ranks and fills :attr:`partition`.

    Args:
        mesh: The device mesh the state is sharded over; file names then carry
            mesh coordinates (``model_dp0_tp1.distcp``) instead of ranks.
        global_ranks: Global rank of each rank of the saving process group
            (identity when ``None``), to look ranks up in ``mesh``.

    Attributes:
        partition: The partition decision (on the coordinator, after planning).
    """

    def __init__(self, mesh: MeshInfo | None = None, global_ranks: Sequence[int] | None = None) -> None:
        # Plan caching returns only deltas to the ranks; the file assignment
        # must reach every rank, so it stays off.
        super().__init__(dedup_save_to_lowest_rank=False, enable_plan_caching=False)
        self.mesh = mesh
        self.global_ranks = list(global_ranks) if global_ranks is not None else None
        self.partition: Partition | None = None

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """(coordinator) Dedup, then name every rank's files and record who wrote what."""
        plans, metadata = super().create_global_plan(all_plans)
        assigned: list[SavePlan] = []
        ranks: list[RankPartition] = []
        for rank, plan in enumerate(plans):
            global_rank = self.global_ranks[rank] if self.global_ranks is not None else rank
            position = position_name(global_rank, self.mesh)
            keys: dict[str, set[str]] = {}
            for item in plan.items:
                keys.setdefault(kind_of(item.index.fqn), set()).add(item.index.fqn)
            by_kind = tuple((kind, f"{kind}_{position}{DATA_SUFFIX}") for kind in sorted(keys))
            assigned.append(dataclasses.replace(plan, storage_data=FileAssignment(by_kind=by_kind)))
            ranks.append(
                RankPartition(
                    rank=rank,
                    coords=self.mesh.coords(global_rank) if self.mesh is not None else {},
                    files=tuple(name for _, name in by_kind),
                    keys={kind: tuple(sorted(fqns)) for kind, fqns in sorted(keys.items())},
                )
            )
        self.partition = Partition(len(plans), self.mesh, tuple(ranks))
        return assigned, metadata


class LayoutLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with safe non-tensor values and an explicit strictness.

    Args:
        strict: Refuse a state dict with keys the checkpoint lacks (the
            default). With ``False`` those keys keep their current values.
    """

    def __init__(self, strict: bool = True) -> None:
        super().__init__(allow_partial_load=not strict)
        self.strict = strict

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle a non-tensor value with ``weights_only=True``: plain data only."""
        fqn = read_item.dest_index.fqn
        try:
            obj: Any = torch.load(value, weights_only=True)
        except Exception as err:
            raise CheckpointCorruptError(
                f"checkpoint value {fqn!r} is not plain data (loading it would need "
                f"arbitrary unpickling, which dcp_ext refuses): {err}",
                fqn,
            ) from err
        if self.flatten_state_dict:
            mappings: FLATTEN_MAPPING = self.mappings
            set_element(self.original_state_dict, mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
