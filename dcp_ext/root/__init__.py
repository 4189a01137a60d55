"""A checkpoint root: tags, newest, retention, deletion and cleanup by the one rule (of standalone checkpoint directories too), compaction, verification."""

from __future__ import annotations

from ._cleanup import LeftoverReport
from ._compact import CompactReport, compact
from ._retention import KeepAny, KeepEvery, KeepLast, KeepMatching, RetentionPolicy
from ._root import CheckpointRoot, RetentionReport
from ._standalone import DirDeletion, delete_checkpoint_dir
from ._verify import Problem, VerifyReport, read_own_metadata, verify, verify_full

__all__ = [
    "CheckpointRoot",
    "CompactReport",
    "DirDeletion",
    "KeepAny",
    "KeepEvery",
    "KeepLast",
    "KeepMatching",
    "LeftoverReport",
    "Problem",
    "RetentionPolicy",
    "RetentionReport",
    "VerifyReport",
    "compact",
    "delete_checkpoint_dir",
    "read_own_metadata",
    "verify",
    "verify_full",
]
