"""Checks of torch's ``.metadata`` against itself, before anything is allocated.

The restricted unpickler (:mod:`.torch_pickle`) decides which classes a
``.metadata`` pickle may build, not what they hold: any pickle can make a
``_StorageInfo`` without an ``offset``, a tensor of size ``[1 << 40]``
backed by a 64-byte chunk, or chunks that leave half a tensor unwritten.
:func:`check_torch_metadata` refuses such metadata where it is decoded, so
every reader of torch-format checkpoints (``dcp_ext.load``,
:class:`~dcp_ext.CheckpointReader`, ``load_whole``, ``dcp-ext inspect`` and
``verify``) gets a :class:`~dcp_ext.errors.CheckpointCorruptError` naming the
file and key instead of wrong tensors or an ``AttributeError``:

* every record has the fields DCP writes, of the types it writes them in
  (a damaged field name must not leave a field at its class default);
* each tensor's chunks lie inside its size and tile it exactly
  (:func:`tiling_problem`): a gap would be returned uninitialised by a load
  without a template, an overlap means two chunks claim the same elements;
* each chunk's stored item can hold it: torch's ``FileSystemWriter`` (and
  dcp_ext's interop copy) stores a chunk as one ``torch.save`` archive, its
  raw bytes uncompressed plus an envelope (:data:`MAX_ENVELOPE`), so its
  ``length`` is at least the chunk's ``numel * itemsize``. A size or dtype
  edited up, or a chunk claiming terabytes, is refused here; items with
  stream extensions (zstd) have no such bound (their decoded size is
  bounded when read).

The other direction, an item longer than its chunk's archive can be
(:func:`oversized_item`), is checked by ``load_whole`` after its data file's
size (which explains most such items: a truncated file); loads into a
template take dtype and shape from the template. A size or dtype change that
keeps the byte count within the envelope's slack (a dtype of the same width,
or a small tensor) cannot be seen in the metadata at all: only the archive's
own header tells, when the item is read.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .._runtime import _StorageInfo
from ..errors import CheckpointCorruptError
from .document import validate_file_name

__all__ = ["check_torch_metadata", "check_tiling", "tiling_problem", "oversized_item", "MAX_ENVELOPE"]

#: Bytes a ``torch.save`` archive may add around a tensor's raw bytes.
#: torch 2.13 adds 1,513 to 1,832 (zip records, ``data.pkl``, 64-byte data
#: alignment); the slack admits other torch versions and a larger
#: ``torch.serialization.config.save.storage_alignment``.
MAX_ENVELOPE = 64 << 10

# Elements a tensor may claim (no machine holds more), which also keeps every
# product of chunk sizes within int64.
_MAX_NUMEL = 1 << 60
# Chunk pairs the sweep of an irregular layout compares before giving up
# (regular layouts, the ones DCP writes, never reach the sweep).
_MAX_PAIR_CHECKS = 20_000_000
_MISSING = object()
_INT = frozenset({int})
_SAME = "they overlap (two chunks claim the same elements)"


def _short(value: Any) -> str:
    """``repr(value)``, cut to a length a message can hold; any value (a
    half-built object from a pickle may fail to print)."""
    try:
        text = tuple.__repr__(value) if isinstance(value, tuple) else repr(value)
    except Exception:  # noqa: BLE001 - e.g. a dataclass without its fields
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def _ints(value: Any, ndim: int | None) -> tuple[int, ...] | None:
    """``value`` as a tuple of ``ndim`` (any number if ``None``) integers in
    ``[0, 2**63)``, or ``None`` when it is not one."""
    if not isinstance(value, (tuple, list)) or (ndim is not None and len(value) != ndim):
        return None
    # Types first (C loops: this runs for every chunk), so min and max compare ints only.
    if value and (not _INT.issuperset(map(type, value)) or min(value) < 0 or max(value) >= 1 << 63):
        return None
    return tuple(value)


def check_torch_metadata(metadata: Metadata, where: str) -> None:
    """Refuse torch ``.metadata`` whose records are incomplete, mistyped or
    contradict each other (see the module docstring for what is checked).

    Called once per decode, before any tensor is allocated from it; walks
    every key, chunk and storage record once.

    Args:
        metadata: As :func:`~dcp_ext.metadata.load_torch_metadata` unpickled it.
        where: The ``.metadata`` file, for messages.

    Raises:
        CheckpointCorruptError: Naming the file and the first key at fault.
        UnsafeNameError: A storage record names a file outside the checkpoint.
    """
    # Every DCP release pickles these (a damaged field name leaves one at its class default).
    missing = [n for n in ("state_dict_metadata", "planner_data", "storage_data") if n not in vars(metadata)]
    if missing:
        raise CheckpointCorruptError(f"{where} has no {', '.join(missing)}; the metadata is damaged", where)
    keys = metadata.state_dict_metadata
    if not isinstance(keys, dict) or not all(type(k) is str for k in keys):
        raise CheckpointCorruptError(f"{where}: its state_dict_metadata is not a map of keys", where)
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        raise CheckpointCorruptError(
            f"{where}: its storage_meta is a {type(storage_meta).__name__}, not DCP's StorageMeta", where)
    stored = _storage_records(metadata.storage_data, where)
    for fqn, md in keys.items():
        if isinstance(md, BytesStorageMetadata):
            if (fqn, None) not in stored:
                raise CheckpointCorruptError(f"{where}: key {_short(fqn)} has no storage record", where)
        elif isinstance(md, TensorStorageMetadata):
            _check_tensor(fqn, md, stored, where)
        else:
            raise CheckpointCorruptError(
                f"{where}: key {_short(fqn)} is described by a {type(md).__name__}, not DCP's tensor or "
                f"bytes metadata", where)


def _storage_records(storage: Any, where: str) -> dict[tuple[str, tuple[int, ...] | None], _StorageInfo]:
    """Every storage record, checked, by ``(key, chunk offsets)``."""
    if not isinstance(storage, dict):
        raise CheckpointCorruptError(f"{where} has no storage map", where)
    records: dict[tuple[str, tuple[int, ...] | None], _StorageInfo] = {}
    names: set[str] = set()  # file names already checked: a checkpoint has few, its records many
    for index, info in storage.items():
        fqn = getattr(index, "fqn", _MISSING)
        offset = getattr(index, "offset", _MISSING)
        at = None if offset is None else _ints(offset, None)
        if not isinstance(index, MetadataIndex) or type(fqn) is not str or (offset is not None and at is None):
            raise CheckpointCorruptError(
                f"{where}: a storage record is keyed by {_short(index)[:60]}, not a key and chunk offsets", where)
        fields = vars(info) if isinstance(info, _StorageInfo) else {}
        if not ({"relative_path", "offset", "length"} <= fields.keys()
                and ((type(info.relative_path) is str and info.relative_path in names)
                     or validate_file_name(info.relative_path, where))
                and _ints((info.offset, info.length), 2) is not None
                and _names_or_none(fields.get("transform_descriptors"))):
            raise CheckpointCorruptError(f"{where}: the storage record of {_record(fqn, at)} {_fault(info)}", where)
        names.add(info.relative_path)
        records[(fqn, at)] = info
    return records


def _names_or_none(descriptors: Any) -> bool:
    return descriptors is None or isinstance(descriptors, (list, tuple)) and all(type(d) is str for d in descriptors)


def _record(fqn: str, at: tuple[int, ...] | None) -> str:
    return (f"{fqn!r}" if at is None else f"{fqn!r} at {list(at)}")[:120]


def _fault(info: Any) -> str:
    """What is wrong with a storage record (one :func:`_storage_records` refused)."""
    if not isinstance(info, _StorageInfo):
        return f"is a {type(info).__name__}, which dcp_ext cannot read"
    fields = vars(info)
    missing = [n for n in ("relative_path", "offset", "length") if n not in fields]
    if missing:
        return f"has no {', '.join(missing)}; the metadata is damaged"
    if _ints((info.offset, info.length), 2) is None:
        return (f"in {info.relative_path!r} has offset {_short(info.offset)[:40]} and length "
                f"{_short(info.length)[:40]}; both must be non-negative 64-bit integers")
    return f"has transform_descriptors {_short(fields.get('transform_descriptors'))}, not a list of names"


def _check_tensor(fqn: str, md: TensorStorageMetadata, stored: Mapping[tuple[str, Any], _StorageInfo],
                  where: str) -> None:
    """One tensor key: its properties, size and chunks, and each chunk's stored bytes."""
    name = _short(fqn)
    properties = getattr(md, "properties", None)
    dtype = getattr(properties, "dtype", None)
    if not isinstance(properties, TensorProperties) or not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"{where}: key {name} has no dtype", where)
    shape = _ints(getattr(md, "size", None), None)
    if shape is None:
        raise CheckpointCorruptError(
            f"{where}: key {name} has size {_short(getattr(md, 'size', None))}, not a list of "
            f"non-negative integers", where)
    chunks = getattr(md, "chunks", None)
    if not isinstance(chunks, (list, tuple)):
        raise CheckpointCorruptError(f"{where}: key {name} has no list of chunks", where)
    ndim = len(shape)
    offsets: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    itemsize = dtype.itemsize
    for chunk in chunks:
        at = _ints(getattr(chunk, "offsets", None), ndim)
        extent = _ints(getattr(chunk, "sizes", None), ndim)
        if not isinstance(chunk, ChunkStorageMetadata) or at is None or extent is None:
            raise CheckpointCorruptError(
                f"{where}: a chunk of key {name} is {_short(chunk)}, not {ndim} offsets and {ndim} sizes "
                f"(the key's size is {list(shape)})", where)
        info = stored.get((fqn, at))
        if info is None:
            raise CheckpointCorruptError(
                f"{where}: the chunk of key {name} at {list(at)} has no storage record", where)
        raw = math.prod(extent) * itemsize
        if info.length < raw and not getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(
                f"{where}: the chunk of key {name} at {list(at)} ({dtype}, sizes {list(extent)}) needs {raw} "
                f"bytes, but its stored item in {info.relative_path!r} has {info.length}; the key's size or "
                f"dtype was changed, or the metadata is damaged", where)
        offsets.append(at)
        sizes.append(extent)
    rows = (len(chunks), ndim)
    check_tiling(fqn, shape, np.array(offsets, dtype=np.int64).reshape(rows),
                 np.array(sizes, dtype=np.int64).reshape(rows), where)


def oversized_item(fqn: str, at: Sequence[int], extent: Sequence[int], dtype: torch.dtype,
                   info: _StorageInfo) -> str | None:
    """Why a torch-written chunk's stored item is too long for it, or ``None``:
    a ``torch.save`` archive of its raw bytes is at most :data:`MAX_ENVELOPE`
    longer (items with stream extensions are never too long here).

    A key whose size or dtype was edited down would otherwise load the
    archive's first elements, or its values cast.

    Args:
        fqn: The tensor's key.
        at: The chunk's offsets.
        extent: The chunk's sizes.
        dtype: The key's dtype.
        info: The chunk's storage record (checked by :func:`check_torch_metadata`).
    """
    raw = math.prod(extent) * dtype.itemsize
    if getattr(info, "transform_descriptors", None) or info.length <= raw + MAX_ENVELOPE:
        return None
    return (f"the chunk of key {_short(fqn)} at {list(at)} ({dtype}, sizes {list(extent)}) has {raw} bytes, but "
            f"its stored item in {info.relative_path!r} has {info.length}, more than a torch.save archive of it "
            f"can ({raw} + {MAX_ENVELOPE}); the key's size or dtype was changed, or the metadata is damaged")


def check_tiling(fqn: str, shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray, where: str) -> None:
    """Refuse chunks that do not tile a tensor exactly (:func:`tiling_problem`).

    Raises:
        CheckpointCorruptError: Naming the file (``where``) and key.
    """
    problem = tiling_problem(fqn, shape, offsets, sizes)
    if problem is not None:
        raise CheckpointCorruptError(f"{where}: {problem}", where)


def tiling_problem(fqn: str, shape: Sequence[int], offsets: np.ndarray, sizes: np.ndarray) -> str | None:
    """What stops chunks from tiling a tensor exactly, naming the key: a
    chunk outside its size, elements no chunk holds (a load without a
    template would return them uninitialised), or elements two chunks hold;
    ``None`` when they tile it.

    Layouts DCP writes (each dimension cut at the same points for every
    chunk: a grid) are checked on the arrays; any other is swept along one
    dimension.

    Args:
        fqn: The tensor's key, for messages.
        shape: Its global size (integers in ``[0, 2**63)``).
        offsets: ``(chunks, ndim)`` int64 chunk offsets.
        sizes: ``(chunks, ndim)`` int64 chunk sizes.
    """
    name = _short(fqn)
    ndim = len(shape)
    if any(n >= 1 << 63 for n in shape) or math.prod(shape) > _MAX_NUMEL:
        return f"key {name} has an impossible size {list(shape)}"
    rows = offsets.shape[0]
    if offsets.shape != (rows, ndim) or sizes.shape != (rows, ndim):
        return f"the chunks of key {name} do not have its {ndim} dimensions"
    total = math.prod(shape)
    if rows and ndim:
        limit = np.array(shape, dtype=np.int64)
        # ``offsets > limit - sizes``: a hostile offset plus size must not overflow into passing.
        if offsets.min() < 0 or sizes.min() < 0 or bool((offsets > limit - sizes).any()):
            return f"a chunk of key {name} lies outside the key's size {list(shape)}"
    if total == 0:
        return None  # every chunk inside an empty tensor is empty
    live = sizes.all(axis=1) if ndim else np.ones(rows, dtype=bool)
    offsets, sizes = offsets[live], sizes[live]
    # Every factor is at most its dimension of shape, so no product exceeds total.
    held = sum(np.prod(sizes, axis=1, dtype=np.int64).tolist())
    if held < total:
        return (f"the chunks of key {name} hold {held} of its {total} elements (size {list(shape)}): the rest "
                f"would be left uninitialised; the key's size was changed, or chunks are missing")
    problem = _SAME if held > total else _overlap(offsets, sizes, shape)
    return None if problem is None else f"the chunks of key {name} (size {list(shape)}) do not tile it: {problem}"


def _overlap(offsets: np.ndarray, sizes: np.ndarray, shape: Sequence[int]) -> str | None:
    """What overlaps among the (non-empty, in-bounds) chunks, ``None`` if nothing does."""
    if len(offsets) < 2:
        return None
    ends = offsets + sizes
    # Dimensions every chunk spans whole cannot separate two chunks.
    cut = [k for k in range(len(shape))
           if not (bool((offsets[:, k] == 0).all()) and bool((ends[:, k] == shape[k]).all()))]
    if not cut:
        return _SAME  # two chunks of the whole tensor
    offsets, ends = offsets[:, cut], ends[:, cut]
    if len(cut) == 1:
        order = np.argsort(offsets[:, 0], kind="stable")
        return None if bool((offsets[order[1:], 0] >= ends[order[:-1], 0]).all()) else _SAME
    # A grid: each chunk is one cell between consecutive cut points of every
    # dimension, and no two chunks are the same cell.
    cells = []
    for k in range(len(cut)):
        points = np.unique(np.concatenate([offsets[:, k], ends[:, k]]))
        first, last = np.searchsorted(points, offsets[:, k]), np.searchsorted(points, ends[:, k])
        if bool((last - first != 1).any()):
            return _swept(offsets, ends)
        cells.append(first)
    return None if len(np.unique(np.stack(cells, axis=1), axis=0)) == len(offsets) else _SAME


def _swept(offsets: np.ndarray, ends: np.ndarray) -> str | None:
    """:func:`_overlap` of an irregular layout, by a sweep along the dimension
    with the most distinct offsets (the fewest chunks open at once)."""
    axis = max(range(offsets.shape[1]), key=lambda k: len(np.unique(offsets[:, k])))
    lows, highs = offsets.tolist(), ends.tolist()
    open_: list[tuple[int, int]] = []  # (end along the axis, chunk) of chunks the sweep is inside
    live: set[int] = set()
    checks = 0
    for box in np.argsort(offsets[:, axis], kind="stable").tolist():
        start = lows[box][axis]
        while open_ and open_[0][0] <= start:
            live.discard(heapq.heappop(open_)[1])
        checks += len(live)
        if checks > _MAX_PAIR_CHECKS:
            return f"{len(offsets)} chunks in an irregular layout, too many to check for overlaps"
        low, high = lows[box], highs[box]
        for other in live:
            if all(a < d and c < b for a, b, c, d in zip(low, high, lows[other], highs[other])):
                return f"{_SAME} (the chunks at {lows[other]} and {low}, in the dimensions they cut)"
        live.add(box)
        heapq.heappush(open_, (high[axis], box))
    return None
