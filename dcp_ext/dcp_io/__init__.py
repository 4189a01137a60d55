"""What DCP calls: CheckpointWriter, CheckpointReader, staging, the DCP-call wrappers, the read-once exchange.

:mod:`._writer` and :mod:`._reader` are DCP's lifecycle only; their work is
their collaborators': metadata sources chosen once (:mod:`._metadata_sources`),
where data files are (:mod:`._checkpoint_files`), item reads
(:mod:`._item_reads`), read-once planning and exchange (:mod:`._read_once`,
:mod:`._read_exchange`), staging (:mod:`._staging`), the wrappers around
``dcp.save``/``dcp.load`` (:mod:`._calls`), frame streams
(:mod:`._frame_stream`) and safetensors folders (:mod:`._hf_folder`). May
import ``incremental``, ``guard``, ``planning``, ``frames``, ``metadata``,
``format``, ``storage``, ``layout`` and below.
"""

from __future__ import annotations

from ._calls import AsyncSaveHandle, run_load, run_save, start_async_save
from ._frame_stream import FrameStream
from ._hf_folder import read_hf_index
from ._metadata_sources import LoadedMetadata
from ._reader import CheckpointReader
from ._staging import Stager, StagingStats
from ._writer import CheckpointWriter

__all__ = [
    "AsyncSaveHandle",
    "CheckpointReader",
    "CheckpointWriter",
    "FrameStream",
    "LoadedMetadata",
    "Stager",
    "StagingStats",
    "read_hf_index",
    "run_load",
    "run_save",
    "start_async_save",
]
