"""The coordinator's global save planning, vectorized over every rank's items.

DCP's ``DefaultSavePlanner.create_global_plan`` does three things: it gives
every item that several ranks hold (replicated tensors, non-tensor values) to
the least loaded of them, builds the checkpoint's ``Metadata`` from all
items, and checks that each tensor's chunks stay inside it, do not overlap and
cover it. It works item by item on ``WriteItem`` objects, and its overlap
check sweeps each tensor along its *largest* dimension; an FSDP shard splits
dimension 0, which is often not the largest, so every chunk meets every other
and the check costs N² per tensor (with 1,024 ranks of a Llama-3-8B shape,
torch's planning takes minutes).

:func:`create_global_save_plan` works on the ranks' compact plans
(:mod:`dcp_ext.planning._plan_columns`) as integer arrays, in O(C log C) for C items
with the per-item work in numpy:

* **Deduplication** sorts the items by a hash of (key, offsets), checks the
  groups exactly, and gives each item held by several ranks to the holder
  with the fewest bytes so far (every rank's own items counted first; groups
  in order of first appearance; ties to the lowest rank), except items of at
  most :data:`SMALL_ITEM_BYTES` (scalars such as Adam's per-parameter
  ``step``, non-tensor values), which go to their lowest holder: spread over
  thousands of ranks, they made each loading rank fetch a few bytes (and a
  frame index) from some 170 files (405B on 8,192 ranks).
* **Validation** checks bounds and coverage (the chunks' volumes add up to
  the tensor's) for all keys at once, and overlaps by sorting each key's
  chunks along a dimension and comparing each start with the furthest end
  before it. A key whose chunks are not disjoint along any single dimension
  (a 2-D grid from FSDP x TP) goes through the exact sweep of
  :func:`validate_chunks`, which compares each chunk only with the chunks it
  meets along the dimension whose offsets differ most.
* **Metadata** holds each tensor's chunks as :class:`ChunkColumns` and, in
  ``storage_data``, :class:`ChunkWriters`: which rank's item each chunk is,
  for the writer's ``finish`` to match with the ranks' write results.

Called by the coordinator only (from :class:`dcp_ext.planners.LayoutSavePlanner`).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right, insort
from collections.abc import Sequence
from operator import add, itemgetter
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..errors import PlanMismatchError
from ..metadata.chunk_columns import ChunkColumns
from ._plan_columns import NO_ITEM, CompactSavePlan, KeyEntry, compact_plan

__all__ = ["ChunkWriters", "GlobalPlanError", "GlobalSavePlan", "SMALL_ITEM_BYTES", "create_global_save_plan", "validate_chunks"]

_MAX_REPORTED = 8
#: Items held by several ranks up to this size are written by the lowest rank
#: holding them; larger ones by the least loaded holder.
SMALL_ITEM_BYTES = 4096
_BYTE_IO = WriteItemType.BYTE_IO.value
_TENSOR = WriteItemType.TENSOR.value


class GlobalPlanError(PlanMismatchError):
    """The ranks' save plans do not describe a consistent checkpoint (two
    ranks disagree on a key's kind, dtype or shape, or its chunks overlap or
    leave gaps). Raised during planning: nothing was written."""


@dataclasses.dataclass(frozen=True)
class ChunkWriters:
    """Which rank's write item each stored chunk is (``Metadata.storage_data``
    between planning and the writer's ``finish``, which replaces it).

    Attributes:
        spans: Per key, in metadata order, its rows ``[start, stop)`` (one row
            per chunk, in the order of the key's ``ChunkColumns``; one row
            for a bytes value).
        ranks: Per row, the rank that writes it.
        positions: Per row, the item's position in that rank's final plan
            (its local plan less the items it leaves to others), as its
            writer reports it (:mod:`dcp_ext.planning._write_results`).
    """

    spans: dict[str, tuple[int, int]]
    ranks: np.ndarray
    positions: np.ndarray


@dataclasses.dataclass(frozen=True)
class GlobalSavePlan:
    """The coordinator's plan.

    Attributes:
        dropped: Per rank, the positions (in its local plan, ascending) of the
            items another rank writes instead.
        written_keys: Per rank, the keys it writes (ranks that write the same
            keys share one tuple), in plan order of first use.
        keys: Every key of the save with its kind, dtype and size.
        metadata: The checkpoint's metadata (see :class:`ChunkWriters`).
    """

    dropped: list[np.ndarray]
    written_keys: list[tuple[str, ...]]
    keys: list[KeyEntry]
    metadata: Metadata


def create_global_save_plan(plans: Sequence[SavePlan]) -> GlobalSavePlan:
    """(coordinator) Deduplicate, build the checkpoint's metadata, validate.

    Equivalent to DCP's default global save planning (with
    ``dedup_save_to_lowest_rank=False`` and ``flatten_state_dict=True``) in
    O(C log C) for C items, except that items are not copied to rewrite their
    index hints (DCP's loads compute their own).

    Args:
        plans: Every rank's local plan: a :class:`CompactSavePlan` in
            ``planner_data`` (as :class:`~dcp_ext.planners.LayoutSavePlanner`
            sends them), or DCP ``WriteItem`` lists.

    Raises:
        GlobalPlanError: Two ranks save different kinds of value under one key,
            or disagree on a tensor's shape or dtype, or the chunks of a tensor
            are out of bounds, overlap, or (with several ranks) do not cover
            it. Up to eight problems are named.
    """
    world = len(plans)
    try:
        compact = [p.planner_data if isinstance(p.planner_data, CompactSavePlan) else compact_plan(p) for p in plans]
    except ValueError as err:
        raise GlobalPlanError(f"a rank's save plan is malformed: {err}") from err
    keys, rank_ids = _key_table(compact)
    nkeys = len(keys)
    dims = max((p.dims for p in compact), default=0)
    counts = np.array([len(p) for p in compact], dtype=np.int64)
    starts = np.zeros(world + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    total = int(starts[-1])
    key_of = np.empty(total, dtype=np.int32)
    offsets = np.zeros((total, dims), dtype=np.int64)
    sizes = np.ones((total, dims), dtype=np.int64)
    for rank, (plan, ids) in enumerate(zip(compact, rank_ids)):
        a, b = int(starts[rank]), int(starts[rank + 1])
        if a == b:
            continue
        try:
            rows = plan.row_array()
        except ValueError as err:
            raise GlobalPlanError(f"rank {rank}'s save plan is malformed: {err}") from err
        entry_ids = rows[:, 0]
        if int(entry_ids.min()) < 0 or int(entry_ids.max()) >= len(ids):
            raise GlobalPlanError(f"rank {rank}'s save plan names a key its key table lacks")
        key_of[a:b] = ids[entry_ids]
        d = plan.dims
        offsets[a:b, :d] = rows[:, 1 : 1 + d]
        sizes[a:b, :d] = rows[:, 1 + d :]
    del compact, rank_ids
    rank_of = np.repeat(np.arange(world, dtype=np.int32), counts)

    kinds = np.array([k.kind for k in keys], dtype=np.int8)
    if total and bool((kinds[key_of] == NO_ITEM).any()):
        raise GlobalPlanError("a rank's save plan has items of a key it marks as having none")
    itemsize = np.array([k.dtype.itemsize if k.dtype is not None else 1 for k in keys], dtype=np.int64)
    nbytes = np.prod(sizes, axis=1) * itemsize[key_of] if dims else itemsize[key_of].copy()
    nbytes[(nbytes <= 0) | (kinds[key_of] == _BYTE_IO)] = 1

    dropped_mask = _dedup(key_of, offsets, rank_of, nbytes, world)
    del nbytes

    # Kept items grouped by key (stable: rank order within a key, as DCP's metadata lists them).
    kept = np.flatnonzero(~dropped_mask)
    key_dtype = np.int16 if nkeys <= np.iinfo(np.int16).max else np.int32  # int16 sorts by radix
    by_key = kept[np.argsort(key_of[kept].astype(key_dtype), kind="stable")]
    del kept
    k_sorted = key_of[by_key]
    chunk_offsets, chunk_sizes = offsets[by_key], sizes[by_key]
    writer_ranks = rank_of[by_key]
    # Each kept item's position in its rank's final plan (the local plan less what it leaves to others).
    kept_before = np.zeros(total + 1, dtype=np.int64)
    np.cumsum(~dropped_mask, out=kept_before[1:])
    writer_positions = (kept_before[by_key] - kept_before[starts[writer_ranks]]).astype(np.int32)
    del kept_before
    del offsets, sizes, by_key
    dropped = _per_rank(dropped_mask, starts)
    written_keys = _written_keys(key_of, dropped_mask, starts, keys)
    del key_of, rank_of, dropped_mask

    chunk_counts = np.bincount(k_sorted, minlength=nkeys)
    bounds = np.zeros(nkeys + 1, dtype=np.int64)
    np.cumsum(chunk_counts, out=bounds[1:])
    shapes = np.ones((nkeys, dims), dtype=np.int64)
    for g, entry in enumerate(keys):
        if entry.size is not None and entry.size:
            shapes[g, : len(entry.size)] = entry.size
    problems = _check(keys, k_sorted, chunk_offsets, chunk_sizes, chunk_counts, bounds, shapes, world)
    if problems:
        raise GlobalPlanError("the ranks' save plans are inconsistent: " + "; ".join(problems[:_MAX_REPORTED]))

    state: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    for g, entry in enumerate(keys):
        a, b = int(bounds[g]), int(bounds[g + 1])
        if a == b:
            continue
        spans[entry.fqn] = (a, b)
        if entry.kind == _BYTE_IO:
            state[entry.fqn] = BytesStorageMetadata()
            continue
        assert entry.size is not None and entry.dtype is not None
        n = entry.ndim
        state[entry.fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=entry.dtype, requires_grad=entry.requires_grad),
            size=torch.Size(entry.size),
            chunks=ChunkColumns(chunk_offsets[a:b, :n], chunk_sizes[a:b, :n]),  # type: ignore[arg-type]
        )
    mappings = {k.fqn: k.path for k in keys if k.path is not None}
    writers = ChunkWriters(spans, writer_ranks, writer_positions)
    metadata = Metadata(state_dict_metadata=state, planner_data=mappings, storage_data=writers)
    return GlobalSavePlan(dropped, written_keys, keys, metadata)


def _key_table(compact: Sequence[CompactSavePlan]) -> tuple[list[KeyEntry], list[np.ndarray]]:
    """The save's keys (first appearance in rank order) and, per rank, the
    global position of each entry of its key table (identical tables decoded once)."""
    keys: list[KeyEntry] = []
    position: dict[str, int] = {}
    decoded: dict[bytes, np.ndarray] = {}
    problems: list[str] = []
    rank_ids = []
    for rank, plan in enumerate(compact):
        ids = decoded.get(plan.keys)
        if ids is None:
            try:
                entries = plan.key_entries()
            except ValueError as err:
                raise GlobalPlanError(f"rank {rank}'s save plan is malformed: {err}") from err
            ids = np.empty(len(entries), dtype=np.int64)
            for j, entry in enumerate(entries):
                g = position.get(entry.fqn)
                if g is None:
                    g = position[entry.fqn] = len(keys)
                    keys.append(entry)
                else:
                    known = keys[g]
                    if known.kind == NO_ITEM:
                        keys[g] = entry if entry.path is not None else dataclasses.replace(entry, path=known.path)
                    elif entry.kind != NO_ITEM:
                        problem = _disagreement(known, entry)
                        if problem:
                            problems.append(problem)
                    if keys[g].path is None and entry.path is not None:
                        keys[g] = dataclasses.replace(keys[g], path=entry.path)
                ids[j] = g
            decoded[plan.keys] = ids
        rank_ids.append(ids)
        if len(problems) >= _MAX_REPORTED:
            break
    if problems:
        raise GlobalPlanError("the ranks' save plans are inconsistent: " + "; ".join(problems[:_MAX_REPORTED]))
    return keys, rank_ids


def _disagreement(known: KeyEntry, entry: KeyEntry) -> str:
    if (known.kind == _BYTE_IO) != (entry.kind == _BYTE_IO):
        return f"key {known.fqn!r} is saved twice by different ranks"
    if known.size != entry.size or known.dtype != entry.dtype:
        return (
            f"key {known.fqn!r}: ranks disagree on the tensor ({list(known.size or ())} "
            f"{known.dtype} vs {list(entry.size or ())} {entry.dtype})"
        )
    return ""


def _hash(key_of: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = key_of.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for d in range(offsets.shape[1]):
            h ^= offsets[:, d].astype(np.uint64)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    return h


def _dedup(key_of: np.ndarray, offsets: np.ndarray, rank_of: np.ndarray, nbytes: np.ndarray, world: int) -> np.ndarray:
    """Which items are left to another holder (a mask over all items)."""
    total = len(key_of)
    dropped = np.zeros(total, dtype=bool)
    if total == 0:
        return dropped
    code = _packed_rows(key_of, offsets)
    if code is not None:
        # (key, offsets) packed into one int64 each: equal codes are equal rows.
        order = np.argsort(code, kind="stable")
        sorted_code = code[order]
        del code
        starts_group = np.ones(total, dtype=bool)
        starts_group[1:] = sorted_code[1:] != sorted_code[:-1]
        del sorted_code
    else:
        hashes = _hash(key_of, offsets)
        order = np.argsort(hashes, kind="stable")
        starts_group = _run_starts(key_of, offsets, order)
        # Equal rows are adjacent unless a different row with the same hash lies
        # between them; then sort exactly (never seen in practice, never wrong).
        sorted_hashes = hashes[order]
        del hashes
        if bool((starts_group[1:] & (sorted_hashes[1:] == sorted_hashes[:-1])).any()):
            order = np.lexsort((*(offsets[:, d] for d in reversed(range(offsets.shape[1]))), key_of))
            starts_group = _run_starts(key_of, offsets, order)
        del sorted_hashes
    groups = np.flatnonzero(starts_group)
    order_first = order[groups]  # both sorts are stable: the first holder in rank order
    ends = np.append(groups[1:], total)
    shared = np.flatnonzero(ends - groups > 1)
    if len(shared) == 0:
        return dropped
    shared_mask = np.zeros(total, dtype=bool)
    for g in shared:
        shared_mask[order[groups[g] : ends[g]]] = True
    loads = np.bincount(rank_of[~shared_mask], weights=nbytes[~shared_mask], minlength=world)
    for g in shared[np.argsort(order_first[shared], kind="stable")].tolist():
        members = order[groups[g] : ends[g]]  # ascending: the stable sorts keep rank-major item order
        dropped[members] = True
        if nbytes[members[0]] <= SMALL_ITEM_BYTES:
            # A small value goes to its lowest holder: spread over the ranks,
            # Adam's per-parameter `step` scalars would make every loading
            # rank read a few bytes from hundreds of files.
            dropped[members[0]] = False
            continue
        ranks = rank_of[members]
        distinct = np.ones(len(members), dtype=bool)  # a rank holding an item twice counts once
        distinct[1:] = ranks[1:] != ranks[:-1]
        candidates = members[distinct]
        chosen = candidates[int(np.argmin(loads[rank_of[candidates]]))]  # ties: the lowest rank
        loads[rank_of[chosen]] += nbytes[chosen]
        dropped[chosen] = False
    return dropped


def _packed_rows(key_of: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """Each row's (key, offsets) as one int64, bit fields wide enough for the
    largest value of each column; ``None`` if they need more than 63 bits
    (or an offset is negative: such a plan fails validation later anyway)."""
    if len(key_of) == 0 or (offsets.size and int(offsets.min()) < 0):
        return None
    widths = [int(key_of.max()).bit_length()] + [int(offsets[:, d].max()).bit_length() for d in range(offsets.shape[1])]
    if sum(widths) > 63:
        return None
    code = key_of.astype(np.int64)
    for d, width in enumerate(widths[1:]):
        code <<= width
        code |= offsets[:, d]
    return code


def _run_starts(key_of: np.ndarray, offsets: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Where, in ``order``, a run of equal (key, offsets) rows starts."""
    k, o = key_of[order], offsets[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (k[1:] != k[:-1]) | (o[1:] != o[:-1]).any(axis=1)
    return starts


def _per_rank(mask: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    hits = np.flatnonzero(mask)
    cuts = np.searchsorted(hits, starts)
    return [hits[cuts[r] : cuts[r + 1]] - starts[r] for r in range(len(starts) - 1)]


def _written_keys(key_of: np.ndarray, dropped: np.ndarray, starts: np.ndarray, keys: list[KeyEntry]) -> list[tuple[str, ...]]:
    shared: dict[bytes, tuple[str, ...]] = {}
    out = []
    for r in range(len(starts) - 1):
        a, b = int(starts[r]), int(starts[r + 1])
        ids = key_of[a:b][~dropped[a:b]]
        ids, first = np.unique(ids, return_index=True)
        ids = ids[np.argsort(first, kind="stable")]
        blob = ids.tobytes()
        names = shared.get(blob)
        if names is None:
            names = shared[blob] = tuple(keys[int(g)].fqn for g in ids)
        out.append(names)
    return out


def _check(
    keys: list[KeyEntry],
    k_sorted: np.ndarray,
    offsets: np.ndarray,
    sizes: np.ndarray,
    counts: np.ndarray,
    bounds: np.ndarray,
    shapes: np.ndarray,
    world: int,
) -> list[str]:
    """Problems with the kept chunks: values saved twice, chunks out of
    bounds, overlapping, or (with several ranks) not covering their tensor."""
    problems: list[str] = []
    kinds = np.array([k.kind for k in keys], dtype=np.int8)
    for g in np.flatnonzero((counts > 1) & ((kinds == _BYTE_IO) | (kinds == _TENSOR))):
        problems.append(f"key {keys[int(g)].fqn!r} is saved twice by different ranks")
        if len(problems) >= _MAX_REPORTED:
            return problems
    if not len(k_sorted) or not offsets.shape[1]:
        return problems
    limit = shapes[k_sorted]
    outside = (offsets < 0).any(axis=1) | (sizes < 0).any(axis=1) | (offsets + sizes > limit).any(axis=1)
    del limit
    bad_keys = np.unique(k_sorted[outside])
    for i in np.flatnonzero(outside)[:_MAX_REPORTED]:
        entry = keys[int(k_sorted[i])]
        n = entry.ndim
        chunk = ChunkStorageMetadata(torch.Size(offsets[i, :n].tolist()), torch.Size(sizes[i, :n].tolist()))
        problems.append(f"key {entry.fqn!r}: chunk {_box(chunk)} lies outside the tensor's size {list(entry.size or ())}")
    if len(problems) >= _MAX_REPORTED:
        return problems
    usable = ~np.isin(k_sorted, bad_keys)
    # Overlaps: along dimension 0 for every key at once, then other dimensions
    # for the keys that failed, then the exact sweep for what remains.
    nonempty = usable & (sizes > 0).all(axis=1)
    suspects = np.flatnonzero(nonempty)
    failing: np.ndarray = np.empty(0, dtype=k_sorted.dtype)
    big = int(shapes.max()) + 1
    for d in range(offsets.shape[1]):
        failing = _overlapping_keys(k_sorted[suspects], offsets[suspects, d], sizes[suspects, d], big)
        if not len(failing):
            break
        suspects = suspects[np.isin(k_sorted[suspects], failing)]
    for g in failing.tolist():
        entry = keys[g]
        a, b = int(bounds[g]), int(bounds[g + 1])
        n = entry.ndim
        md = TensorStorageMetadata(
            TensorProperties(dtype=entry.dtype or torch.float32), torch.Size(entry.size or ()),
            list(ChunkColumns(offsets[a:b, :n], sizes[a:b, :n])),
        )
        problems.extend(p for p in validate_chunks(entry.fqn, md, 1) if "overlap" in p)
        if len(problems) >= _MAX_REPORTED:
            return problems
    if world > 1:
        volumes = np.prod(sizes, axis=1)
        present = np.flatnonzero(counts > 0)
        sums = np.add.reduceat(volumes, bounds[present]) if len(present) else np.empty(0, dtype=np.int64)
        expected = np.prod(shapes[present], axis=1)
        tensor = (kinds[present] != _BYTE_IO) & ~np.isin(present, bad_keys)
        for g, got, want in zip(present[tensor & (sums != expected)].tolist(), sums[tensor & (sums != expected)].tolist(),
                                expected[tensor & (sums != expected)].tolist()):
            entry = keys[g]
            problems.append(
                f"key {entry.fqn!r}: the ranks' chunks hold {got} elements of the tensor's "
                f"{want} (size {list(entry.size or ())}); some part is saved by no rank or by several"
            )
            if len(problems) >= _MAX_REPORTED:
                break
    return problems


def _overlapping_keys(k: np.ndarray, start: np.ndarray, length: np.ndarray, big: int) -> np.ndarray:
    """Keys whose chunks (non-empty) are not disjoint along this dimension."""
    if len(k) < 2:
        return np.empty(0, dtype=k.dtype)
    base = k.astype(np.int64) * big
    at = start + base
    if not bool((at[1:] >= at[:-1]).all()):
        order = np.argsort(at, kind="stable")
        at, base, k, length = at[order], base[order], k[order], length[order]
    furthest = np.maximum.accumulate(at + length)
    clash = at[1:] < furthest[:-1]
    return np.unique(k[1:][clash])


def validate_chunks(fqn: str, md: TensorStorageMetadata, world: int) -> list[str]:
    """Problems with one tensor's chunks: out of bounds, overlapping, not covering it.

    Sweeps along the dimension whose chunk offsets take the most distinct
    values, keeping the chunks whose extent along it is still open: each chunk
    is compared only with the chunks it meets along that dimension.

    Args:
        fqn: The tensor's key, for messages.
        md: Its metadata (size and chunks).
        world: Ranks that saved; a single rank's checkpoint may cover a tensor
            partly, as DCP allows.
    """
    size = tuple(md.size)
    if not size:
        return []
    problems: list[str] = []
    chunks = md.chunks
    ndim = len(size)
    offs = [c.offsets for c in chunks]
    sizes = [c.sizes for c in chunks]
    inside = all(len(o) == ndim for o in offs) and all(len(z) == ndim for z in sizes)
    for d in range(ndim):
        if not inside:
            break
        at, extent = list(map(itemgetter(d), offs)), list(map(itemgetter(d), sizes))
        inside = min(at) >= 0 and min(extent) >= 0 and max(map(add, at, extent)) <= size[d]
    if not inside:
        for chunk in chunks:
            o, z = chunk.offsets, chunk.sizes
            if len(o) != ndim or len(z) != ndim or any(a < 0 or b < 0 or a + b > n for a, b, n in zip(o, z, size)):
                problems.append(f"key {fqn!r}: chunk {_box(chunk)} lies outside the tensor's size {list(size)}")
                if len(problems) >= _MAX_REPORTED:
                    break
        return problems
    volume = sum(map(math.prod, sizes))
    if len(chunks) > 1:
        sweep = max(range(ndim), key=lambda d: (len(set(map(itemgetter(d), offs))), -d))
        open_ends: list[tuple[int, int]] = []  # (end along the sweep, chunk position), sorted
        furthest = -1
        for start, i in sorted(zip(map(itemgetter(sweep), offs), range(len(chunks)))):
            if start >= furthest:
                open_ends.clear()  # every earlier chunk ends before this one starts
            else:
                del open_ends[: bisect_right(open_ends, (start, len(chunks)))]
                for _, j in open_ends:
                    if _overlap(chunks[i], chunks[j]):
                        problems.append(f"key {fqn!r}: chunks {_box(chunks[i])} and {_box(chunks[j])} overlap")
                        if len(problems) >= _MAX_REPORTED:
                            return problems
            length = sizes[i][sweep]
            if length > 0:
                insort(open_ends, (start + length, i))
                furthest = max(furthest, start + length)
    if world > 1 and volume != math.prod(size):
        problems.append(
            f"key {fqn!r}: the ranks' chunks hold {volume} elements of the tensor's "
            f"{math.prod(size)} (size {list(size)}); some part is saved by no rank or by several"
        )
    return problems


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        oa < ob + sb and ob < oa + sa and sa > 0 and sb > 0
        for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def _box(chunk: ChunkStorageMetadata) -> str:
    return f"(offsets {list(chunk.offsets)}, sizes {list(chunk.sizes)})"
