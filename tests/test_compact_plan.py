"""Compact save plans, vectorized global planning and packed write results
(issue 16): the tables that replace per-item objects on the coordinator."""

from __future__ import annotations

import dataclasses
import math
import pickle
import zlib

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcp_ext.planning._plan_columns import compact_plan
from dcp_ext.planning._global_plan import ChunkWriters, GlobalPlanError, create_global_save_plan
from dcp_ext.metadata import decode_metadata, encode_metadata
from dcp_ext.metadata.chunk_columns import ChunkColumns
from dcp_ext.metadata.document import FrameIndexRef, StoredItem
from dcp_ext.metadata.torch_pickle import load_torch_metadata, to_torch_metadata
from dcp_ext.metadata.stored_columns import StoredColumns
from dcp_ext.planning._write_results import RankWriteResults, collect_stored, pack_results


def _item(fqn: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...],
          kind: WriteItemType = WriteItemType.SHARD, dtype: torch.dtype = torch.float32) -> WriteItem:
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(MetadataIndex(fqn, chunk.offsets), kind,
                     tensor_data=TensorWriteData(chunk, TensorProperties(dtype=dtype), torch.Size(shape)))


def _plans(world: int) -> list[SavePlan]:
    """Row shards (the last rank's empty when 10 rows do not split evenly), a
    3-D tensor split on dim 1, a TP x FSDP grid, a scalar every rank holds,
    and a bytes value every rank holds."""
    plans = []
    rows = -(-10 // world)
    for r in range(world):
        start = min(r * rows, 10)
        take = max(0, min(rows, 10 - start))
        items = [
            _item("model.w", (10, 3), (start if take else 10, 0), (take, 3), dtype=torch.bfloat16),
            _item("model.cube", (2, 4 * world, 3), (0, 4 * r, 0), (2, 4, 3)),
            _item("model.grid", (8, 4 * world), (4 * (r % 2), 8 * (r // 2)), (4, 8)),
            _item("optim.step", (), (), (), WriteItemType.TENSOR),
            WriteItem(MetadataIndex("optim.lr"), WriteItemType.BYTE_IO),
        ]
        mapping = {i.index.fqn: tuple(i.index.fqn.split(".")) for i in items} | {"optim.groups.0": ("optim", "groups", 0)}
        plans.append(SavePlan(items, planner_data=mapping))
    return plans


def test_compact_plan_round_trip_and_size() -> None:
    plan = _plans(4)[3]
    compact = compact_plan(plan)
    assert compact.write_items() == plan.items
    assert len(compact) == 5 and compact.dims == 3
    entries = {e.fqn: e for e in compact.key_entries()}
    assert entries["optim.groups.0"].path == ("optim", "groups", 0) and entries["optim.groups.0"].kind == 0
    assert entries["model.w"].dtype == torch.bfloat16 and entries["model.w"].size == (10, 3)
    assert pickle.loads(pickle.dumps(compact)) == compact
    # Identical key tables across ranks (FSDP): the coordinator decodes one.
    assert len({compact_plan(p).keys for p in _plans(4)}) == 1
    bad = SavePlan([_item("k", (4,), (0,), (2,)), _item("k", (5,), (2,), (2,))])
    with pytest.raises(ValueError, match="'k' disagrees"):
        compact_plan(bad)
    with pytest.raises(ValueError, match="corrupt"):
        dataclasses.replace(compact, rows=b"junk").row_array()
    with pytest.raises(ValueError, match="not 6 rows"):
        dataclasses.replace(compact, count=6).row_array()


def test_vectorized_global_plan_equals_torch_and_writes_each_value_once() -> None:
    world = 8
    planned = create_global_save_plan([SavePlan([], planner_data=compact_plan(p)) for p in _plans(world)])
    same = create_global_save_plan(_plans(world))  # DCP WriteItem lists give the same plan
    assert [d.tolist() for d in planned.dropped] == [d.tolist() for d in same.dropped]
    _, theirs = DefaultSavePlanner(dedup_save_to_lowest_rank=False).create_global_plan(_plans(world))
    mine = planned.metadata
    assert mine.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for fqn, md in mine.state_dict_metadata.items():
        other = theirs.state_dict_metadata[fqn]
        if isinstance(md, BytesStorageMetadata):
            assert isinstance(other, BytesStorageMetadata)
            continue
        assert isinstance(md.chunks, ChunkColumns)
        assert (md.size, md.properties.dtype) == (other.size, other.properties.dtype)
        assert sorted(map(str, md.chunks)) == sorted(map(str, other.chunks)), fqn
    assert mine.planner_data["optim.groups.0"] == ("optim", "groups", 0)
    # The empty row shards (ranks 5-7 hold [10, 0] x 0 rows), the scalar and
    # the bytes value are each written by exactly one holder, spread out.
    plans = _plans(world)
    writers: dict[str, list[int]] = {}
    for r, dropped in enumerate(planned.dropped):
        left = {plans[r].items[p].index.fqn for p in dropped.tolist()}
        for item in plans[r].items:
            if item.index.fqn not in left:
                writers.setdefault(item.index.fqn, []).append(r)
    assert len(writers["optim.step"]) == 1 and len(writers["optim.lr"]) == 1
    assert writers["optim.step"] == writers["optim.lr"] == [0]  # small values: the lowest holder
    assert writers["model.w"] == [0, 1, 2, 3, 4] + writers["model.w"][5:] and len(writers["model.w"]) == 6
    assert all(k in planned.written_keys[r] for r in range(world) for k in ("model.cube", "model.grid"))
    # ChunkWriters: each chunk's rank and position in that rank's final plan.
    cw = mine.storage_data
    assert isinstance(cw, ChunkWriters)
    a, b = cw.spans["model.cube"]
    assert cw.ranks[a:b].tolist() == list(range(world))
    assert cw.positions[a:b].tolist() == [1 if r in writers["model.w"] else 0 for r in range(world)]


def test_large_replicated_values_go_to_the_least_loaded_holder() -> None:
    # Every rank holds two 8 KiB replicated tensors and a row shard; ranks 2
    # and 3 hold empty shards, so they are the least loaded.
    plans = []
    for r in range(4):
        rows = 2 if r < 2 else 0
        plans.append(SavePlan([
            _item("model.w", (4, 1024), (2 * r if rows else 4, 0), (rows, 1024)),
            _item("model.a", (2048,), (0,), (2048,), WriteItemType.TENSOR),
            _item("model.b", (2048,), (0,), (2048,), WriteItemType.TENSOR),
            _item("model.tiny", (8,), (0,), (8,), WriteItemType.TENSOR),
        ]))
    planned = create_global_save_plan(plans)
    writer = {fqn: [r for r in range(4) if plans[r].items[k].index.fqn == fqn and k not in planned.dropped[r].tolist()]
              for k, fqn in enumerate(("model.w", "model.a", "model.b", "model.tiny"))}
    assert sorted([writer["model.a"][0], writer["model.b"][0]]) == [2, 3]  # spread over the idle ranks
    assert writer["model.tiny"] == [0]


@pytest.mark.parametrize("change,match", [
    (lambda p: p[1].items.__setitem__(0, _item("model.w", (10, 3), (1, 0), (4, 3), dtype=torch.bfloat16)), "model.w.*overlap"),
    (lambda p: p[1].items.__setitem__(1, _item("model.cube", (2, 8, 3), (0, 5, 0), (2, 3, 3))), "model.cube.*saved by no rank"),
    (lambda p: p[1].items.__setitem__(1, _item("model.cube", (2, 8, 3), (0, 6, 0), (2, 4, 3))), "model.cube.*outside the tensor"),
    (lambda p: p[1].items.__setitem__(2, _item("model.grid", (8, 8), (2, 0), (4, 8))), "model.grid.*overlap"),
    (lambda p: p[1].items.__setitem__(0, _item("model.w", (11, 3), (5, 0), (5, 3), dtype=torch.bfloat16)), "model.w.*disagree"),
    (lambda p: p[1].items.__setitem__(4, _item("optim.lr", (1,), (0,), (1,))), "optim.lr.*saved twice"),
])
def test_bad_plans_are_refused_naming_the_key(change, match) -> None:  # type: ignore[no-untyped-def]
    plans = _plans(2)
    change(plans)
    with pytest.raises(GlobalPlanError, match=match):
        create_global_save_plan([SavePlan([], planner_data=compact_plan(p)) for p in plans])


def test_malformed_compact_plan_is_refused() -> None:
    good = compact_plan(_plans(2)[0])
    rows = good.row_array().copy()
    rows[0, 0] = 99
    broken = dataclasses.replace(good, rows=zlib.compress(rows.tobytes()))
    with pytest.raises(GlobalPlanError, match="rank 1's save plan names a key its key table lacks"):
        create_global_save_plan([SavePlan([], planner_data=good), SavePlan([], planner_data=broken)])
    with pytest.raises(GlobalPlanError, match="rank 0's save plan is malformed"):
        create_global_save_plan([SavePlan([], planner_data=dataclasses.replace(good, keys=b"x"))])


def _written(plans: list[SavePlan], dropped: list[np.ndarray]) -> tuple[list[list], dict[MetadataIndex, StoredItem]]:
    """What each rank's writer reports for its final plan: packed, and as one item per result."""
    packed, items = [], {}
    for r, (plan, left) in enumerate(zip(plans, dropped)):
        skip = set(left.tolist())
        final = [item for k, item in enumerate(plan.items) if k not in skip]
        name, at, stored = f"model_rank{r}.distcp", 0, []
        for item in final:
            data = item.tensor_data  # the chunk's bytes: the commit checks them against the metadata
            n = 40 + (math.prod(data.chunk.sizes) * data.properties.dtype.itemsize if data is not None else 7)
            stored.append(StoredItem(name, at, n, 30, n - 40, frame_size=1 << 20, indexed=True,
                                     frame_index=FrameIndexRef(10_000, 64, r)))
            at += n
        # Files written in any order: the rows say each item's place in the final plan.
        order = list(reversed(range(len(final))))
        packed.append(pack_results(order, [stored[k] for k in order]))
        items.update({item.index: where for item, where in zip(final, stored)})
    return packed, items


def test_packed_write_results_encode_like_one_result_per_item() -> None:
    plans = _plans(4)
    planned = create_global_save_plan(plans)
    packed, items = _written(plans, planned.dropped)
    metadata = planned.metadata
    stored = collect_stored(metadata, packed)
    assert isinstance(stored, StoredColumns) and len(stored) == len(items)
    assert dict(stored.items()) == items and list(stored.values()) == [items[k] for k in stored]
    assert all(stored[index] == item for index, item in items.items())
    assert pickle.loads(pickle.dumps(stored))[MetadataIndex("optim.lr")] == items[MetadataIndex("optim.lr")]
    with pytest.raises(KeyError):
        stored[MetadataIndex("model.w", [1, 0])]
    # What dcp.save broadcasts: the metadata with its columns, compressed, unpacked when used.
    writers, metadata.storage_data = metadata.storage_data, stored
    back = pickle.loads(pickle.dumps(metadata))
    assert back.state_dict_metadata == metadata.state_dict_metadata and dict(back.storage_data.items()) == items
    # The document from the columns decodes exactly as from one result per item.
    from_columns = decode_metadata(encode_metadata(metadata, stored, world_size=4, version=3), "a")
    from_items = decode_metadata(encode_metadata(metadata, items, world_size=4, version=3), "b")
    assert from_columns.metadata.state_dict_metadata == from_items.metadata.state_dict_metadata
    assert dict(from_columns.metadata.storage_data) == dict(from_items.metadata.storage_data)
    assert from_columns.frame_indexes == from_items.frame_indexes
    # Torch's interop pickle holds DCP's own classes only (torch's readers cannot import ours).
    torch_md = load_torch_metadata(to_torch_metadata(metadata, stored), "t")
    assert all(type(md.chunks) is list for md in torch_md.state_dict_metadata.values() if hasattr(md, "chunks"))
    # A rank that lost an item, or numbered its items wrongly, is named.
    metadata.storage_data = writers
    short = list(packed)
    part = short[2][0].storage_data
    rows = part.row_array()[1:]
    short[2] = [dataclasses.replace(short[2][0], storage_data=RankWriteResults(
        part.files, part.codecs, zlib.compress(rows.tobytes()), len(rows)))]
    with pytest.raises(ValueError, match="rank 2's write results do not number its items|rank 2 reported no write result"):
        collect_stored(metadata, short)


def test_offsets_too_wide_to_pack_take_the_hashed_dedup() -> None:
    """(key, offsets) that do not fit one int64 are grouped by hash, with an exact check."""
    huge = 1 << 61
    plans = [
        SavePlan([
            _item("model.huge", (2 * huge,), (r * huge,), (huge,)),
            _item("model.shared", (2 * huge,), (0,), (8,), WriteItemType.TENSOR),
            _item("model.tiny", (8,), (0,), (8,), WriteItemType.TENSOR),
        ])
        for r in range(2)
    ]
    plans[0].items[1] = _item("model.shared", (8,), (0,), (8,), WriteItemType.TENSOR)
    plans[1].items[1] = _item("model.shared", (8,), (0,), (8,), WriteItemType.TENSOR)
    planned = create_global_save_plan(plans)
    assert [d.tolist() for d in planned.dropped] == [[], [1, 2]]  # rank 1 leaves both shared values to rank 0
    assert [tuple(c.offsets) for c in planned.metadata.state_dict_metadata["model.huge"].chunks] == [(0,), (huge,)]
