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

from .load_planner import LayoutLoadPlanner
from .save_planner import LayoutSavePlanner

__all__ = ["LayoutSavePlanner", "LayoutLoadPlanner"]
