"""Torch-format checkpoints with chunked tensors, written in one process, and
their ``.metadata`` edited the way a hostile or buggy tool would.

A multi-rank ``FileSystemWriter`` save stores each chunk of a sharded tensor
as its own ``torch.save`` archive and records the chunks under one key.
:func:`write_chunked` writes the same thing without a process group: each
chunk is saved as a key of its own (``"w@0,0"``), then the pickle is
rewritten so the chunks are one key's (``"w"`` with chunks at ``(0, 0)`` and
``(6, 0)``), pointing at those archives. The layouts are a row split, a 2x2
grid and an irregular one (a row, then the next row cut unevenly), beside
nested lists and dicts (DCP records their paths in ``planner_data``) and
non-tensor values.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

__all__ = ["STATE", "CHUNKS", "write_chunked", "read_metadata", "write_metadata", "template"]

_g = torch.Generator().manual_seed(3)
#: What the checkpoints of :func:`write_chunked` hold.
STATE: dict[str, Any] = {
    "w": torch.randn(12, 8, generator=_g),  # rows 0-5 and 6-11
    "grid": torch.arange(24, dtype=torch.int32).reshape(4, 6),  # 2x2 grid of 2x3
    "odd": torch.linspace(-1, 1, 20).to(torch.bfloat16).reshape(4, 5),  # (0,0) 1x5, (1,0) 3x2, (1,2) 3x3
    "big": torch.arange(3000, dtype=torch.float32),  # one chunk, 12 KB
    "wide": torch.randn(65536, generator=_g),  # 256 KiB: half of it is more than a torch.save envelope's slack
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "lst": [torch.ones(3), torch.arange(4, dtype=torch.int64)],
    "opt": {"state": {"0": {"m": torch.full((2, 2), 0.5)}}, "lr": 0.125, "name": "adam"},
    "step": 7,
}

#: Each chunked key's chunks: (offsets, sizes).
CHUNKS: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {
    "w": [((0, 0), (6, 8)), ((6, 0), (6, 8))],
    "grid": [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))],
    "odd": [((0, 0), (1, 5)), ((1, 0), (3, 2)), ((1, 2), (3, 3))],
}


def _part(fqn: str, offsets: tuple[int, ...]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}"


def write_chunked(path: Path, **writer_options: Any) -> None:
    """Write :data:`STATE` at ``path`` with torch's ``FileSystemWriter`` (its
    ``writer_options``, e.g. ``_extensions``), :data:`CHUNKS` as chunks."""
    state = {k: v for k, v in STATE.items() if k not in CHUNKS}
    for fqn, chunks in CHUNKS.items():
        for offsets, sizes in chunks:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            state[_part(fqn, offsets)] = STATE[fqn][index].clone()
    dcp.save(state, storage_writer=FileSystemWriter(str(path), **writer_options), no_dist=True)
    metadata = read_metadata(path)
    for fqn, chunks in CHUNKS.items():
        first = metadata.state_dict_metadata[_part(fqn, chunks[0][0])]
        first.size = torch.Size(STATE[fqn].shape)
        first.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
        metadata.state_dict_metadata[fqn] = first
        metadata.planner_data[fqn] = (fqn,)
        for offsets, _ in chunks:
            part = _part(fqn, offsets)
            metadata.state_dict_metadata.pop(part, None)
            del metadata.planner_data[part]
            info = metadata.storage_data.pop(MetadataIndex(part, [0] * len(offsets)))
            metadata.storage_data[MetadataIndex(fqn, offsets)] = info
    write_metadata(path, metadata)


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's ``.metadata``, unpickled (test files are trusted)."""
    metadata = pickle.loads((path / ".metadata").read_bytes())
    assert isinstance(metadata, Metadata)
    return metadata


def write_metadata(path: Path, metadata: Any) -> bytes:
    """Pickle ``metadata`` into the checkpoint's ``.metadata``; its bytes."""
    data = pickle.dumps(metadata)
    (path / ".metadata").write_bytes(data)
    return data


def template(state: Any = None) -> Any:
    """A state shaped like ``state`` (:data:`STATE`) for ``dcp_ext.load``: zero
    tensors, and values that differ from the saved ones."""
    state = STATE if state is None else state
    if isinstance(state, dict):
        return {k: template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [template(v) for v in state]
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return None
