"""Single-file full checkpoints: writing, checksum sidecars, export from a partial checkpoint, load_pretrained."""

from __future__ import annotations

from ._checksums import FOLDER_SIDECAR, ChecksumRecorder, FileChecksums, encode_sidecar
from ._export import (
    _IntoTensor,
    export_partial,
    exported_keys,
    refuse_output_in_source,
    whole_tensor_items,
)
from ._key_map import KeyMap, TranslateFunction, rename_keys
from ._load import (
    HF_MARKERS,
    FullCheckpointReader,
    PretrainedLoadReport,
    load_pretrained,
)
from ._write import CREATED_KEY, save_full

__all__ = [
    "CREATED_KEY",
    "ChecksumRecorder",
    "FOLDER_SIDECAR",
    "FileChecksums",
    "FullCheckpointReader",
    "HF_MARKERS",
    "KeyMap",
    "PretrainedLoadReport",
    "TranslateFunction",
    "_IntoTensor",
    "encode_sidecar",
    "export_partial",
    "exported_keys",
    "load_pretrained",
    "refuse_output_in_source",
    "rename_keys",
    "save_full",
    "whole_tensor_items",
]
