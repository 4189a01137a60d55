"""Torch's pickled ``.metadata``: written for torch's readers, read restricted.

dcp_ext writes torch's ``.metadata`` beside its own JSON document so that
torch's readers load uncompressed dcp_ext checkpoints. Checkpoints written by
torch have only the pickle; :func:`load_torch_metadata` reads it with an
unpickler that admits DCP's metadata classes and nothing else, so loading
never runs code from the file; what those classes hold is then checked
against itself (:mod:`.torch_checks`) before any reader uses it.

Checkpoints of older DCP releases name ``TensorProperties`` (and its
memory-format enum) under ``torch.distributed._shard.sharded_tensor.metadata``,
where DCP's metadata took them from before it had its own (PyTorch's
``test_compatibility.py::test_sharded_tensor_dependency`` keeps such
checkpoints loading). Those two names are read as today's DCP classes, which
hold the same fields and pickle the same state: nothing is imported from the
legacy module.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorruptError, NeedsCheckpointReaderError
from .document import DCP_VERSION, StoredItem
from .torch_checks import check_torch_metadata

__all__ = ["to_torch_metadata", "load_torch_metadata", "torch_reader_marker", "refuse_torch_reader"]


def to_torch_metadata(metadata: Metadata, items: Mapping[MetadataIndex, StoredItem]) -> bytes:
    """Torch's pickled ``.metadata`` for the same checkpoint (interop only):
    DCP's own classes only (chunk lists, not dcp_ext's ``ChunkColumns``)."""
    plain = {
        fqn: dataclasses.replace(md, chunks=list(md.chunks)) if isinstance(md, TensorStorageMetadata) else md
        for fqn, md in metadata.state_dict_metadata.items()
    }
    torch_md = Metadata(
        state_dict_metadata=plain,
        planner_data=metadata.planner_data,
        storage_data={index: item.to_torch() for index, item in items.items()},
        storage_meta=metadata.storage_meta,
        version=DCP_VERSION,
    )
    return pickle.dumps(torch_md)


# The globals a DCP ``.metadata`` pickle may name besides torch's dtypes,
# layouts and memory formats; any other is refused before it is imported.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    # DCP's save plans: Megatron-Core's torch_dist writer keeps every rank's
    # plan in the metadata (``Metadata.all_local_plans``, for its cached
    # plans), so its ``.metadata`` names these plain dataclasses and enum of
    # DCP's planner. Nothing else of that module is admitted.
    ("torch.distributed.checkpoint.planner", name)
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}

# Legacy names of plain data classes, read as the DCP class with the same
# fields and pickled state (never imported from where the pickle says).
_LEGACY_GLOBALS = {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"): "TensorProperties",
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): "_MEM_FORMAT_ENCODING",
}


def torch_reader_marker(reason: str) -> bytes:
    """A ``.metadata`` for a committed checkpoint torch's own readers cannot
    read (compressed, incremental, or too many chunks for a pickle): tools
    that take ``.metadata`` as DCP's commit marker (torchtitan's resume, say)
    find it, and torch's ``FileSystemReader``/``FsspecReader`` fail on
    unpickling it with :class:`~dcp_ext.errors.NeedsCheckpointReaderError`
    naming ``dcp_ext.CheckpointReader`` (without dcp_ext installed: "No
    module named 'dcp_ext'"), never silently.

    Args:
        reason: Why torch cannot read the checkpoint, for the message.
    """
    return pickle.dumps(_TorchReaderRefusal(reason), protocol=2)


class _TorchReaderRefusal:
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (refuse_torch_reader, (self.reason,))


def refuse_torch_reader(reason: str) -> Any:
    """What unpickling a :func:`torch_reader_marker` calls.

    Raises:
        NeedsCheckpointReaderError: Always.
    """
    raise NeedsCheckpointReaderError(
        f"this checkpoint was written by dcp_ext and {reason}, so torch's own readers cannot load it: load it "
        f"with dcp_ext.CheckpointReader (dcp.load(state, storage_reader=dcp_ext.CheckpointReader(path))), or "
        f"call dcp_ext.use_for_dcp() before dcp.load(state, checkpoint_id=path)"
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        current = _LEGACY_GLOBALS.get((module, name))
        if current is not None:
            return super().find_class("torch.distributed.checkpoint.metadata", current)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointCorruptError(
            f"{self.where} refers to {module}.{name}, which is not part of DCP "
            f"metadata; refusing to unpickle it (it could run code). Load this "
            f"checkpoint only if you trust its source, with torch's own reader.",
            self.where,
        )


def load_torch_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle torch's ``.metadata`` admitting only DCP metadata classes,
    then check what it holds (:func:`~dcp_ext.metadata.torch_checks.check_torch_metadata`).

    Raises:
        CheckpointCorruptError: The pickle is damaged or names any other class
            or function (nothing from it is executed), or its records are
            incomplete or contradict each other (naming the file and key).
        UnsafeNameError: A storage record names a file outside the checkpoint.
    """
    try:
        metadata = _RestrictedUnpickler(data, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as err:
        raise CheckpointCorruptError(
            f"{where} cannot be read as DCP metadata ({type(err).__name__}: {err}); "
            f"the metadata file is damaged",
            where,
        ) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{where} does not hold DCP metadata", where)
    check_torch_metadata(metadata, where)
    return metadata
