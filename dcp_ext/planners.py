"""The planners of the partial-checkpoint layout, in one import.

:class:`LayoutSavePlanner` (:mod:`dcp_ext.planning._save_planner`) names every rank's
per-kind data files and records the partition; :class:`LayoutLoadPlanner`
(:mod:`dcp_ext.planning._load_planner`) plans resharded, selective, safe loads.
"""

from .planning import LayoutLoadPlanner, LayoutSavePlanner

__all__ = ["LayoutSavePlanner", "LayoutLoadPlanner"]
