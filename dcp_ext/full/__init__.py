"""Single-file full checkpoints: writing, checksum sidecars, export from a partial checkpoint, load_pretrained.

:mod:`._write` (``ROOT/{tag}`` as one safetensors or torch.save file),
:mod:`._checksums` (the checksum sidecars), :mod:`._export` (a partial
checkpoint to a full file, one tensor in memory at a time), :mod:`._load`
(``load_pretrained``, each rank reading its slices), :mod:`._torch_zip`
(``torch.save`` files read without unpickling tensors), :mod:`._fp8`
(block-scaled FP8 weights), :mod:`._key_map` (key renaming and SageMaker's
state-dict translation). May import ``dcp_io``, ``planners`` and below.
"""

from __future__ import annotations

from ._checksums import FOLDER_SIDECAR, ChecksumRecorder, FileChecksums, encode_sidecar
from ._export import IntoTensor, export_partial, exported_keys, refuse_output_in_source, whole_tensor_items
from ._key_map import KeyList, KeyMap, TranslateFunction, rename_keys, translate_state
from ._load import HF_MARKERS, FullCheckpointReader, PretrainedLoadReport, load_pretrained
from ._write import CREATED_KEY, save_full

__all__ = [
    "CREATED_KEY",
    "ChecksumRecorder",
    "FOLDER_SIDECAR",
    "FileChecksums",
    "FullCheckpointReader",
    "HF_MARKERS",
    "IntoTensor",
    "KeyList",
    "KeyMap",
    "PretrainedLoadReport",
    "TranslateFunction",
    "encode_sidecar",
    "export_partial",
    "exported_keys",
    "load_pretrained",
    "refuse_output_in_source",
    "rename_keys",
    "save_full",
    "translate_state",
    "whole_tensor_items",
]
