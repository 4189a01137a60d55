"""Local tiers: node-local commits, replicas on partner nodes, drains to the persistent root, restore plans.

:mod:`._local_tier` (one node's tier: spread commits, replication, local
retention, inventories, healing), :mod:`._replicas` (files sent between
partner nodes), :mod:`._drain` (a tag to the persistent root),
:mod:`._incremental_drain` (drains that write only changed frames),
:mod:`._restore_plan` (where a restore reads each tag from). May import
``guard``, ``root``, ``incremental``, ``frames``, ``metadata``, ``storage``
and below; the manager imports it.
"""

from __future__ import annotations

from ._drain import DRAIN_PHASES, copy_file, drain
from ._incremental_drain import refers_elsewhere
from ._local_tier import LocalTier, raise_if_any
from ._restore_plan import (
    LocalTagState,
    NodeInventory,
    RestorePlan,
    is_replicated_file,
    plan_restore,
)

__all__ = [
    "DRAIN_PHASES",
    "LocalTagState",
    "LocalTier",
    "NodeInventory",
    "RestorePlan",
    "copy_file",
    "drain",
    "is_replicated_file",
    "plan_restore",
    "raise_if_any",
    "refers_elsewhere",
]
