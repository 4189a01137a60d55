"""Load planning on chunk columns (dcp_ext.planning._tensor_reads) and version-3 decode into columns.

The vectorized planner must give exactly torch's ``ReadItem`` objects (fields,
index hints and order) for any layout; decode must give each tensor's chunks
as ``ChunkColumns`` equal to what was encoded, and still refuse a chunk
outside its tensor by name.
"""

from __future__ import annotations

import base64
import json
import random
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dcp_ext import LayoutLoadPlanner
from dcp_ext.errors import CheckpointCorruptError, ReshardError
from dcp_ext.metadata import StoredItem, decode_metadata, encode_metadata
from dcp_ext.metadata.chunk_columns import ChunkColumns
from dcp_ext.metadata.chunk_table import ChunkLocations
from dcp_ext.metadata.document import FrameIndexRef
from dcp_ext.planning._tensor_reads import ChunkShapes, match_chunk, read_items_for_columns

from .support.metadata_edit import sign

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))


def _cuts(n: int, pieces: int, rng: random.Random, uneven: bool) -> list[tuple[int, int]]:
    """``(start, size)`` of ``pieces`` consecutive pieces of ``[0, n)``: equal
    (the last one short, as torch.chunk), or at random cuts (some empty)."""
    if uneven:
        cuts = sorted(rng.randint(0, n) for _ in range(pieces - 1))
    else:
        step = -(-n // pieces) if n else 0
        cuts = [min(n, step * k) for k in range(1, pieces)]
    bounds = [0, *cuts, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _grid(shape: tuple[int, ...], dims: list[int], rng: random.Random, uneven: bool) -> list[Box]:
    """Boxes splitting ``shape`` along ``dims`` (the other dimensions whole)."""
    per_dim = [
        _cuts(n, rng.randint(1, 6), rng, uneven) if d in dims else [(0, n)] for d, n in enumerate(shape)
    ]
    boxes: list[Box] = [((), ())]
    for pieces in per_dim:
        boxes = [(o + (a,), s + (b,)) for o, s in boxes for a, b in pieces]
    return boxes


def _random_box(shape: tuple[int, ...], rng: random.Random) -> Box:
    offsets, sizes = [], []
    for n in shape:
        a = rng.randint(0, n)
        offsets.append(a)
        sizes.append(rng.randint(0, n - a))
    return tuple(offsets), tuple(sizes)


def _layout(rng: random.Random) -> tuple[tuple[int, ...], list[Box], list[Box]]:
    """A tensor shape, its saved chunks (in a random order) and a rank's local chunks."""
    ndim = rng.choice([0, 1, 1, 2, 2, 3])
    shape = tuple(rng.choice([0, 1, rng.randint(2, 40)]) if rng.random() < 0.1 else rng.randint(1, 40)
                  for _ in range(ndim))
    if ndim == 0:
        return shape, [((), ())] * rng.randint(1, 2), [((), ())] * rng.randint(1, 2)
    split = rng.sample(range(ndim), min(ndim, rng.choice([1, 2])))
    saved = _grid(shape, split, rng, uneven=rng.random() < 0.5)
    if rng.random() < 0.2:  # extra empty chunks anywhere
        saved += [(_random_box(shape, rng)[0], tuple(0 for _ in shape)) for _ in range(rng.randint(1, 3))]
    rng.shuffle(saved)
    kind = rng.choice(["grid", "box", "saved", "whole"])
    if kind == "grid":  # another partition: the rank holds one to three of its cells
        cells = _grid(shape, rng.sample(range(ndim), min(ndim, rng.choice([1, 2]))), rng, rng.random() < 0.5)
        local = rng.sample(cells, min(len(cells), rng.randint(1, 3)))
    elif kind == "box":
        local = [_random_box(shape, rng) for _ in range(rng.randint(1, 3))]
    elif kind == "saved":
        local = [rng.choice(saved)]
    else:
        local = [(tuple(0 for _ in shape), shape)]
    return shape, saved, local


def _fields(item: ReadItem) -> tuple[Any, ...]:
    for size in (item.dest_offsets, item.storage_offsets, item.lengths):
        assert type(size) is torch.Size
    return (
        item.type,
        item.dest_index.fqn, tuple(item.dest_index.offset), item.dest_index.index, tuple(item.dest_offsets),
        item.storage_index.fqn, tuple(item.storage_index.offset), item.storage_index.index,
        tuple(item.storage_offsets), tuple(item.lengths),
    )


def _md(shape: tuple[int, ...], chunks: Any) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), chunks)


@pytest.mark.parametrize("seed", range(8))
def test_read_items_equal_torchs_on_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    cases = items_seen = 0
    for _ in range(150):
        shape, saved, local = _layout(rng)
        saved_chunks = [_chunk(*b) for b in saved]
        local_chunks = [_chunk(*b) for b in local]
        expected = create_read_items_for_chunk_list("k", _md(shape, saved_chunks), local_chunks)
        columns = ChunkColumns.of(saved_chunks, len(shape))
        got = read_items_for_columns("k", columns, local_chunks)
        assert [_fields(i) for i in got] == [_fields(i) for i in expected], (shape, saved, local)
        assert got == expected
        cases += 1
        items_seen += len(expected)
    assert items_seen > cases  # the layouts do straddle saved chunks


def test_read_items_named_cases() -> None:
    # A local shard straddling three saved row blocks of a 2-D tensor, listed out of order.
    saved = [_chunk((8, 0), (4, 6)), _chunk((0, 0), (4, 6)), _chunk((4, 0), (4, 6))]
    local = [_chunk((2, 1), (8, 4))]
    got = read_items_for_columns("w", ChunkColumns.of(saved, 2), local)
    assert [(i.storage_index.index, tuple(i.storage_offsets), tuple(i.dest_offsets), tuple(i.lengths))
            for i in got] == [(1, (2, 1), (0, 0), (2, 4)), (2, (0, 1), (2, 0), (4, 4)), (0, (0, 1), (6, 0), (2, 4))]
    assert got == create_read_items_for_chunk_list("w", _md((12, 6), saved), local)
    # A local shard equal to a saved chunk: one whole-chunk read.
    (one,) = read_items_for_columns("w", ChunkColumns.of(saved, 2), [saved[2]])
    assert (one.storage_index.index, tuple(one.lengths), tuple(one.storage_offsets)) == (2, (4, 6), (0, 0))
    # Scalars; no saved chunks; no local chunks.
    scalar = [_chunk((), ())]
    assert read_items_for_columns("s", ChunkColumns.of(scalar, 0), scalar) == create_read_items_for_chunk_list(
        "s", _md((), scalar), scalar)
    assert read_items_for_columns("w", ChunkColumns.of([], 2), local) == []
    assert read_items_for_columns("w", ChunkColumns.of(saved, 2), []) == []
    with pytest.raises(ValueError, match="dimensions"):
        read_items_for_columns("w", ChunkColumns.of(saved, 2), [_chunk((0,), (3,))])


def test_match_chunk_on_columns_and_lists() -> None:
    saved = [_chunk((4,), (0,)), _chunk((0,), (4,)), _chunk((4,), (4,))]
    for chunks in (saved, ChunkColumns.of(saved, 1)):
        assert match_chunk(chunks, (4,), (4,)) == 2
        assert match_chunk(chunks, (4,), (0,)) == 0
        assert match_chunk(chunks, (0,), (3,)) is None
        assert match_chunk(chunks, (0, 0), (4, 4)) is None
    assert match_chunk(ChunkColumns.of([_chunk((), ())], 0), (), ()) == 0


# -- the planner on columns ---------------------------------------------------------------


def _metadata(tensors: dict[str, tuple[tuple[int, ...], list[Box]]], columns: bool) -> Metadata:
    state: dict[str, Any] = {}
    for fqn, (shape, boxes) in tensors.items():
        chunks = [_chunk(*b) for b in boxes]
        state[fqn] = _md(shape, ChunkColumns.of(chunks, len(shape)) if columns else chunks)
    return Metadata(state_dict_metadata=state)


def test_layout_load_planner_on_columns_plans_as_torch() -> None:
    """Whole (non-distributed) tensors loaded from row- and column-split saves:
    LayoutLoadPlanner on columns plans DefaultLoadPlanner's reads on lists."""
    tensors = {
        "a": ((10, 6), [((0, 0), (4, 6)), ((4, 0), (4, 6)), ((8, 0), (2, 6))]),
        "b": ((7,), [((3,), (4,)), ((0,), (3,)), ((7,), (0,))]),
        "c": ((4, 4, 2), [((0, 0, 0), (4, 2, 2)), ((0, 2, 0), (4, 2, 2))]),
        "s": ((), [((), ())]),
    }
    state = {fqn: torch.zeros(shape) for fqn, (shape, _) in tensors.items()}
    ours = LayoutLoadPlanner()
    ours.set_up_planner(state, _metadata(tensors, columns=True), True)
    theirs = DefaultLoadPlanner()
    theirs.set_up_planner(dict(state), _metadata(tensors, columns=False), True)
    got, expected = ours.create_local_plan().items, theirs.create_local_plan().items
    assert [_fields(i) for i in got] == [_fields(i) for i in expected]
    assert len(got) == 3 + 2 + 2 + 1  # the empty chunk at the end of "b" overlaps nothing


def test_layout_load_planner_on_columns_refuses_uncovered_shards() -> None:
    tensors = {"a": ((10, 6), [((0, 0), (4, 6)), ((8, 0), (2, 6))])}  # rows 4..7 were never saved
    planner = LayoutLoadPlanner()
    planner.set_up_planner({"a": torch.zeros(10, 6)}, _metadata(tensors, columns=True), True)
    with pytest.raises(ReshardError, match=r"'a'.*cover 36 of the 60 elements"):
        planner.create_local_plan()


# -- decode into columns ------------------------------------------------------------------


def _document(tensors: dict[str, tuple[tuple[int, ...], list[Box]]]) -> tuple[bytes, dict[MetadataIndex, StoredItem]]:
    """A version-3 document for these tensors (each chunk its own item) and a bytes value."""
    state: dict[str, Any] = {}
    items: dict[MetadataIndex, StoredItem] = {}
    at = 0
    for fqn, (shape, boxes) in tensors.items():
        chunks = [_chunk(*b) for b in boxes]
        state[fqn] = _md(shape, chunks)
        for chunk in chunks:
            nbytes = 4 * int(np.prod(chunk.sizes))
            items[MetadataIndex(fqn, chunk.offsets)] = StoredItem("__0_0.distcp", at, nbytes, 0, nbytes, frame_size=1 << 20)
            at += nbytes
    state["step"] = BytesStorageMetadata()
    items[MetadataIndex("step")] = StoredItem("__0_0.distcp", at, 10, 0, 10, frame_size=1 << 20)
    at += 10
    ref = FrameIndexRef(at, 16, 0)
    items = {k: StoredItem(v.relative_path, v.offset, v.length, v.data_offset, v.data_length,
                           frame_size=v.frame_size, indexed=True, frame_index=ref) for k, v in items.items()}
    return encode_metadata(Metadata(state_dict_metadata=state), items, world_size=2, version=3), items


_TENSORS: dict[str, tuple[tuple[int, ...], list[Box]]] = {
    "w": ((8, 6), [((4, 0), (4, 3)), ((0, 0), (4, 3)), ((0, 3), (8, 3))]),
    "v": ((5,), [((0,), (3,)), ((3,), (2,)), ((5,), (0,))]),
    "s": ((), [((), ())]),
    "e": ((0, 4), []),
}


def test_decode_v3_gives_columns_equal_to_the_encoded_chunks() -> None:
    document, items = _document(_TENSORS)
    decoded = decode_metadata(document, "doc")
    for fqn, (shape, boxes) in _TENSORS.items():
        chunks = decoded.metadata.state_dict_metadata[fqn].chunks
        assert isinstance(chunks, ChunkColumns) and chunks.ndim == len(shape)
        assert chunks.offsets.tolist() == [list(o) for o, _ in boxes]
        assert chunks.sizes.tolist() == [list(s) for _, s in boxes]
        assert chunks == [_chunk(*b) for b in boxes]
    locations = decoded.metadata.storage_data
    assert isinstance(locations, ChunkLocations) and len(locations) == len(items)
    # Look-ups with the planner's row hint, without one, and with a wrong one find the same item.
    for hint in (1, None, 0, 99):
        found = locations[MetadataIndex("w", [0, 0], hint)]
        assert (found.offset, found.length) == (items[MetadataIndex("w", [0, 0])].offset, 48)
    with pytest.raises(KeyError):
        locations[MetadataIndex("w", [1, 0])]
    assert {i: locations[i].offset for i in locations} == {i: v.offset for i, v in items.items()}
    shapes = ChunkShapes(decoded.metadata.state_dict_metadata)
    assert shapes.of(MetadataIndex("w", [0, 3], 2)) == (torch.float32, (8, 3))
    assert shapes.of(MetadataIndex("w", [0, 3], 0)) == (torch.float32, (8, 3))
    assert shapes.of(MetadataIndex("w", [0, 2])) is None and shapes.of(MetadataIndex("x", [0])) is None
    assert shapes[("s", ())] == (torch.float32, ()) and len(shapes) == 3 + 3 + 1
    assert dict(shapes)[("v", (3,))] == (torch.float32, (2,))


def _edit_table(document: bytes, fqn: str, column: int, value: int) -> bytes:
    """Set one integer of a key's first row in the chunk table, and re-sign."""
    doc = json.loads(document)
    packed = base64.b64decode(doc["chunk_table"])
    if doc["chunk_table_codec"] == "zstd":
        import zstandard

        raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=doc["chunk_table_bytes"])
    else:
        raw = zlib.decompress(packed)
    table = np.frombuffer(raw, dtype="<i8").copy()
    first, rows = doc["state_dict"][fqn]["table"]
    table[first + column * rows] = value
    doc["chunk_table"] = base64.b64encode(zlib.compress(table.tobytes())).decode()
    doc["chunk_table_codec"] = "zlib"
    return sign(doc)


@pytest.mark.parametrize(("column", "value"), [(0, 5), (1, 4), (2, 5), (3, 7), (0, -1), (2, -4), (0, 2**62), (2, 2**63 - 1)])
def test_decode_v3_refuses_a_chunk_outside_its_tensor(column: int, value: int) -> None:
    # Columns of "w" (2-D): offsets 0-1, sizes 2-3. Its shape is (8, 6).
    document, _ = _document(_TENSORS)
    damaged = _edit_table(document, "w", column, value)
    with pytest.raises(CheckpointCorruptError, match=r"chunk of 'w' lies outside the tensor's size \[8, 6\]"):
        decode_metadata(damaged, "doc")


@pytest.mark.parametrize("rows", [3, 8, 9, 40])
def test_chunk_bounds_are_checked_for_few_and_many_chunks(rows: int) -> None:
    """Up to 8 chunks a key's bounds are checked in Python, past that on the
    arrays: both refuse any chunk outside the tensor, overflowing values too."""
    from dcp_ext.metadata.chunk_table import columns_of

    shape = [4 * rows, 6]
    offsets = np.array([[4 * r for r in range(rows)], [0] * rows], dtype=np.int64)
    sizes = np.array([[4] * rows, [6] * rows], dtype=np.int64)
    assert columns_of(offsets, sizes, shape, "w", "doc").offsets.tolist() == offsets.T.tolist()
    for dim, column, value in ((0, rows - 1, 4 * rows - 3), (1, 0, -1), (1, rows // 2, 2**62)):
        bad = offsets.copy()
        bad[dim, column] = value
        with pytest.raises(CheckpointCorruptError, match=r"chunk of 'w' lies outside the tensor's size"):
            columns_of(bad, sizes, shape, "w", "doc")
    huge = sizes.copy()
    huge[0, rows - 1] = 2**63 - 1
    with pytest.raises(CheckpointCorruptError, match=r"chunk of 'w' lies outside"):
        columns_of(offsets, huge, shape, "w", "doc")


def test_chunk_columns_keep_the_objects_of_few_chunks() -> None:
    """torch's planner walks a tensor's chunks several times: up to
    KEPT_CHUNKS chunks the same objects come back, past that new ones equal
    to them; both equal the arrays' rows, and pickling keeps only the arrays."""
    import pickle

    from dcp_ext.metadata.chunk_columns import KEPT_CHUNKS

    for rows in (1, KEPT_CHUNKS, KEPT_CHUNKS + 1):
        chunks = [_chunk((r, 0), (1, 5)) for r in range(rows)]
        columns = ChunkColumns.of(chunks, 2)
        assert list(columns) == chunks and [columns[r] for r in range(rows)] == chunks
        assert columns[-1] == chunks[-1]
        kept = rows <= KEPT_CHUNKS
        assert (next(iter(columns)) is columns[0]) == kept
        again = pickle.loads(pickle.dumps(columns))
        assert again == columns and list(again) == chunks


def test_decode_v3_refuses_a_key_outside_the_table() -> None:
    document, _ = _document(_TENSORS)
    doc = json.loads(document)
    doc["state_dict"]["v"]["table"][1] = 10**6
    # Refused before anything is allocated: the rows the keys claim must span the declared table.
    with pytest.raises(CheckpointCorruptError, match=r"^doc: chunk_table_bytes says \d+ bytes, but its keys' rows span"):
        decode_metadata(sign(doc), "doc")


def test_key_totals_on_columns_equal_item_sums() -> None:
    document, items = _document(_TENSORS)
    locations = decode_metadata(document, "doc").metadata.storage_data
    totals = locations.totals()
    for fqn in ("w", "v", "s", "step"):
        mine = [v for k, v in items.items() if k.fqn == fqn]
        assert totals[fqn] == (len(mine), sum(i.data_length for i in mine), sum(i.raw_size for i in mine), ((),))
    assert totals["e"] == (0, 0, 0, ())
    damaged = _edit_table(document, "v", 2 * 1 + 4, -5)  # the first row's data_length
    with pytest.raises(CheckpointCorruptError, match="'v' has an impossible length"):
        decode_metadata(damaged, "doc").metadata.storage_data.totals()


def test_one_local_and_one_saved_chunk_equal_torchs() -> None:
    # The direct path for a key with one chunk each (unsharded loads): torch's items, on random 0-3-D boxes,
    # zero-size ones included.
    import random

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from dcp_ext.metadata.chunk_columns import ChunkColumns
    from dcp_ext.planning._tensor_reads import read_items_for_columns

    rng = random.Random(7)
    found = 0
    for _ in range(1500):
        shape = [rng.randint(0, 6) for _ in range(rng.randint(0, 3))]

        def box(shape: list[int]) -> ChunkStorageMetadata:
            offsets = [rng.randint(0, s) for s in shape]
            return ChunkStorageMetadata(torch.Size(offsets), torch.Size(rng.randint(0, s - o) for s, o in zip(shape, offsets)))

        saved, local = [box(shape)], [box(shape)]
        md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), saved)
        expected = create_read_items_for_chunk_list("k", md, local)
        assert read_items_for_columns("k", ChunkColumns.of(saved, len(shape)), local) == expected
        found += len(expected)
    assert found > 300  # overlapping pairs were drawn, not only disjoint ones
