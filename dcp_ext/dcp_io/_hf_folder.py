"""Hugging Face safetensors folders as DCP checkpoints (torch's ``HuggingFaceStorageWriter``).

Torch's ``HuggingFaceStorageWriter`` writes a state dict as safetensors files
and no ``.metadata``:

* rank-0 saves (the default): ``model-0000i-of-0000N.safetensors`` (one file,
  or the files ``fqn_to_index_mapping`` asks for) and the index
  ``model.safetensors.index.json`` mapping every key to its file, written last;
* ``save_distributed=True``: every rank writes its own chunks to
  ``shard-0000r-model-0000i-of-0000N.safetensors`` and no index is written;
* ``enable_consolidation=True``: full files and the index in the folder, the
  ranks' shards under ``sharded/``.

Each file's ``__metadata__["DCP_SHARDING_INFO"]`` gives the global offsets of
the chunk each tensor holds (``saved_offsets``). Torch's
``HuggingFaceStorageReader`` builds DCP metadata from the headers of every
``.safetensors`` file in the folder: one chunk per (file, key) at those
offsets (zero without them), a tensor's global size the largest
``offset + shape`` of its chunks. :func:`read_safetensors_folder` builds the
same metadata from the headers alone (each read with one ranged read, in
parallel), recording where every chunk's raw bytes lie, so
:class:`~dcp_ext.CheckpointReader` loads the folder into any sharding reading
only the bytes each rank needs. It also loads plain Hugging Face model
folders (``model.safetensors``, or shards with an index).

Unlike torch's reader it checks what a sharded folder promises: with an index,
every file it names exists and holds the keys it lists; without one, every
tensor's chunks cover it exactly (a missing rank's shard file is an error,
not zeros).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointCorruptError, CheckpointIncompleteError
from ..format import SafetensorsHeader, header_prefix, parse_header, parse_stored_json
from ..layout import USER_CONTENT_FILE
from ..metadata import StoredItem, validate_file_name
from ..storage import TMP_MARK, Store

__all__ = ["HF_INDEX_FILE", "safetensors_files", "read_safetensors_folder", "read_hf_index"]

#: The index torch's ``HuggingFaceStorageWriter`` (and Hugging Face) write.
HF_INDEX_FILE = "model.safetensors.index.json"
_SUFFIX = ".safetensors"
# What torch's writer records per tensor in each file's __metadata__.
_SHARDING_KEY = "DCP_SHARDING_INFO"
_OFFSETS_KEY = "saved_offsets"
# Files of a rank-0 save, whose index is written after them.
_NUMBERED = re.compile(r"model-\d+-of-\d+\.safetensors")
# The first read of a header; a larger header costs a second read.
_HEAD = 64 * 1024


def safetensors_files(names: Sequence[str]) -> list[str] | None:
    """The safetensors files of a folder that is a Hugging Face checkpoint,
    or ``None`` when the folder is something else.

    A folder with DCP data files (``.distcp``) or dcp_ext's temporary files is
    a DCP checkpoint without its metadata, never a safetensors folder; nor is
    one whose only safetensors file is dcp_ext's user content.

    Args:
        names: The names of the folder's files (not subfolders).
    """
    if any(n.endswith(".distcp") or TMP_MARK in n for n in names):
        return None
    files = sorted(n for n in names if n.endswith(_SUFFIX) and n != USER_CONTENT_FILE)
    return files if files or HF_INDEX_FILE in names else None


@dataclass(frozen=True)
class _Chunk:
    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    at: int  # absolute byte offset of its raw data in ``file``

    @property
    def numel(self) -> int:
        return _numel(self.shape)


def read_safetensors_folder(store: Store, names: Sequence[str], concurrency: int = 16) -> Metadata:
    """(every loading rank) DCP metadata of a safetensors folder, from its files' headers.

    Args:
        store: The folder.
        names: Its file names (``store.list_names()``).
        concurrency: Headers read at once.

    Returns:
        Metadata with one chunk per (file, tensor), whose ``storage_data``
        maps each chunk to a :class:`~dcp_ext.metadata.StoredItem` over its
        raw bytes.

    Raises:
        CheckpointIncompleteError: Files the index names are missing, a
            rank-0 save's numbered files have no index yet, or a tensor's
            chunks do not cover it (a rank's shard file is missing).
        CheckpointCorruptError: A damaged header or index, a file that lacks a
            key the index puts there, overlapping chunks or offsets that do
            not fit the tensor.
    """
    files = safetensors_files(names) or []
    expected: dict[str, str] = {}
    if HF_INDEX_FILE in names:
        expected = read_hf_index(store)
        missing = sorted(set(expected.values()) - set(names))
        if missing:
            raise CheckpointIncompleteError(
                f"{store.describe(HF_INDEX_FILE)} names {len(missing)} file(s) the folder does not have: "
                f"{missing[:5]}; the save that wrote it failed or the folder was copied in part",
                store.describe(HF_INDEX_FILE),
            )
        files = sorted(set(expected.values()))
    elif any(_NUMBERED.fullmatch(f) for f in files):
        raise CheckpointIncompleteError(
            f"{store.url} holds numbered safetensors files ({files[0]}, ...) but no {HF_INDEX_FILE}, "
            f"which torch's HuggingFaceStorageWriter writes after them: the save failed or has not "
            f"finished. Do not load it: save again.",
            store.url,
        )
    with ThreadPoolExecutor(max(1, min(concurrency, len(files)))) as pool:
        headers = dict(zip(files, pool.map(lambda f: _read_header(store, f), files)))
    chunks: dict[str, list[_Chunk]] = {}
    for file in files:
        header = headers[file]
        where = store.describe(file)
        offsets = _saved_offsets(header, where)
        for entry in header.tensors:
            at = offsets.get(entry.name, (0,) * len(entry.shape))
            if len(at) != len(entry.shape):
                raise CheckpointCorruptError(
                    f"{where}: tensor {entry.name!r} has shape {list(entry.shape)} but {_SHARDING_KEY} gives "
                    f"it offsets {list(at)}",
                    where,
                )
            chunks.setdefault(entry.name, []).append(
                _Chunk(file, at, entry.shape, entry.dtype, header.data_start + entry.begin)
            )
    for key, file in expected.items():
        if not any(c.file == file for c in chunks.get(key, ())):
            where = store.describe(file)
            raise CheckpointCorruptError(
                f"{store.describe(HF_INDEX_FILE)} puts tensor {key!r} in {where}, whose header does not "
                f"have it; the folder is damaged",
                where,
            )
    state: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, StoredItem] = {}
    for key in sorted(chunks):
        found = sorted(chunks[key], key=lambda c: c.offsets)
        state[key] = _tensor_metadata(store, key, found)
        for chunk in found:
            nbytes = chunk.numel * chunk.dtype.itemsize
            storage[MetadataIndex(key, chunk.offsets)] = StoredItem(chunk.file, chunk.at, nbytes, 0, nbytes)
    return Metadata(state_dict_metadata=dict(state), storage_data=storage, storage_meta=StorageMeta())


def read_hf_index(store: Store, name: str = HF_INDEX_FILE) -> dict[str, str]:
    """``{key: file}`` of a folder's ``model.safetensors.index.json``, each
    file name checked to be a plain name inside the folder.

    The one reader of Hugging Face indexes (loads, ``load_pretrained``,
    ``dcp-ext ls``), so every malformed one fails the same way (issue 32,
    finding 7: ``{oops``, ``[]``, ``{"weight_map": []}`` and a list as a
    file name each raised a different untyped error).

    Raises:
        CheckpointCorruptError: The index is not JSON, not an object, has no
            ``weight_map`` object, or maps a key to something that is not a
            file name (:class:`~dcp_ext._runtime.names.UnsafeNameError`); the message
            names the index file and the field.
        CheckpointNotFoundError: There is no index.
    """
    where = store.describe(name)
    document = parse_stored_json(store.read_file(name), where, "safetensors index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointCorruptError(
            f"{where} is not a safetensors index: it needs a \"weight_map\" object mapping each tensor to its "
            f"file (found {type(weight_map if isinstance(document, dict) else document).__name__})",
            where,
        )
    return {
        str(key): validate_file_name(file, where, f"weight_map file of tensor {str(key)[:100]!r}")
        for key, file in weight_map.items()
    }


def _read_header(store: Store, name: str) -> SafetensorsHeader:
    """A file's parsed header: one ranged read, two when it is large."""
    where = store.describe(name)
    return parse_header(header_prefix(lambda n: store.read_head(name, n), lambda: store.size(name), _HEAD), where)


def _saved_offsets(header: SafetensorsHeader, where: str) -> dict[str, tuple[int, ...]]:
    """Each tensor's global chunk offsets from the file's ``DCP_SHARDING_INFO``."""
    text = header.metadata.get(_SHARDING_KEY)
    if text is None:
        return {}
    try:
        info = parse_stored_json(text, where, f"{_SHARDING_KEY} metadata")
        return {
            str(key): tuple(_offset(v) for v in value[_OFFSETS_KEY])
            for key, value in info.items()
        }
    except CheckpointCorruptError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointCorruptError(
            f"{where}: its {_SHARDING_KEY} metadata is not torch's per-tensor {_OFFSETS_KEY} "
            f"({type(err).__name__}: {err}); the file is damaged",
            where,
        ) from err


def _offset(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 63:
        raise ValueError(f"offset {str(value)[:40]} is not a non-negative 64-bit integer")
    return value


def _tensor_metadata(store: Store, key: str, chunks: list[_Chunk]) -> TensorStorageMetadata:
    """A tensor's DCP metadata from its chunks, checked to tile it exactly."""
    files = sorted({c.file for c in chunks})
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) > 1:
        raise CheckpointCorruptError(
            f"{store.url}: tensor {key!r} is stored with dtypes {sorted(map(str, dtypes))} in {files}",
            store.describe(files[0]),
        )
    size = tuple(max(c.offsets[d] + c.shape[d] for c in chunks) for d in range(len(chunks[0].shape)))
    if any(n >= 1 << 63 for n in size):
        raise CheckpointCorruptError(
            f"{store.url}: tensor {key!r} in {files[:5]} would have the impossible global shape {list(size)}",
            store.describe(files[0]),
        )
    seen: dict[tuple[int, ...], str] = {}
    for chunk in chunks:
        if chunk.numel and chunk.offsets in seen:
            raise CheckpointCorruptError(
                f"{store.url}: tensor {key!r} has two chunks at offsets {list(chunk.offsets)}, in "
                f"{seen[chunk.offsets]} and {chunk.file}",
                store.describe(chunk.file),
            )
        if chunk.numel:
            seen[chunk.offsets] = chunk.file
    stored = sum(c.numel for c in chunks)
    if stored != _numel(size):
        error = CheckpointIncompleteError if stored < _numel(size) else CheckpointCorruptError
        raise error(
            f"{store.url}: the chunks of tensor {key!r} in {files[:5]}{' ...' if len(files) > 5 else ''} "
            f"hold {stored} of the {_numel(size)} elements of its global shape {list(size)}"
            + (": a shard file is missing (torch's save_distributed=True writes one per rank)"
               if stored < _numel(size) else ": they overlap; the folder is damaged"),
            store.url,
        )
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=chunks[0].dtype),
        size=torch.Size(size),
        chunks=[ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.shape)) for c in chunks],
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
