"""Hugging Face folders: names and shard plans, export from live state and from checkpoints."""

from __future__ import annotations

from ._export import HFExportReport, export_hf, save_hf, write_live_state, write_partial
from ._layout import HF_CONFIG_FILE, HF_INDEX_FILE, is_shard_name

__all__ = [
    "HFExportReport",
    "HF_CONFIG_FILE",
    "HF_INDEX_FILE",
    "export_hf",
    "is_shard_name",
    "save_hf",
    "write_live_state",
    "write_partial",
]
