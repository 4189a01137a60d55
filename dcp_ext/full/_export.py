"""Export a partial (sharded) checkpoint as a full single-file checkpoint.

One process, no process group: each tensor's chunks are read with ranged
reads straight into one full-size buffer, written out, and freed before the
next, so memory stays at about the largest tensor.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)

from ..dcp_io import CheckpointReader
from ..errors import InvalidPathError
from ..storage import Location, Store, normalize_path
from ._checksums import ChecksumRecorder
from ._write import (
    FullTensorSpec,
    commit_with_checksums,
    full_layout,
    stream_full_checkpoint,
)

__all__ = ["export_partial", "exported_keys", "whole_tensor_items", "refuse_output_in_source"]


class IntoTensor:
    """The two planner calls ``CheckpointReader.read_data`` makes, aimed at one
    tensor, or at one tensor per key (``{key: tensor}``)."""

    def __init__(self, dest: torch.Tensor | dict[str, torch.Tensor]) -> None:
        self.dest = dest

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.dest if isinstance(self.dest, torch.Tensor) else self.dest[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _location(path: str) -> str:
    """A comparable form of a path or URL: a local path resolved (symbolic
    links, ``..``, relative to the working directory), a URL normalized."""
    text = normalize_path(path)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        scheme = "s3" if scheme in ("s3a", "s3n") else scheme
        return f"{scheme}://{posixpath.normpath('/' + rest).lstrip('/')}"
    return os.path.realpath(text)


def refuse_output_in_source(source: str, output: str) -> None:
    """Refuse an export whose output is its source checkpoint or lies inside it.

    ``dcp-ext export X_partial X_partial/model_rank0.distcp --overwrite``
    replaced the data file it was reading and exited 0 (issue 32, finding
    11); an output folder inside the source would mix files into it.

    Args:
        source: The checkpoint directory read.
        output: The file or folder to write (path or URL).

    Raises:
        InvalidPathError: ``output`` is ``source`` or lies inside it.
    """
    src, out = _location(source), _location(output)
    if out == src or out.startswith(src.rstrip("/") + "/"):
        raise InvalidPathError(
            f"export output {output} lies in the checkpoint it exports ({source}): writing it would destroy "
            f"the source; choose an output outside {source}",
            output,
        )


def exported_keys(keys: Sequence[str], include_optimizer: bool) -> list[tuple[str, str]]:
    """``(name in the export, key in the checkpoint)``: a CheckpointManager
    checkpoint's ``model.`` keys lose the prefix, its ``optimizer.`` keys stay
    (with ``include_optimizer``); other checkpoints keep every key."""
    if not any(k.startswith("model.") for k in keys):
        return [(k, k) for k in keys]
    chosen = []
    for key in keys:
        if key.startswith("model."):
            chosen.append((key[len("model."):], key))
        elif include_optimizer and key.startswith("optimizer."):
            chosen.append((key, key))
    return chosen


def whole_tensor_items(key: str, md: TensorStorageMetadata) -> list[ReadItem]:
    """Read items that fill a full-size tensor of ``key`` with every stored chunk."""
    # The row as the index hint: version-3 look-ups then index no key's rows.
    return [
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


def export_partial(
    source: Location,
    target: Store,
    name: str,
    *,
    full_format: str = "safetensors",
    include_optimizer: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Stream the model (and optionally optimizer) tensors of the checkpoint at
    ``source`` (read with its storage options and I/O config) into ``target/name``.

    Keys of a checkpoint saved by :class:`~dcp_ext.CheckpointManager` lose their
    ``model.`` prefix (the file holds the model's own state-dict keys);
    optimizer tensors keep their flattened ``optimizer.`` keys.

    Args:
        progress: Called as ``progress(bytes_done, bytes_total)`` before each
            tensor is read and once at the end (``bytes_done == bytes_total``).

    The file's frame checksums go into its sidecar ``name.checksums.json``
    (:mod:`dcp_ext.full._checksums`), written after it.

    Returns:
        Bytes written.

    Raises:
        InvalidPathError: ``target/name`` is ``source`` or lies inside it.
    """
    refuse_output_in_source(source.url, target.describe(name))
    reader = CheckpointReader(source)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    chosen = exported_keys(list(tensors), include_optimizer)
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
        reader.read_data(LoadPlan(whole_tensor_items(key, md)), cast(LoadPlanner, IntoTensor(dest)))
        return dest

    recorder = ChecksumRecorder(name, reader.config.frame_size)
    with target.open_writer(name, size_hint=total) as writer:
        size = stream_full_checkpoint(writer, specs, layout, fetch, recorder)
        commit_with_checksums(target, name, writer, recorder, size)
    if progress is not None:
        progress(total, total)
    return total
