"""The save planner every framework adapter hands DCP.

Frameworks save the same state dict structure at every step, and their state
dicts are large in items (torchtitan flattens AdamW's hyper-parameters into
one value per parameter; Lightning adds a ``step`` tensor per parameter), so
DCP's planning (each rank's plan pickled to the coordinator, the global plan,
the answers scattered back) is a cost every save pays again. The adapters
therefore plan with :class:`~dcp_ext.LayoutSavePlanner` and dcp_ext's plan
caching: a rank sends its plan as compact columns, and from the second save
of an unchanged structure on sends nothing, and the coordinator reuses its
global plan. Data files are named by kind and rank (``model_rank0.distcp``,
``optimizer_rank0.distcp``); readers find them through the metadata, so
torch's reader and every dcp_ext reader load them as before.
"""

from __future__ import annotations

from dcp_ext.config import IOConfig
from dcp_ext.planners import LayoutSavePlanner

__all__ = ["save_planner"]


def save_planner(name: str, config: IOConfig | None) -> LayoutSavePlanner:
    """(all ranks, one per save) A layout planner with dcp_ext's plan caching on.

    Args:
        name: What is saved (``"torchtitan"``, ``"accelerate.model"``...):
            states of different names keep their cached plans apart.
        config: The adapter's I/O settings (``io_options``; ``None``: the
            ``DCP_EXT_*`` variables, as the writer's). The planner names the
            data files, so it deals them over their ``key_prefixes``.
    """
    key_prefixes = (config if config is not None else IOConfig.from_env()).key_prefixes
    return LayoutSavePlanner(key_prefixes=key_prefixes, enable_plan_caching=True,
                             plan_cache_name=f"dcp_ext.integrations.{name}")
