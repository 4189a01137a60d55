"""Plans: which rank writes what where (save planner, global plan, plan columns, write results) and which bytes a load reads (load planner, tensor reads, per-rank state and its rule across world sizes)."""

from __future__ import annotations

from ._load_planner import LayoutLoadPlanner
from ._rank_state import (
    RankStateLoadPlanner,
    RankStateRule,
    encode_rank_state,
    redistribute_dataloader,
    with_rank_state,
)
from ._save_planner import LayoutSavePlanner
from ._tensor_reads import ChunkShapes
from ._write_results import collect_stored, pack_results

__all__ = [
    "ChunkShapes",
    "LayoutLoadPlanner",
    "LayoutSavePlanner",
    "RankStateLoadPlanner",
    "RankStateRule",
    "encode_rank_state",
    "redistribute_dataloader",
    "with_rank_state",
    "collect_stored",
    "pack_results",
]
