"""Named crash points for crash-consistency tests.

``DCP_EXT_CRASH_AT=point[,point...]`` (read when this module is imported, or
by :func:`reload`) makes the process kill itself with SIGKILL when it reaches
one of the named points, so tests can crash a real save at exactly the moment
they want to examine, without mocking anything. Unset (the normal case) a
crash point costs one set lookup.

Points, in the order a save reaches them:

* ``before_data``: a rank is about to write its data files.
* ``mid_data``: a rank has written and committed its first data file item.
* ``after_data``: a rank's data files are all committed.
* ``before_metadata``: the coordinator is about to write the metadata.
* ``before_newest``: the checkpoint is committed; ``newest`` not yet moved.
* ``mid_retention``: retention has started deleting an old checkpoint.

Tiered saves (:mod:`dcp_ext.tiers`) add:

* ``mid_local_commit``: a node leader has the commit files, not yet written.
* ``mid_replication``: a rank is sending or receiving replica files.
* ``mid_drain``: a rank has copied its first file to the persistent root.
* ``before_drain_commit``: every file is in the root; its metadata not yet written.
"""

from __future__ import annotations

import os
import signal

__all__ = ["crash_point", "reload", "POINTS", "TIER_POINTS"]

POINTS = ("before_data", "mid_data", "after_data", "before_metadata", "before_newest", "mid_retention")
TIER_POINTS = ("mid_local_commit", "mid_replication", "mid_drain", "before_drain_commit")

_armed: frozenset[str] = frozenset()


def reload() -> None:
    """Re-read ``DCP_EXT_CRASH_AT``."""
    global _armed
    raw = os.environ.get("DCP_EXT_CRASH_AT", "")
    names = frozenset(p.strip() for p in raw.split(",") if p.strip())
    unknown = names - set(POINTS) - set(TIER_POINTS)
    if unknown:
        raise ValueError(f"DCP_EXT_CRASH_AT names unknown crash points {sorted(unknown)}; "
                         f"known: {POINTS + TIER_POINTS}")
    _armed = names


def crash_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup of any kind) if ``name`` is armed."""
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)


reload()
