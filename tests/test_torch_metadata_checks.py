"""Torch-format ``.metadata`` that is damaged or hostile: a typed error naming
the file and key, before anything is allocated, never wrong tensors
(dcp_ext/metadata/torch_checks.py, dcp_ext/whole_state.py).

Each case edits the pickle of a checkpoint written by torch's own
``FileSystemWriter`` (chunked like a multi-rank save:
:mod:`tests.support.torch_checkpoints`) as a hostile or buggy tool would, then
reads it the way users do: ``load_whole`` (no template: dtype and shape come
from the metadata), ``dcp_ext.load`` (into a template), ``dcp-ext inspect``
and ``verify``. The review findings they cover:

1. ``planner_data`` paths: a negative index, one past the checkpoint's item
   count (``("b", 10**9)`` appended a billion ``None``s), a mapping key where
   other keys make a list, a path for another key.
2. Sizes reached ``torch.empty`` unchecked (``Size([1 << 40])`` failed in the
   allocator as a plain ``DcpExtError``).
3. Global sizes and dtypes not checked against the chunks and their stored
   bytes: a size grown returned uninitialised rows, a size shrunk truncated,
   a dtype changed cast the values.
4. A ``_StorageInfo`` without a field: ``AttributeError`` tracebacks from the
   CLI, a bare ``AssertionError`` from ``dcp_ext.load``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import dcp_ext
from dcp_ext.cli import main as cli_main
from dcp_ext.errors import CheckpointCorruptError, DcpExtError
from dcp_ext.metadata import tiling_problem
from dcp_ext.whole_state import load_whole, planner_paths
from tests.support.compare import assert_same_state
from tests.support.torch_checkpoints import STATE, read_metadata, template, write_chunked, write_metadata

Edit = Callable[[Metadata], Any]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch") / "ck"
    write_chunked(path)
    return path


def _edited(base: Path, tmp_path: Path, change: Edit) -> Path:
    """A copy of ``base`` whose ``.metadata`` went through ``change``."""
    ck = tmp_path / "ck"
    shutil.copytree(base, ck)
    metadata = read_metadata(ck)
    change(metadata)
    write_metadata(ck, metadata)
    return ck


def _load(ck: Path) -> dict[str, Any]:
    target = template()
    dcp_ext.load(target, ck)
    return target


def _refused(read: Callable[[Path], Any], ck: Path, *named: str) -> str:
    """The message of the CheckpointCorruptError ``read(ck)`` raises; it names
    the ``.metadata`` file and each of ``named``."""
    with pytest.raises(Exception) as caught:
        read(ck)
    assert caught.type is CheckpointCorruptError, f"{caught.type.__name__}: {caught.value}"
    message = str(caught.value)
    assert str(ck / ".metadata") in message and all(n in message for n in named), message
    return message


def test_unedited_checkpoints_load_bit_exact(base: Path) -> None:
    """The checks pass what torch writes: row, grid and irregular chunk layouts, nested lists and dicts."""
    assert_same_state(STATE, load_whole(base))
    assert_same_state(STATE, _load(base))
    assert_same_state({"odd": STATE["odd"], "lst": STATE["lst"]}, load_whole(base, keys=["odd", "lst"]))


# -- finding 1: planner_data paths ------------------------------------------------------------------------
def _rename(metadata: Metadata, old: str, new: str, path: tuple[Any, ...]) -> None:
    """Rename key ``old`` to ``new`` everywhere (a consistent hostile edit), at ``path``."""
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    for index in [i for i in metadata.storage_data if i.fqn == old]:
        metadata.storage_data[MetadataIndex(new, index.offset)] = metadata.storage_data.pop(index)
    del metadata.planner_data[old]
    metadata.planner_data[new] = path


_PATHS: dict[str, tuple[Edit, str]] = {
    "negative index": (lambda md: md.planner_data.update({"lst.0": ("lst", -3)}), "'lst.0'"),
    "index past the item count": (lambda md: _rename(md, "lst.1", "lst.100000", ("lst", 100000)), "'lst.100000'"),
    "mapping key where other keys make a list": (lambda md: _rename(md, "lst.1", "lst.x", ("lst", "x")), "'lst.x'"),
    "index as a string": (lambda md: md.planner_data.update({"lst.1": ("lst", "1")}), "'lst.1'"),
    "path of another key": (lambda md: md.planner_data.update({"opt.lr": ("opt", "name")}), "'opt.lr'"),
    "inside a stored value": (lambda md: _rename(md, "opt.lr", "step.lr", ("step", "lr")), "'step.lr'"),
    "no path for a key": (lambda md: md.planner_data.pop("opt.lr"), "'opt.lr'"),
    "path for a lost key": (lambda md: md.state_dict_metadata.pop("opt.lr"), "'opt.lr'"),
    "not a mapping": (lambda md: setattr(md, "planner_data", ["lst"]), "planner_data is a list"),
}


@pytest.mark.parametrize("case", sorted(_PATHS))
def test_planner_paths_dcp_cannot_record_are_refused(base: Path, tmp_path: Path, case: str) -> None:
    """Before: IndexError (negative), a 100,001-element list of Nones (past the count; 10**9
    exhausted memory), TypeError, or a result shaped unlike the saved state."""
    change, named = _PATHS[case]
    _refused(load_whole, _edited(base, tmp_path, change), named)


def test_planner_path_bounds_cost_nothing() -> None:
    """An index of 10**9 or 2**63 is refused without building anything; one below the item count passes."""

    def paths(index: Any) -> dict[str, tuple[Any, ...]]:
        fqn = f"b.{int(index)}"
        return planner_paths(Metadata({"b.0": None, fqn: None, "c": None},
                                      planner_data={"b.0": ("b", 0), fqn: ("b", index), "c": ("c",)}))

    assert paths(1)["b.1"] == ("b", 1) and paths(2)["b.2"] == ("b", 2)
    for index in (3, 10**9, 2**63, -1, True):
        with pytest.raises(ValueError, match=r"list indices in \[0, 3\)"):
            paths(index)


# -- findings 2 and 3: sizes and dtypes against the chunks and their stored bytes -------------------------
def _size(fqn: str, size: list[int]) -> Edit:
    return lambda md: setattr(md.state_dict_metadata[fqn], "size", torch.Size(size))


def _move_chunk(fqn: str, row: int, offsets: tuple[int, ...]) -> Edit:
    """Move a chunk, and its storage record with it (a consistent hostile edit)."""

    def change(md: Metadata) -> None:
        chunk = md.state_dict_metadata[fqn].chunks[row]
        info = md.storage_data.pop(MetadataIndex(fqn, chunk.offsets))
        md.storage_data[MetadataIndex(fqn, offsets)] = info
        md.state_dict_metadata[fqn].chunks[row] = ChunkStorageMetadata(torch.Size(offsets), chunk.sizes)

    return change


def _drop_chunk(fqn: str, row: int) -> Edit:
    def change(md: Metadata) -> None:
        chunk = md.state_dict_metadata[fqn].chunks.pop(row)
        del md.storage_data[MetadataIndex(fqn, chunk.offsets)]

    return change


def _dtype(fqn: str, dtype: torch.dtype) -> Edit:
    return lambda md: setattr(md.state_dict_metadata[fqn].properties, "dtype", dtype)


def _grow(fqn: str, size: list[int], length: int | None = None) -> Edit:
    """Claim ``size`` for a one-chunk key, its chunk too (and its stored length, if given)."""

    def change(md: Metadata) -> None:
        tensor = md.state_dict_metadata[fqn]
        tensor.size = torch.Size(size)
        tensor.chunks = [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size))]
        if length is not None:
            index = MetadataIndex(fqn, [0] * len(size))
            md.storage_data[index] = dataclasses.replace(md.storage_data[index], length=length)

    return change


_CLAIMS: dict[str, tuple[Edit, str]] = {
    # finding 3: the global size alone changed
    "rows doubled": (_size("w", [24, 8]), "the chunks of key 'w' hold 96 of its 192 elements"),
    "20000 x 20000": (_size("w", [20000, 20000]), "hold 96 of its 400000000 elements"),
    "rows halved": (_size("w", [6, 8]), "a chunk of key 'w' lies outside the key's size [6, 8]"),
    "another ndim": (_size("w", [12, 8, 1]), "a chunk of key 'w' is ChunkStorageMetadata"),
    # finding 2: sizes no allocation could hold
    "1 << 40": (_size("big", [1 << 40]), "hold 3000 of its 1099511627776 elements"),
    "2**63": (_size("big", [2**63]), "key 'big' has size (9223372036854775808,), not a list of non-negative"),
    "chunk and size 1 << 40": (_grow("big", [1 << 40]), "needs 4398046511104 bytes, but its stored item"),
    # finding 3: the dtype changed to a wider one
    "float64 for float32": (_dtype("big", torch.float64), "needs 24000 bytes, but its stored item"),
    # chunk layouts that do not tile the tensor
    "chunk missing": (_drop_chunk("grid", 3), "the chunks of key 'grid' hold 18 of its 24 elements"),
    "rows overlap": (_move_chunk("w", 1, (5, 0)), "the chunks of key 'w' (size [12, 8]) do not tile it: they overlap"),
    "irregular overlap": (_move_chunk("odd", 2, (1, 1)), "the chunks of key 'odd' (size [4, 5]) do not tile it"),
    "chunk twice": (lambda md: md.state_dict_metadata["grid"].chunks.append(
        md.state_dict_metadata["grid"].chunks[0]), "'grid' (size [4, 6]) do not tile it: they overlap"),
    "chunk outside": (_move_chunk("grid", 3, (2, 4)), "a chunk of key 'grid' lies outside the key's size [4, 6]"),
}


@pytest.mark.parametrize("reader", ["load_whole", "dcp_ext.load"])
@pytest.mark.parametrize("case", sorted(_CLAIMS))
def test_sizes_and_dtypes_are_checked_against_the_chunks(base: Path, tmp_path: Path, case: str, reader: str) -> None:
    """Before, load_whole returned uninitialised rows (rows doubled), a 1.6 GB tensor of zeros
    (20000 x 20000), truncated ones (rows halved), overlapping chunks' last writes, cast values
    (float64), or failed in the allocator as a plain DcpExtError (1 << 40); dcp_ext.load
    compared the edited size with its template's (ReshardError) or read overlapping chunks."""
    change, named = _CLAIMS[case]
    _refused(load_whole if reader == "load_whole" else _load, _edited(base, tmp_path, change), named)


def test_dtype_narrowed_on_a_large_tensor_is_refused(base: Path, tmp_path: Path) -> None:
    """256 KiB of float32 stored, bfloat16 claimed: 128 KiB more than a torch.save archive of
    the claimed chunk can hold. Before: load_whole returned the values cast to bfloat16."""
    ck = _edited(base, tmp_path, _dtype("wide", torch.bfloat16))
    _refused(load_whole, ck, "the chunk of key 'wide' at [0] (torch.bfloat16, sizes [65536]) has 131072 bytes")


def test_claimed_bytes_past_the_file_are_refused_before_allocation(base: Path, tmp_path: Path) -> None:
    """A chunk, its tensor and its stored length all claiming 4 TiB: consistent, and checked
    against the data file's size before the tensor is allocated (before: the allocator failed,
    a plain DcpExtError; with overcommit it might not have)."""
    ck = _edited(base, tmp_path, _grow("big", [1 << 40], length=(4 << 40) + 2048))
    with pytest.raises(Exception) as caught:
        load_whole(ck)
    assert caught.type is CheckpointCorruptError, f"{caught.type.__name__}: {caught.value}"
    message = str(caught.value)
    assert f"{ck / '__0_0.distcp'}: .metadata puts 'big' at bytes [" in message, message
    assert "refusing to allocate it" in message, message


@pytest.mark.parametrize(("change", "key"), [(_dtype("w", torch.int32), "'w'"), (_dtype("scalar", torch.float32),
                                           "'scalar'"), (_grow("big", [2990]), "'big'")],
                         ids=["same width", "small tensor", "size shrunk consistently"])
def test_changes_within_the_envelope_slack(base: Path, tmp_path: Path, change: Edit, key: str) -> None:
    """Edits the metadata alone cannot tell (the bytes fit the claimed chunk within a torch.save
    envelope's slack): the archive's own dtype and shape are compared with the chunk's when the
    item is read (dcp_ext/dcp_io/_item_reads.py), so a CheckpointCorruptError names the data file
    and key instead of the values cast (same width, small tensor) or the first 2,990 of 3,000."""
    ck = _edited(base, tmp_path, change)
    with pytest.raises(Exception) as caught:
        load_whole(ck)
    assert caught.type is CheckpointCorruptError, f"{caught.type.__name__}: {caught.value}"
    assert str(ck) in str(caught.value) and key in str(caught.value), str(caught.value)


# -- finding 4: records without their fields, or of other types -------------------------------------------
def _first_record(md: Metadata) -> Any:
    return md.storage_data[MetadataIndex("w", [0, 0])]


_RECORDS: dict[str, tuple[Edit, str]] = {
    "no relative_path": (lambda md: vars(_first_record(md)).pop("relative_path"),
                         "the storage record of 'w' at [0, 0] has no relative_path"),
    "no offset": (lambda md: vars(_first_record(md)).pop("offset"), "the storage record of 'w' at [0, 0] has no offset"),
    "no length": (lambda md: vars(_first_record(md)).pop("length"), "the storage record of 'w' at [0, 0] has no length"),
    "offset a string": (lambda md: setattr(_first_record(md), "offset", "12"), "has offset '12' and length"),
    "negative length": (lambda md: setattr(_first_record(md), "length", -1), "and length -1; both must be"),
    "descriptors a number": (lambda md: setattr(_first_record(md), "transform_descriptors", 5),
                             "has transform_descriptors 5, not a list of names"),
    "record a float": (lambda md: md.storage_data.update({MetadataIndex("w", [0, 0]): 0.5}),
                       "the storage record of 'w' at [0, 0] is a float"),
    "chunk without sizes": (lambda md: vars(md.state_dict_metadata["w"].chunks[0]).pop("sizes"),
                            "a chunk of key 'w' is <ChunkStorageMetadata>"),
    "tensor without chunks": (lambda md: vars(md.state_dict_metadata["w"]).pop("chunks"),
                              "key 'w' has no list of chunks"),
    "dtype a layout": (lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", torch.strided),
                       "key 'w' has no dtype"),
    "storage_meta a number": (lambda md: setattr(md, "storage_meta", 5), "its storage_meta is a int"),
    "planner_data name damaged": (lambda md: vars(md).update(pLanner_data=vars(md).pop("planner_data")),
                                  "has no planner_data"),
}


@pytest.mark.parametrize("reader", ["load_whole", "dcp_ext.load"])
@pytest.mark.parametrize("case", sorted(_RECORDS))
def test_incomplete_records_are_refused_where_decoded(base: Path, tmp_path: Path, case: str, reader: str) -> None:
    """Before: AttributeError inside read_metadata, which DCP rewraps as a bare AssertionError
    (dcp_ext.load) or load_whole as a plain DcpExtError; a layout for a dtype reached torch.empty;
    a renamed planner_data field loaded every key flat."""
    change, named = _RECORDS[case]
    _refused(load_whole if reader == "load_whole" else _load, _edited(base, tmp_path, change), named)


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_reports_an_incomplete_record_without_a_traceback(base: Path, tmp_path: Path, command: str) -> None:
    """Before: ``AttributeError: '_StorageInfo' object has no attribute 'offset'`` escaped main()."""
    ck = _edited(base, tmp_path, _RECORDS["no offset"][0])
    code, out, err = _cli(command, str(ck))
    assert code == 2 and out == "", (code, out, err)
    assert err == f"dcp-ext: error: {ck / '.metadata'}: the storage record of 'w' at [0, 0] has no offset; the " \
                  f"metadata is damaged\n", err


# -- the tiling check on its own -----------------------------------------------------------------------------
def _chunks(*boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    ndim = len(boxes[0][0]) if boxes else 0
    offsets = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return offsets, sizes


@pytest.mark.parametrize(("shape", "boxes", "problem"), [
    ((), [((), ())], None),  # a scalar
    ((0, 4), [((0, 0), (0, 4))], None),  # an empty tensor
    ((3, 4), [((0, 0), (3, 4)), ((3, 0), (0, 4))], None),  # an empty shard at the end (uneven DTensor sharding)
    ((4, 6, 2), [((r, c, 0), (2, 3, 2)) for r in (0, 2) for c in (0, 3)], None),  # a grid
    ((4, 5), [((0, 0), (1, 5)), ((1, 0), (3, 2)), ((1, 2), (3, 3))], None),  # irregular
    ((4, 5), [((0, 0), (1, 5)), ((1, 0), (3, 2)), ((1, 1), (3, 3))], "they overlap"),  # one column twice, one none
    ((4, 5), [((0, 0), (1, 5)), ((1, 0), (3, 3)), ((1, 2), (3, 3))], "they overlap"),  # 23 elements held of 20
    ((4, 5), [((0, 0), (1, 5)), ((1, 0), (3, 3)), ((1, 2), (3, 2))], "they overlap"),
    ((4, 5), [((0, 0), (1, 5)), ((1, 0), (3, 2)), ((2, 2), (2, 3))], "hold 17 of its 20"),
    ((3, 4), [((0, 0), (3, 4)), ((4, 0), (0, 4))], "lies outside"),  # an empty chunk past the end
    ((8,), [((2**63 - 1,), (2,))], "lies outside"),  # offset + size overflows int64
    ((2**31, 2**31), [((0, 0), (2**31, 2**31))], "impossible size"),  # 2**62 elements
    ((4,), [((0, 0), (4, 1))], "do not have its 1 dimensions"),
])
def test_tiling(shape: tuple[int, ...], boxes: list[Any], problem: str | None) -> None:
    found = tiling_problem("k", shape, *_chunks(*boxes))
    assert (found is None) if problem is None else (found is not None and problem in found), found


def test_tiling_of_many_chunks_is_fast() -> None:
    """A 256 x 256 grid (65,536 chunks), 100,000 row chunks and an irregular 400-chunk layout in well under a
    second of CPU (the process's CPU time, not wall time: a busy or shared machine must not fail it; a check
    quadratic in the chunks would take minutes)."""
    import time

    started = time.process_time()
    grid = [((r * 2, c * 3), (2, 3)) for r in range(256) for c in range(256)]
    assert tiling_problem("g", (512, 768), *_chunks(*grid)) is None
    rows = [((r,), (1,)) for r in range(100_000)][::-1]
    assert tiling_problem("r", (100_000,), *_chunks(*rows)) is None
    bands = [box for b in range(200) for box in (((b, 0), (1, 1 + b % 7)), ((b, 1 + b % 7), (1, 9 - b % 7)))]
    assert tiling_problem("i", (200, 10), *_chunks(*bands)) is None
    assert "overlap" in (tiling_problem("i", (200, 10), *_chunks(*bands[:-1], ((199, 1), (1, 9)))) or "")
    assert time.process_time() - started < 3.0


def test_errors_are_typed_for_every_reader(base: Path, tmp_path: Path) -> None:
    """The refusal is a CheckpointCorruptError, so a ValueError and a DcpExtError to callers that know neither."""
    ck = _edited(base, tmp_path, _size("w", [24, 8]))
    for read in (load_whole, _load, lambda p: dcp_ext.CheckpointReader(p).read_metadata()):
        with pytest.raises(CheckpointCorruptError) as caught:
            read(ck)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, DcpExtError)
