"""Array-speed synthesis of what a dcp_ext coordinator receives from N ranks.

:mod:`bench.scale.plans` builds every rank's plan and write results as DCP
objects, as the ranks themselves do: exact, and checked against real gloo
worlds, but at a 405B model on 8,192 ranks that is 37 million ``WriteItem``
and ``StoredItem`` objects built and thrown away, most of an hour of untimed
work. This module builds the same bytes directly with numpy:

* :func:`sent_plans`: each rank's :class:`~dcp_ext.planning._plan_columns.CompactSavePlan`
  (what ``rank_sent_plan`` returns);
* :func:`packed_results`: each rank's packed write results and every data
  file's frame index (what ``dcp_ext_write_results(..., finish_data_file,
  pack_rank_results)`` returns for the ranks' final plans).

``tests/test_scale.py`` checks both byte for byte against the object path.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import xxhash
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_ext.format import torch_save_envelope
from dcp_ext.planning._plan_columns import CompactSavePlan, KeyEntry, compact_plan
from dcp_ext.layout import FileAssignment, key_kind
from dcp_ext.metadata.document import FrameIndexRef
from dcp_ext.metadata.frame_index import frame_index_of
from dcp_ext.planning._write_results import RESULTS_INDEX, RankWriteResults

from .plans import FRAME_SIZE, Layout, WrittenFiles, _bytes_lengths, local_chunk, rank_save_plan
from .shapes import OPTIMIZER_STATES, ModelShape

__all__ = ["sent_plans", "packed_results"]

_INT32 = np.iinfo(np.int32)
_BYTE_IO = WriteItemType.BYTE_IO.value


def _param_chunks(shape: ModelShape, layout: Layout) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per parameter, every rank's shard: ``(sizes, offsets)``, each ``(ranks, ndim)``."""
    out = []
    ranks = np.arange(layout.ranks)
    for param in shape.params():
        if layout.tp == 1:
            # FSDP2 alone: torch.chunk of dim 0 over the ranks (as bench.scale.plans._chunk).
            n = param.shape[0]
            full = n // layout.ranks if n % layout.ranks == 0 else -(-n // layout.ranks)
            start = full * ranks
            size0 = np.maximum(0, np.minimum(n, start + full) - start)
            offset0 = np.where(size0 == 0, n, np.minimum(n, start))
            sizes = np.tile(np.array(param.shape, dtype=np.int64), (layout.ranks, 1))
            offsets = np.zeros_like(sizes)
            sizes[:, 0], offsets[:, 0] = size0, offset0
        else:
            pairs = [local_chunk(param, layout, r) for r in range(layout.ranks)]
            sizes = np.array([p[0] for p in pairs], dtype=np.int64).reshape(layout.ranks, len(param.shape))
            offsets = np.array([p[1] for p in pairs], dtype=np.int64).reshape(layout.ranks, len(param.shape))
        out.append((sizes, offsets))
    return out


def _shard_params(shape: ModelShape, entries: list[KeyEntry]) -> dict[str, int]:
    """Which parameter each shard key belongs to (its model weight or an Adam state)."""
    of: dict[str, int] = {}
    for k, param in enumerate(shape.params()):
        of[f"model.{param.fqn}"] = k
        for state in OPTIMIZER_STATES:
            of[f"optimizer.state.{param.fqn}.{state}"] = k
    return {e.fqn: of[e.fqn] for e in entries if e.kind == WriteItemType.SHARD.value}


def sent_plans(shape: ModelShape, layout: Layout) -> list[SavePlan]:
    """Every rank's plan as ``LayoutSavePlanner.create_local_plan`` sends it (``rank_sent_plan``)."""
    template = compact_plan(rank_save_plan(shape, layout, 0))
    entries = template.key_entries()
    rows0 = template.row_array().astype(np.int64)
    dims = template.dims
    param_of = _shard_params(shape, entries)
    chunks = _param_chunks(shape, layout)
    # Shard rows grouped by their number of dimensions: one fancy assignment each per rank.
    groups: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    by_ndim: dict[int, tuple[list[int], list[int]]] = {}
    for j, entry_id in enumerate(rows0[:, 0].tolist()):
        entry = entries[entry_id]
        if entry.fqn in param_of:
            rows, params = by_ndim.setdefault(entry.ndim, ([], []))
            rows.append(j)
            params.append(param_of[entry.fqn])
    for n, (rows, params) in by_ndim.items():
        used = sorted(set(params))
        local = {p: k for k, p in enumerate(used)}
        sizes = np.stack([chunks[p][0] for p in used], axis=1)  # (ranks, params, n)
        offsets = np.stack([chunks[p][1] for p in used], axis=1)
        groups[n] = (np.array(rows), np.array([local[p] for p in params]), np.stack([offsets, sizes], axis=2))
    plans = []
    for rank in range(layout.ranks):
        table = rows0.copy()
        for n, (rows, params, boxes) in groups.items():
            box = boxes[rank][params]  # (items, 2, n)
            table[rows, 1 : 1 + n] = box[:, 0]
            table[rows, 1 + dims : 1 + dims + n] = box[:, 1]
        wide = bool(table.size) and (int(table.min()) < _INT32.min or int(table.max()) > _INT32.max)
        if not wide:
            table = table.astype(np.int32)
        compact = CompactSavePlan(
            keys=bytes(bytearray(template.keys)),  # each rank's arrives as its own object
            rows=zlib.compress(table.tobytes(), 1),
            count=len(table),
            width=template.width,
            wide=wide,
        )
        plans.append(SavePlan([], planner_data=compact))
    return plans


class _Envelopes:
    """Lengths of the ``torch.save`` envelope around a chunk, by dtype and shape."""

    def __init__(self) -> None:
        self._found: dict[tuple[Any, ...], tuple[int, int]] = {}

    def lengths(self, dtype: Any, shape: tuple[int, ...]) -> tuple[int, int]:
        key = (dtype, shape)
        found = self._found.get(key)
        if found is None:
            envelope = torch_save_envelope(dtype, shape)
            found = self._found[key] = (len(envelope.prefix), len(envelope.suffix))
        return found


def _kind_table(entries: list[KeyEntry], replicated_apart: bool) -> tuple[list[str], np.ndarray]:
    """The data-file kinds, and each key's kind as a position among them."""
    names: list[str] = []
    ids = []
    for e in entries:
        kind = key_kind(e.fqn, e.kind == WriteItemType.SHARD.value, replicated_apart) if e.kind else ""
        if kind not in names:
            names.append(kind)
        ids.append(names.index(kind))
    return names, np.array(ids, dtype=np.int64)


def packed_results(shape: ModelShape, layout: Layout, sent: list[SavePlan], answers: list[SavePlan]) -> WrittenFiles:
    """What every rank's ``CheckpointWriter`` reports (packed) for its final
    plan, and each data file's frame index, as the object path makes them
    (uncompressed, 1 MiB frames, one file per kind, ``bench.scale.plans``'
    fake checksums)."""
    first = sent[0].planner_data
    assert isinstance(first, CompactSavePlan)
    entries = first.key_entries()
    byte_lengths = _bytes_lengths(tuple(p.fqn for p in shape.params()))
    itemsize = np.array([e.dtype.itemsize if e.dtype is not None else 0 for e in entries], dtype=np.int64)
    is_bytes = np.array([e.kind == _BYTE_IO for e in entries])
    bytes_length = np.array([byte_lengths.get(e.fqn, 0) for e in entries], dtype=np.int64)
    ndims = np.array([e.ndim for e in entries], dtype=np.int64)
    dtypes = list(dict.fromkeys(e.dtype for e in entries if e.dtype is not None and e.kind != _BYTE_IO))
    dtype_ids = np.array([dtypes.index(e.dtype) if e.dtype is not None and e.kind != _BYTE_IO else -1 for e in entries],
                         dtype=np.int64)
    envelopes = _Envelopes()
    kinds: dict[bool, tuple[list[str], np.ndarray]] = {}
    results: list[list[WriteResult]] = []
    file_indexes: dict[str, bytes] = {}
    seed = frames_total = 0
    mask = np.uint64(0x7FFF_FFFF_FFFF_0000)
    golden = np.uint64(0x9E3779B97F4A7C15)
    for plan, answer in zip(sent, answers):
        compact = plan.planner_data
        assignment = answer.storage_data
        assert isinstance(compact, CompactSavePlan) and isinstance(assignment, FileAssignment)
        if compact.keys != first.keys:
            raise ValueError("packed_results needs ranks with identical key tables (FSDP / TP layouts)")
        rows = compact.row_array().astype(np.int64)
        keep = np.ones(len(rows), dtype=bool)
        keep[list(answer.planner_data.positions)] = False
        final = rows[keep]  # the final plan, in order
        entry = final[:, 0]
        dims = compact.dims
        sizes = final[:, 1 + dims :]
        nbytes = np.where(is_bytes[entry], bytes_length[entry], np.prod(sizes, axis=1) * itemsize[entry])
        # Envelopes differ by (dtype, chunk shape): a few dozen distinct ones per rank.
        shape_of = np.column_stack([dtype_ids[entry], ndims[entry], sizes])
        distinct, inverse = np.unique(shape_of, axis=0, return_inverse=True)
        pre_suf = np.array([
            (0, 0) if row[0] < 0 else envelopes.lengths(dtypes[row[0]], tuple(row[2 : 2 + row[1]].tolist()))
            for row in distinct
        ], dtype=np.int64).reshape(len(distinct), 2)[inverse.reshape(-1)]
        length = pre_suf[:, 0] + nbytes + pre_suf[:, 1]
        if assignment.replicated_apart not in kinds:
            kinds[assignment.replicated_apart] = _kind_table(entries, assignment.replicated_apart)
        kind_names, kind_ids = kinds[assignment.replicated_apart]
        names = dict(assignment.by_kind)
        item_kinds = kind_ids[entry]
        _, first_seen = np.unique(item_kinds, return_index=True)
        file_rows, refs = [], []
        for file_id, kind_id in enumerate(item_kinds[np.sort(first_seen)].tolist()):
            name = names[kind_names[kind_id]]
            members = np.flatnonzero(item_kinds == kind_id)
            lengths = length[members]
            at = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            data = nbytes[members]
            frames = -(-data // FRAME_SIZE)
            seeds = np.arange(seed + 1, seed + 1 + len(members), dtype=np.uint64)
            seed += len(members)
            with np.errstate(over="ignore"):
                bases = (golden * (seeds + np.uint64(1))) & mask
            total = int(frames.sum())
            starts = np.repeat(np.cumsum(frames) - frames, frames)
            sums = np.repeat(bases, frames) + (np.arange(total, dtype=np.uint64) - starts.astype(np.uint64))
            frames_total += total
            index = frame_index_of(len(members), sums.astype("<u8").tobytes())
            end = int(lengths.sum())
            file_indexes[name] = index
            refs.append((name, FrameIndexRef(end, len(index), xxhash.xxh3_64_intdigest(index))))
            block = np.empty((len(members), 9), dtype=np.int64)
            block[:, 0] = members
            block[:, 1] = file_id
            block[:, 2] = at
            block[:, 3] = lengths
            block[:, 4] = np.where(is_bytes[entry[members]], 0, pre_suf[members, 0])
            block[:, 5] = data
            block[:, 6] = -1
            block[:, 7] = 0
            block[:, 8] = FRAME_SIZE
            file_rows.append(block)
        table = np.concatenate(file_rows) if file_rows else np.empty((0, 9), dtype=np.int64)
        packed = RankWriteResults(files=tuple(refs), codecs=(), rows=zlib.compress(table.tobytes(), 1), count=len(table))
        results.append([WriteResult(index=RESULTS_INDEX, size_in_bytes=int(length.sum()), storage_data=packed)])
    return WrittenFiles(results, file_indexes, frames_total)
