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
* ``mid_retention``: retention, or a standalone deletion after its un-commit
  (:func:`dcp_ext.root.delete_checkpoint_dir`), has started deleting a checkpoint.

Tiered saves (:mod:`dcp_ext.tiers._local_tier`) add:

* ``mid_local_commit``: a node leader has the commit files, not yet written.
* ``mid_replication``: a rank is sending or receiving replica files.
* ``mid_drain``: a rank has copied its first file to the persistent root.
* ``before_drain_commit``: every file is in the root; its metadata not yet written.

Hugging Face exports (:mod:`dcp_ext.hf._export`) add:

* ``mid_hf_file``: a rank has written a tensor into a weights file it has not
  yet committed.
* ``before_hf_index``: the coordinator has committed every weights file, the
  checksum sidecar and ``config.json``; the index is not yet written.

Pause points widen a window for tests of concurrent jobs:
``DCP_EXT_PAUSE_AT=point`` with ``DCP_EXT_PAUSE_FILE=PATH`` makes the process,
at any of the crash points above, create ``PATH.reached`` and wait (at most
:data:`PAUSE_LIMIT` seconds) until ``PATH`` exists, so a test can run another
job, or a CLI command, at exactly that moment.

Maintenance (:mod:`dcp_ext.root._compact`) adds:

* ``mid_compact``: a compaction has written its new data files; the
  checkpoint's metadata still names the old ones.

Failure points raise :class:`InjectedFailure` instead of killing the process
(``DCP_EXT_FAIL_AT=point``), for tests of how the other ranks react to one
rank's error:

* ``mid_exchange``: a rank preparing the second batch of a read-once
  exchange (the first, when there is only one).
* ``mid_hf_export``: a rank has written a tensor of a Hugging Face export
  (:mod:`dcp_ext.hf._export`), before its file is committed.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["crash_point", "fail_point", "InjectedFailure", "reload", "POINTS", "TIER_POINTS", "HF_POINTS",
           "MAINTENANCE_POINTS", "FAIL_POINTS"]

POINTS = ("before_data", "mid_data", "after_data", "before_metadata", "before_newest", "mid_retention")
TIER_POINTS = ("mid_local_commit", "mid_replication", "mid_drain", "before_drain_commit")
HF_POINTS = ("mid_hf_file", "before_hf_index")
MAINTENANCE_POINTS = ("mid_compact",)
FAIL_POINTS = ("mid_exchange", "mid_hf_export")

_armed: frozenset[str] = frozenset()
_failing: frozenset[str] = frozenset()
_pause_at: str | None = None
#: Longest wait at a pause point (a test that never says go must not hang CI).
PAUSE_LIMIT = 120.0


class InjectedFailure(RuntimeError):
    """The error a failure point raises."""


def reload() -> None:
    """Re-read ``DCP_EXT_CRASH_AT``."""
    global _armed
    raw = os.environ.get("DCP_EXT_CRASH_AT", "")
    names = frozenset(p.strip() for p in raw.split(",") if p.strip())
    unknown = names - set(POINTS) - set(TIER_POINTS) - set(HF_POINTS) - set(MAINTENANCE_POINTS)
    if unknown:
        raise ValueError(f"DCP_EXT_CRASH_AT names unknown crash points {sorted(unknown)}; "
                         f"known: {POINTS + TIER_POINTS + HF_POINTS + MAINTENANCE_POINTS}")
    _armed = names
    global _failing
    failing = frozenset(p.strip() for p in os.environ.get("DCP_EXT_FAIL_AT", "").split(",") if p.strip())
    if failing - set(FAIL_POINTS):
        raise ValueError(f"DCP_EXT_FAIL_AT names unknown failure points {sorted(failing - set(FAIL_POINTS))}; "
                         f"known: {FAIL_POINTS}")
    _failing = failing
    global _pause_at
    pause = os.environ.get("DCP_EXT_PAUSE_AT", "").strip()
    if pause and pause not in POINTS + TIER_POINTS + HF_POINTS + MAINTENANCE_POINTS:
        raise ValueError(f"DCP_EXT_PAUSE_AT names an unknown point {pause!r}; known: {POINTS + TIER_POINTS + HF_POINTS + MAINTENANCE_POINTS}")
    _pause_at = pause or None


def crash_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup of any kind) if ``name`` is armed; pause
    here if it is the pause point."""
    if name in _armed:
        os.kill(os.getpid(), signal.SIGKILL)
    if name == _pause_at:
        _pause()


def _pause() -> None:
    go = os.environ.get("DCP_EXT_PAUSE_FILE", "")
    if not go:
        raise ValueError("DCP_EXT_PAUSE_AT needs DCP_EXT_PAUSE_FILE")
    with open(go + ".reached", "w"):
        pass
    deadline = time.monotonic() + PAUSE_LIMIT
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)


def fail_point(name: str) -> None:
    """Raise :class:`InjectedFailure` here if ``name`` is armed."""
    if name in _failing:
        raise InjectedFailure(f"injected failure at {name} (DCP_EXT_FAIL_AT)")


reload()
