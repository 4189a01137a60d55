"""The root's one rule, the half every writer needs: save locks, leases of saves in flight, one liveness rule with heartbeats, and the scan of what must stay."""

from __future__ import annotations

from ._heartbeat import renewals
from ._leases import Lease, is_lease_name
from ._liveness import LockRecord, LockState, this_process
from ._reuse import check_reuse
from ._save_lock import LOCK_FILE, file_state, SaveLock, lock_state, stale_lock_seconds
from ._scan import RootScan, committed_heads, scan_root

__all__ = [
    "LockRecord",
    "LockState",
    "file_state",
    "is_lease_name",
    "renewals",
    "this_process",
    "check_reuse",
    "LOCK_FILE",
    "Lease",
    "RootScan",
    "SaveLock",
    "committed_heads",
    "lock_state",
    "scan_root",
    "stale_lock_seconds",
]
