"""Plans: which rank writes what where (save planner, global plan, plan columns, write results) and which bytes a load reads (load planner, tensor reads)."""

from __future__ import annotations

from ._load_planner import LayoutLoadPlanner
from ._save_planner import LayoutSavePlanner
from ._tensor_reads import ChunkShapes
from ._write_results import collect_stored, pack_results

__all__ = [
    "ChunkShapes",
    "LayoutLoadPlanner",
    "LayoutSavePlanner",
    "collect_stored",
    "pack_results",
]
