"""A checkpoint root: tags, newest, retention, deletion and cleanup by the one rule, compaction, verification."""

from __future__ import annotations

from ._cleanup import LeftoverReport
from ._compact import CompactReport, compact
from ._retention import KeepAny, KeepEvery, KeepLast, KeepMatching, RetentionPolicy
from ._root import CheckpointRoot
from ._verify import Problem, VerifyReport, read_own_metadata, verify, verify_full

__all__ = [
    "CheckpointRoot",
    "CompactReport",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "KeepMatching",
    "LeftoverReport",
    "Problem",
    "RetentionPolicy",
    "VerifyReport",
    "compact",
    "read_own_metadata",
    "verify",
    "verify_full",
]
