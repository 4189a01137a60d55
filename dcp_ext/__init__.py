"""dcp_ext: production-grade storage for PyTorch Distributed Checkpoint (DCP).

``CheckpointWriter`` and ``CheckpointReader`` plug into ``dcp.save``,
``dcp.load`` and ``dcp.async_save`` and stream checkpoints to local disk,
shared POSIX file systems and S3 (or any fsspec URL) in parallel, with
bounded memory, ranged reads and an explicit commit protocol.
"""

from __future__ import annotations

from ._dcp_calls import AsyncSaveHandle
from .api import load, save
from .codecs import Codec, ZstdCodec
from .compact import CompactReport, compact
from .config import IOConfig, RetryPolicy
from .errors import (
    BucketNotFoundError,
    CheckpointCorruptError,
    CheckpointExistsError,
    ChecksumMismatchError,
    CheckpointIncompleteError,
    CheckpointInProgressError,
    CheckpointInUseError,
    ForeignCheckpointError,
    CheckpointReplacedError,
    UnsafeNameError,
    InvalidPathError,
    InvalidOptionError,
    StorageTimeoutError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CredentialsError,
    DcpExtError,
    NotACheckpointError,
    PostCommitError,
    ReshardError,
    ReadOnceExchangeError,
    StorageError,
    StorageFullError,
    StoragePermissionError,
    TransientStorageError,
    UnsupportedCodecError,
    unwrap_checkpoint_exception,
)
from .hf_export import HFExportReport, export_hf, save_hf
from .integrity import Problem, VerifyReport, verify, verify_full
from .layout import InvalidTagError, MeshInfo, Partition, RankPartition, TagInfo
from .model_registry import register_model, registered_model
from .manager import CheckpointManager, ResumeResult, close_checkpoints, resume_from_checkpoint, save_checkpoint
from .planners import LayoutLoadPlanner, LayoutSavePlanner
from .pretrained import FullCheckpointReader, PretrainedLoadReport, load_pretrained
from .reader import CheckpointReader
from .retention import KeepAny, KeepEvery, KeepLast, KeepMatching, RetentionPolicy
from .root import CheckpointRoot
from .staging import Stager, StagingStats
from .user_content import UnsafeUserContentError
from .writer import CheckpointWriter

__version__ = "0.1.0"

__all__ = [
    "CheckpointWriter",
    "CheckpointReader",
    "save",
    "load",
    "CheckpointManager",
    "AsyncSaveHandle",
    "Stager",
    "StagingStats",
    "CheckpointRoot",
    "RetentionPolicy",
    "KeepLast",
    "KeepEvery",
    "KeepMatching",
    "KeepAny",
    "ResumeResult",
    "save_checkpoint",
    "resume_from_checkpoint",
    "close_checkpoints",
    "register_model",
    "registered_model",
    "load_pretrained",
    "PretrainedLoadReport",
    "save_hf",
    "export_hf",
    "HFExportReport",
    "FullCheckpointReader",
    "LayoutSavePlanner",
    "LayoutLoadPlanner",
    "InvalidTagError",
    "Partition",
    "RankPartition",
    "MeshInfo",
    "TagInfo",
    "UnsafeUserContentError",
    "verify",
    "verify_full",
    "compact",
    "CompactReport",
    "VerifyReport",
    "Problem",
    "Codec",
    "ZstdCodec",
    "IOConfig",
    "RetryPolicy",
    "DcpExtError",
    "CheckpointNotFoundError",
    "BucketNotFoundError",
    "NotACheckpointError",
    "CheckpointIncompleteError",
    "CheckpointExistsError",
    "CheckpointInProgressError",
    "CheckpointInUseError",
    "ForeignCheckpointError",
    "CheckpointReplacedError",
    "UnsafeNameError",
    "InvalidPathError",
    "InvalidOptionError",
    "StorageTimeoutError",
    "PostCommitError",
    "CheckpointCorruptError",
    "ChecksumMismatchError",
    "UnsupportedCodecError",
    "StoragePermissionError",
    "CredentialsError",
    "StorageError",
    "StorageFullError",
    "TransientStorageError",
    "CheckpointKeyError",
    "ReshardError",
    "ReadOnceExchangeError",
    "unwrap_checkpoint_exception",
]
