"""Synthesized DCP save plans, write results and load state dicts (no tensor data).

The scale simulator (:mod:`bench.scale`) needs what the coordinator of an
N-rank ``dcp.save`` receives: every rank's local ``SavePlan`` as
``LayoutSavePlanner.create_local_plan`` makes it for an FSDP2 (optionally
x TP) model + Adam state dict, and, after the data is written, every rank's
``WriteResult`` list as :class:`dcp_ext.CheckpointWriter` reports it. This
module builds both directly from a :class:`~bench.scale.shapes.ModelShape`,
without tensors or a process group, as fresh objects per rank (as the
coordinator holds them after unpickling each rank's plan), so the real
planners and metadata encoders can run on them and their memory is counted.
``tests/test_scale.py`` checks them item by item against real gloo worlds.

What a rank's state dict holds (``{"model": ..., "optimizer": ...}`` from
``get_state_dict(model, optim)``, flattened by DCP):

* ``model.{fqn}``: each parameter's local shard (``WriteItemType.SHARD``);
* ``optimizer.state.{fqn}.step``: Adam's step, a plain float32 scalar on
  every rank (``WriteItemType.TENSOR``; DCP keeps one copy);
* ``optimizer.state.{fqn}.exp_avg`` / ``.exp_avg_sq``: shards like the model's;
* ``optimizer.param_groups.0.{lr, betas, ...}``: plain values
  (``WriteItemType.BYTE_IO``) on every rank.

Sharding follows DTensor exactly (``compute_local_shape_and_global_offset``):
FSDP2 splits dim 0 over the data-parallel ranks with ``torch.chunk``
semantics, so trailing ranks can get an empty shard, whose offset DTensor
reports as the dimension's size. With tensor parallelism (a row-major
``(dp, tp)`` mesh, as ``init_device_mesh(..., ("dp", "tp"))`` makes), TP
splits column-parallel weights on dim 0 and FSDP2 then splits each TP shard
(DTensor's ``_StridedShard`` placements, whose arithmetic is reproduced),
row-parallel weights are split on dim 0 by FSDP2 and dim 1 by TP, and norms
are split by FSDP2 alone (replicated over TP).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_ext.format import torch_save_envelope
from dcp_ext.layout import FileAssignment
from dcp_ext.metadata import StoredItem

from .shapes import OPTIMIZER_STATES, ModelShape, Param

__all__ = [
    "Layout",
    "local_chunk",
    "rank_state_keys",
    "rank_save_plan",
    "rank_sent_plan",
    "save_plans",
    "finish_plans",
    "iter_final_plans",
    "FinishFile",
    "PackResults",
    "WrittenFiles",
    "dcp_ext_write_results",
    "torch_write_results",
    "load_state_dict",
    "FRAME_SIZE",
]

#: dcp_ext's default frame (``IOConfig.frame_size``): one checksum per MiB.
FRAME_SIZE = 1 << 20

#: Adam's learning rate in the synthesized param group (any float pickles alike).
_LR = 3e-4


@dataclass(frozen=True)
class Layout:
    """How N ranks shard the state: FSDP2 over ``ranks // tp``, times TP.

    Attributes:
        ranks: World size N.
        tp: Tensor-parallel degree (``1``: FSDP2 alone); must divide ``ranks``.
    """

    ranks: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.tp < 1 or self.ranks % self.tp:
            raise ValueError(f"{self.ranks} ranks cannot form a (dp, tp={self.tp}) mesh")

    @property
    def dp(self) -> int:
        return self.ranks // self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp rank, tp rank)`` of a global rank on the row-major mesh."""
        return divmod(rank, self.tp)


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(size, start)`` of piece ``index`` of ``n`` rows cut in ``parts`` as ``torch.chunk`` does."""
    full = n // parts if n % parts == 0 else -(-n // parts)
    start = full * index
    return max(0, min(n, start + full) - start), min(n, start)


def _strided_chunk(n: int, layout: Layout, dp_rank: int, tp_rank: int) -> tuple[int, int]:
    """``(size, offset)`` on dim 0 under ``(_StridedShard(0, split_factor=tp), Shard(0))``,
    DTensor's placements of a column-parallel weight under FSDP2.

    The data-parallel shard is the ``dp_rank``-th piece of each of the ``tp``
    pieces, concatenated; tensor parallelism then chunks that evenly. With
    uneven sizes this is not "TP piece, then its FSDP piece", and the chunk DCP
    records is the first global row and the row count, as computed here.
    """
    runs = []
    for piece in range(layout.tp):
        piece_size, piece_start = _chunk(n, layout.tp, piece)
        size, start = _chunk(piece_size, layout.dp, dp_rank)
        if size:
            runs.append((piece_start + start, size))
    size, start = _chunk(sum(length for _, length in runs), layout.tp, tp_rank)
    if size == 0:
        return 0, n
    for run_start, length in runs:
        if start < length:
            return size, run_start + start
        start -= length
    raise AssertionError("unreachable: the shard lies inside the runs")


def local_chunk(param: Param, layout: Layout, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(sizes, offsets)`` of ``rank``'s shard of ``param``, as DTensor computes
    them (``compute_local_shape_and_global_offset``).

    An empty shard's offset on its split dimension is that dimension's size.
    """
    dp_rank, tp_rank = layout.coords(rank)
    shape = param.shape
    sizes, offsets = list(shape), [0] * len(shape)
    tp_dim = param.tp_dim if layout.tp > 1 else None
    if tp_dim == 0:
        sizes[0], offsets[0] = _strided_chunk(shape[0], layout, dp_rank, tp_rank)
    else:
        sizes[0], offsets[0] = _chunk(shape[0], layout.dp, dp_rank)
        if tp_dim is not None:
            sizes[tp_dim], offsets[tp_dim] = _chunk(shape[tp_dim], layout.tp, tp_rank)
    for dim in {0, tp_dim or 0}:
        if sizes[dim] == 0:
            offsets[dim] = shape[dim]
    return tuple(sizes), tuple(offsets)


@lru_cache(maxsize=8)
def _param_group(fqns: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """Adam's param group as ``get_optimizer_state_dict`` returns it: its
    options (from a real ``torch.optim.Adam``), then ``params`` as key names."""
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=_LR)
    options = {k: v for k, v in adam.param_groups[0].items() if k != "params"}
    return (*options.items(), ("params", list(fqns)))


def rank_state_keys(shape: ModelShape) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """Every flattened key of a rank's state dict and its path (DCP's flatten
    mapping), in state-dict order."""
    params = shape.params()
    for p in params:
        yield f"model.{p.fqn}", ("model", p.fqn)
    for p in params:
        for state in ("step", *OPTIMIZER_STATES):
            yield f"optimizer.state.{p.fqn}.{state}", ("optimizer", "state", p.fqn, state)
    for name, _ in _param_group(tuple(p.fqn for p in params)):
        yield f"optimizer.param_groups.0.{name}", ("optimizer", "param_groups", 0, name)


def _copy(text: str) -> str:
    """A new string object equal to ``text`` (each unpickled plan has its own)."""
    return (text + ".")[:-1]


def _shard_item(fqn: str, sizes: tuple[int, ...], offsets: tuple[int, ...], dtype: torch.dtype,
                shape: tuple[int, ...], kind: WriteItemType = WriteItemType.SHARD) -> WriteItem:
    # DCP builds each torch.Size separately (_create_write_items_for_dtensor).
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def rank_save_plan(shape: ModelShape, layout: Layout, rank: int) -> SavePlan:
    """The ``SavePlan`` that ``LayoutSavePlanner.create_local_plan`` returns on ``rank``."""
    params = shape.params()
    keys = [(_copy(flat), path) for flat, path in rank_state_keys(shape)]
    mapping: dict[str, tuple[Any, ...]] = {}
    for flat, path in keys:
        mapping[flat] = tuple(_copy(p) if isinstance(p, str) else p for p in path)
    chunks = [local_chunk(p, layout, rank) for p in params]
    items: list[WriteItem] = []
    n = len(params)
    for (flat, _), p, (sizes, offsets) in zip(keys[:n], params, chunks):
        items.append(_shard_item(flat, sizes, offsets, shape.param_dtype, p.shape))
    per_state = 1 + len(OPTIMIZER_STATES)
    for i, (p, (sizes, offsets)) in enumerate(zip(params, chunks)):
        step, *states = keys[n + i * per_state : n + (i + 1) * per_state]
        items.append(_shard_item(step[0], (), (), torch.float32, (), WriteItemType.TENSOR))
        for flat, _ in states:
            items.append(_shard_item(flat, sizes, offsets, shape.state_dtype, p.shape))
    for flat, _ in keys[n + n * per_state :]:
        items.append(WriteItem(index=MetadataIndex(flat), type=WriteItemType.BYTE_IO))
    return SavePlan(items, planner_data=mapping)


def rank_sent_plan(shape: ModelShape, layout: Layout, rank: int) -> SavePlan:
    """What ``LayoutSavePlanner.create_local_plan`` sends the coordinator from
    ``rank``: an item-less plan carrying the :class:`~dcp_ext.planning._plan_columns.CompactSavePlan`
    of :func:`rank_save_plan` (the rank keeps its items)."""
    from dcp_ext.planning._plan_columns import compact_plan

    return SavePlan([], planner_data=compact_plan(rank_save_plan(shape, layout, rank)))


def save_plans(shape: ModelShape, layout: Layout) -> list[SavePlan]:
    """Every rank's local plan: what the coordinator's ``create_global_plan`` gets."""
    return [rank_save_plan(shape, layout, rank) for rank in range(layout.ranks)]


@lru_cache(maxsize=8)
def _bytes_lengths(fqns: tuple[str, ...]) -> dict[str, int]:
    """Stored bytes of each param-group value: its ``torch.save`` (DCP's BYTE_IO)."""
    lengths = {}
    for name, value in _param_group(fqns):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        lengths[f"optimizer.param_groups.0.{name}"] = len(buffer.getvalue())
    return lengths


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    n = item.tensor_data.properties.dtype.itemsize
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n


def _item_layout(item: WriteItem, byte_lengths: dict[str, int]) -> tuple[int, int, int]:
    """``(length, data offset, data length)`` of an item in a dcp_ext data file."""
    if item.type == WriteItemType.BYTE_IO:
        n = byte_lengths[item.index.fqn]
        return n, 0, n
    assert item.tensor_data is not None
    nbytes = _nbytes(item)
    envelope = torch_save_envelope(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
    return len(envelope.prefix) + nbytes + len(envelope.suffix), len(envelope.prefix), nbytes


def _fake_checksums(nbytes: int, seed: int) -> tuple[int, ...]:
    """One distinct 64-bit value per frame (the digest's value does not change any size)."""
    base = (0x9E3779B97F4A7C15 * (seed + 1)) & 0x7FFF_FFFF_FFFF_0000
    return tuple(range(base, base + -(-nbytes // FRAME_SIZE)))


def finish_plans(planner_type: Callable[[], DefaultSavePlanner], local_plans: list[SavePlan],
                 global_plans: list[SavePlan]) -> list[SavePlan]:
    """Each rank's final plan: its planner's ``finish_plan`` on the coordinator's answer.

    A rank's planner holds the plan its ``create_local_plan`` made (DCP's
    ``SavePlanner.plan``); a fresh planner is given that plan here.
    """
    return list(iter_final_plans(planner_type, local_plans, global_plans))


def iter_final_plans(planner_type: Callable[[], DefaultSavePlanner], local_plans: Iterable[SavePlan],
                     global_plans: list[SavePlan]) -> Iterator[SavePlan]:
    """:func:`finish_plans` one rank at a time (``local_plans`` may be a generator)."""
    for local, answer in zip(local_plans, global_plans):
        planner = planner_type()
        planner.plan = local  # what create_local_plan leaves behind
        yield planner.finish_plan(answer)


#: What a writer does when a data file's items are written: returns the items
#: as the writer reports them and the bytes it appends to the file (metadata
#: version 3: the file's frame index; see ``bench.scale.adapter.finish_data_file``).
FinishFile = Callable[[str, list[StoredItem]], tuple[list[StoredItem], bytes]]
#: What a writer reports for a rank's stored items (by position in its final
#: plan) when it packs them into one result (``bench.scale.adapter.pack_rank_results``).
PackResults = Callable[[list[int], list[StoredItem]], list[WriteResult]]


@dataclass(frozen=True)
class WrittenFiles:
    """What the ranks' writers report for one save.

    Attributes:
        results: Each rank's ``WriteResult`` list, as the coordinator gathers them.
        file_indexes: The bytes each data file ends with after its items.
        frames: Frames (checksums) written.
    """

    results: list[list[WriteResult]]
    file_indexes: dict[str, bytes]
    frames: int


def dcp_ext_write_results(shape: ModelShape, final_plans: Iterable[SavePlan],
                          finish_file: FinishFile | None = None, pack: PackResults | None = None) -> WrittenFiles:
    """What each rank's :class:`dcp_ext.CheckpointWriter` (default settings:
    uncompressed, 1 MiB frames, one file per kind) reports for its final plan
    (:func:`finish_plans`): items in plan order per file, each inside its
    ``torch.save`` envelope, one checksum per frame; then ``finish_file``
    on each file's items (none: the items as ``FrameEncoder`` made them),
    and ``pack`` on the rank's results (none: one ``WriteResult`` per item).
    ``final_plans`` may be a generator: one rank's plan is held at a time."""
    byte_lengths = _bytes_lengths(tuple(p.fqn for p in shape.params()))
    results: list[list[WriteResult]] = []
    file_indexes: dict[str, bytes] = {}
    seed = frames = 0
    for plan in final_plans:
        assignment = plan.storage_data
        if not isinstance(assignment, FileAssignment):
            raise TypeError("dcp_ext_write_results needs plans that LayoutSavePlanner assigned files to")
        position_of = {id(item): k for k, item in enumerate(plan.items)}
        positions: list[int] = []
        rank_stored: list[StoredItem] = []
        rank_results = []
        for name, items in assignment.files_for(list(plan.items), 1):
            position = 0
            stored_items = []
            for item in items:
                length, data_at, data_length = _item_layout(item, byte_lengths)
                seed += 1
                stored_items.append(StoredItem(
                    name, position, length, data_at, data_length,
                    frame_size=FRAME_SIZE, checksums=_fake_checksums(data_length, seed),
                ))
                frames += len(stored_items[-1].checksums)
                position += length
            if finish_file is not None:
                stored_items, file_indexes[name] = finish_file(name, stored_items)
            if pack is not None:
                positions += [position_of[id(item)] for item in items]
                rank_stored += stored_items
            else:
                rank_results += [WriteResult(index=item.index, size_in_bytes=stored.length, storage_data=stored)
                                 for item, stored in zip(items, stored_items)]
        results.append(pack(positions, rank_stored) if pack is not None else rank_results)
    return WrittenFiles(results, file_indexes, frames)


def torch_write_results(shape: ModelShape, final_plans: list[SavePlan]) -> list[list[WriteResult]]:
    """Each rank's ``WriteResult`` list from torch's ``FileSystemWriter``
    (defaults: one file ``__{rank}_0.distcp`` per rank, items in plan order,
    each written with ``torch.save``)."""
    byte_lengths = _bytes_lengths(tuple(p.fqn for p in shape.params()))
    results: list[list[WriteResult]] = []
    for rank, plan in enumerate(final_plans):
        name = f"__{rank}_0.distcp"
        position = 0
        rank_results = []
        for item in plan.items:
            length, _, _ = _item_layout(item, byte_lengths)
            info = _StorageInfo(name, position, length)
            rank_results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            position += length
        results.append(rank_results)
    return results


def load_state_dict(shape: ModelShape, layout: Layout, mesh: Any) -> dict[str, Any]:
    """The ``{"model": ..., "optimizer": ...}`` state dict one rank of a
    ``layout`` world loads into: DTensors on ``mesh`` (1-D, ``layout.tp == 1``)
    over ``torch.empty`` local shards (never touched, so they cost no memory),
    Adam's ``step`` scalars and param group.

    The rank is ``mesh``'s current rank (a fake process group in the simulator).
    """
    from torch.distributed.tensor import DTensor, Shard

    if layout.tp != 1:
        raise NotImplementedError("load_state_dict builds FSDP2 (1-D) targets only")
    rank = mesh.get_rank()
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}

    def shard(p: Param, dtype: torch.dtype) -> Any:
        sizes, _ = local_chunk(p, layout, rank)
        local = torch.empty(sizes, dtype=dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(p.shape), stride=_contiguous_stride(p.shape))

    for p in shape.params():
        model[p.fqn] = shard(p, shape.param_dtype)
    for p in shape.params():
        state[p.fqn] = {"step": torch.tensor(1.0), **{s: shard(p, shape.state_dtype) for s in OPTIMIZER_STATES}}
    group = dict(_param_group(tuple(p.fqn for p in shape.params())))
    return {"model": model, "optimizer": {"state": state, "param_groups": [group]}}


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for s in reversed(shape):
        stride.append(step)
        step *= s
    return tuple(reversed(stride))
