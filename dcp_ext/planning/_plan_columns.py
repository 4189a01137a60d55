"""A rank's save plan in the few bytes per item that the coordinator needs.

In a ``dcp.save`` every rank sends its local ``SavePlan`` to the coordinator,
which unpickles all of them at once. DCP's plans are lists of ``WriteItem``
objects (about a kilobyte each in memory): with a 405B model and Adam state on
8,192 ranks, 28 million of them, more than a coordinator can hold, and minutes
of unpickling before planning starts. :class:`CompactSavePlan` carries the same
information as a table: the plan's distinct keys once (name, kind, dtype, global
size, place in the state dict), zlib-compressed, and one integer row per item
(key, chunk offsets, chunk sizes). Ranks with the same keys (every FSDP rank)
send byte-identical key tables, which the coordinator decodes once.

:class:`~dcp_ext.planners.LayoutSavePlanner` sends it (in ``planner_data`` of
an item-less ``SavePlan``); each rank keeps its own ``WriteItem`` list.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..format import dtype_from_name, dtype_name

__all__ = ["KeyEntry", "CompactSavePlan", "NO_ITEM", "compact_plan"]

#: The ``kind`` of a key in the flatten mapping that has no write item.
NO_ITEM = 0
_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True)
class KeyEntry:
    """One key of a plan.

    Attributes:
        fqn: The flattened key.
        kind: ``WriteItemType`` value of its items, or :data:`NO_ITEM`.
        dtype: Tensor dtype (``None`` for bytes values).
        requires_grad: Tensor property, recorded in the metadata.
        size: Global tensor size (``None`` for bytes values).
        path: Where it lies in the nested state dict (DCP's flatten mapping),
            ``None`` when the plan has no mapping for it.
    """

    fqn: str
    kind: int
    dtype: torch.dtype | None
    requires_grad: bool
    size: tuple[int, ...] | None
    path: tuple[Any, ...] | None

    @property
    def ndim(self) -> int:
        return len(self.size) if self.size is not None else 0


@dataclasses.dataclass(frozen=True)
class CompactSavePlan:
    """One rank's save plan as a key table and an integer table.

    Attributes:
        keys: zlib-compressed JSON list of the plan's keys
            (:class:`KeyEntry` fields, in order of first use).
        rows: zlib-compressed, one row per write item, in plan order, of
            ``width`` integers: the key's position in ``keys``, then
            ``(width - 1) // 2`` chunk offsets and as many chunk sizes (padded
            with offset 0, size 1 beyond the key's dimensions).
        count: Rows.
        width: Integers per row.
        wide: Rows are int64 (else int32).
    """

    keys: bytes
    rows: bytes
    count: int
    width: int
    wide: bool

    @property
    def dims(self) -> int:
        """Dimensions of the widest chunk."""
        return (self.width - 1) // 2

    def key_entries(self) -> list[KeyEntry]:
        """The key table, decoded.

        Raises:
            ValueError: The table is not a valid key table.
        """
        return decode_keys(self.keys)

    def row_array(self) -> np.ndarray:
        """The rows as an ``(items, width)`` array (int32 or int64)."""
        try:
            raw = zlib.decompress(self.rows)
        except zlib.error as err:
            raise ValueError(f"a compact save plan's rows are corrupt: {err}") from err
        flat = np.frombuffer(raw, dtype=np.int64 if self.wide else np.int32)
        if self.width < 1 or flat.size != self.count * self.width:
            raise ValueError(f"a compact save plan's rows hold {flat.size} integers, not {self.count} rows of {self.width}")
        return flat.reshape(self.count, self.width)

    def __len__(self) -> int:
        return self.count

    def write_items(self) -> list[WriteItem]:
        """The plan's ``WriteItem`` list again (tests, and planners that need items)."""
        entries = self.key_entries()
        items = []
        for row in self.row_array().tolist():
            entry = entries[row[0]]
            kind = WriteItemType(entry.kind)
            if kind == WriteItemType.BYTE_IO:
                items.append(WriteItem(index=MetadataIndex(entry.fqn), type=kind))
                continue
            assert entry.size is not None and entry.dtype is not None
            n, dims = entry.ndim, self.dims
            offsets, sizes = torch.Size(row[1 : 1 + n]), torch.Size(row[1 + dims : 1 + dims + n])
            items.append(
                WriteItem(
                    index=MetadataIndex(entry.fqn, offsets),
                    type=kind,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=entry.dtype, requires_grad=entry.requires_grad),
                        size=torch.Size(entry.size),
                    ),
                )
            )
        return items


def compact_plan(plan: SavePlan) -> CompactSavePlan:
    """(each rank) ``plan`` (items and flatten mapping) as a :class:`CompactSavePlan`.

    Raises:
        ValueError: An item's key is used with two kinds, dtypes or sizes.
    """
    entries: list[list[Any]] = []
    position: dict[str, int] = {}
    mapping = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    dims = max((len(i.tensor_data.size) for i in plan.items if i.tensor_data is not None), default=0)
    scalar = [0] * dims + [1] * dims  # a bytes value's (or padding's) offsets and sizes
    pads: dict[int, tuple[list[int], list[int]]] = {n: ([0] * (dims - n), [1] * (dims - n)) for n in range(dims + 1)}
    rows: list[list[int]] = []
    for item in plan.items:
        fqn = item.index.fqn
        data = item.tensor_data
        at = position.get(fqn)
        if at is None:
            at = position[fqn] = len(entries)
            path = mapping.get(fqn)
            if data is None:
                entries.append([fqn, item.type.value, None, False, None, _json_path(path)])
            else:
                entries.append([
                    fqn, item.type.value, dtype_name(data.properties.dtype), bool(data.properties.requires_grad),
                    [int(s) for s in data.size], _json_path(path),
                ])
        else:
            entry = entries[at]
            same = entry[1] == item.type.value and (
                data is None
                if entry[2] is None
                else data is not None and entry[2] == dtype_name(data.properties.dtype) and entry[4] == list(data.size)
            )
            if not same:
                raise ValueError(f"save plan item {fqn!r} disagrees with an earlier item of the same key")
        if data is None:
            rows.append([at, *scalar])
            continue
        chunk = data.chunk
        if chunk is None:
            raise ValueError(f"save plan item {fqn!r} is a tensor write item without its chunk bounds")
        zeros, ones = pads[len(chunk.offsets)]
        rows.append([at, *chunk.offsets, *zeros, *chunk.sizes, *ones])
    for fqn, path in mapping.items():
        if fqn not in position:
            position[fqn] = len(entries)
            entries.append([fqn, NO_ITEM, None, False, None, _json_path(path)])
    width = 1 + 2 * dims
    table = np.array(rows, dtype=np.int64).reshape(len(rows), width)
    wide = bool(table.size) and (int(table.min()) < _INT32.min or int(table.max()) > _INT32.max)
    if not wide:
        table = table.astype(np.int32)
    keys = zlib.compress(json.dumps(entries, separators=(",", ":")).encode(), 1)
    return CompactSavePlan(keys=keys, rows=zlib.compress(table.tobytes(), 1), count=len(rows), width=width, wide=wide)


def decode_keys(blob: bytes) -> list[KeyEntry]:
    """A compact plan's key table.

    Raises:
        ValueError: It is not a valid key table (the message says why).
    """
    try:
        raw = json.loads(zlib.decompress(blob))
        entries = []
        for fqn, kind, dtype, requires_grad, size, path in raw:
            entries.append(
                KeyEntry(
                    fqn=str(fqn),
                    kind=int(kind),
                    dtype=dtype_from_name(dtype) if dtype is not None else None,
                    requires_grad=bool(requires_grad),
                    size=tuple(int(s) for s in size) if size is not None else None,
                    path=tuple(path) if path is not None else None,
                )
            )
    except (ValueError, TypeError, zlib.error) as err:
        raise ValueError(f"a compact save plan's key table is malformed: {err}") from err
    return entries


def _json_path(path: Sequence[Any] | None) -> list[Any] | None:
    if path is None:
        return None
    for part in path:
        if not isinstance(part, (str, int)) or isinstance(part, bool):
            raise ValueError(f"state dict path {path!r} holds {part!r}, which is neither a key nor an index")
    return list(path)
