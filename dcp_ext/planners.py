"""The planners of the partial-checkpoint layout, in one import.

:class:`LayoutSavePlanner` (:mod:`dcp_ext.save_planner`) names every rank's
per-kind data files and records the partition; :class:`LayoutLoadPlanner`
(:mod:`dcp_ext.load_planner`) plans resharded, selective, safe loads.
"""

from .load_planner import LayoutLoadPlanner
from .save_planner import LayoutSavePlanner

__all__ = ["LayoutSavePlanner", "LayoutLoadPlanner"]
