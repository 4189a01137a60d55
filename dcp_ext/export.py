"""Export a partial (sharded) checkpoint as a full single-file checkpoint.

One process, no process group: each tensor's chunks are read with ranged
reads straight into one full-size buffer, written out, and freed before the
next, so memory stays at about the largest tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .config import IOConfig
from .full import FullTensorSpec, commit_with_checksums, full_layout, stream_full_checkpoint
from .full_checksums import ChecksumRecorder
from .reader import CheckpointReader
from .storage import Store

__all__ = ["export_partial"]


class _IntoTensor:
    """The two planner calls ``CheckpointReader.read_data`` makes, aimed at one tensor."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.dest
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def export_partial(
    source: str,
    target: Store,
    name: str,
    *,
    full_format: str = "safetensors",
    include_optimizer: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: IOConfig | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Stream the model (and optionally optimizer) tensors of ``source`` into ``target/name``.

    Keys of a checkpoint saved by :class:`~dcp_ext.CheckpointManager` lose their
    ``model.`` prefix (the file holds the model's own state-dict keys);
    optimizer tensors keep their flattened ``optimizer.`` keys.

    Args:
        progress: Called as ``progress(bytes_done, bytes_total)`` before each
            tensor is read and once at the end (``bytes_done == bytes_total``).

    The file's frame checksums go into its sidecar ``name.checksums.json``
    (:mod:`dcp_ext.full_checksums`), written after it.

    Returns:
        Bytes written.
    """
    reader = CheckpointReader(source, storage_options=storage_options, config=config)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    app_layout = any(k.startswith("model.") for k in tensors)
    chosen: list[tuple[str, str]] = []  # (name in file, key in checkpoint)
    for key in tensors:
        if not app_layout:
            chosen.append((key, key))
        elif key.startswith("model."):
            chosen.append((key[len("model."):], key))
        elif include_optimizer and key.startswith("optimizer."):
            chosen.append((key, key))
    specs = [FullTensorSpec(n, tensors[k].properties.dtype, tuple(int(s) for s in tensors[k].size)) for n, k in chosen]
    layout = full_layout(specs, full_format)

    total = layout.total_bytes(specs)
    done = 0

    def fetch(index: int) -> torch.Tensor:
        nonlocal done
        if progress is not None:
            progress(done, total)
        done += specs[index].nbytes
        key = chosen[index][1]
        md = tensors[key]
        dest = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        # The row as the index hint: version-3 look-ups then index no key's rows.
        items = [
            ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(key, chunk.offsets),
                dest_offsets=chunk.offsets,
                storage_index=MetadataIndex(key, chunk.offsets, row),
                storage_offsets=torch.Size((0,) * len(chunk.offsets)),
                lengths=chunk.sizes,
            )
            for row, chunk in enumerate(md.chunks)
        ]
        reader.read_data(LoadPlan(items), cast(LoadPlanner, _IntoTensor(dest)))
        return dest

    recorder = ChecksumRecorder(name, reader.config.frame_size)
    with target.open_writer(name, size_hint=total) as writer:
        size = stream_full_checkpoint(writer, specs, layout, fetch, recorder)
        commit_with_checksums(target, name, writer, recorder, size)
    if progress is not None:
        progress(total, total)
    return total
