"""Incremental saves: the base a save compares with and the frames it may refer to."""

from __future__ import annotations

from ._save import (
    DEFAULT_MAX_CHAIN,
    BaseFrames,
    IncrementalSave,
    read_base,
    restart_reason,
)

__all__ = [
    "BaseFrames",
    "DEFAULT_MAX_CHAIN",
    "IncrementalSave",
    "read_base",
    "restart_reason",
]
