"""Frame checks on every read path of FrameReader: frames read straight into
their destination, frames read through scratch (a run that cuts them), and
compressed frames (checked before any decoder sees them; the decoder is
observed through a recording wrapper that calls the real one). A damaged
frame is caught on each; intact ones are all counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_ext
import dcp_ext.frames._frames as frames_module
from dcp_ext.storage import plan_requests
from dcp_ext.config import IOConfig
from dcp_ext.frames._frames import FrameReader, FrameWork, frame_table
from dcp_ext.metadata import METADATA_FILE, decode_metadata
from dcp_ext.metadata.chunk_table import ChunkLocations
from dcp_ext.metadata.frame_index import attach_frame_indexes
from dcp_ext.storage import open_store
from tests.support.damage_trials import flip_byte
from tests.support.states import zeros_like_state

FRAME = 64 * 1024
ROWS, COLS = 300, 257  # bf16: 154,200 bytes, 3 frames, the last partial


def _saved(tmp_path: Path, compression: str | None) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    tensor = torch.randn(ROWS, COLS).bfloat16()
    url = tmp_path / "ck"
    dcp_ext.save({"w": tensor, "b": torch.randn(10)}, url, compression=compression, frame_size=FRAME)
    return url, tensor


def _decoded(url: Path) -> tuple[Any, Any, Any]:
    """The store, the decoded metadata and its items (frame indexes not attached)."""
    store = open_store(str(url), IOConfig(), {})
    decoded = decode_metadata(store.read_file(METADATA_FILE), "metadata")
    return store, decoded, decoded.metadata.storage_data


def _attach_all(store: Any, decoded: Any, locations: ChunkLocations) -> None:
    attach_frame_indexes(locations, list(decoded.frame_indexes), decoded.frame_indexes,
                         lambda n, r: store.read_range(n, r.at, r.length), store.describe)


def _item(url: Path) -> tuple[Any, Any, Any]:
    store, decoded, locations = _decoded(url)
    if isinstance(locations, ChunkLocations):
        _attach_all(store, decoded, locations)
    index, item = next((i, it) for i, it in locations.items() if i.fqn == "w")
    return store, index, item


def _frame_start(item: Any, k: int) -> int:
    """Absolute file offset of frame ``k``'s stored bytes."""
    before = sum(item.frame_lengths[:k]) if item.transforms else k * FRAME
    return item.offset + item.data_offset + before


def _read(url: Path, runs_of: Any) -> tuple[FrameReader, list[tuple[int, memoryview]], bytearray]:
    """Read the runs ``runs_of(out)`` of item ``w`` through a FrameReader."""
    store, index, item = _item(url)
    reader = FrameReader()
    reader.work = FrameWork(2)
    out = bytearray(item.raw_length if item.raw_length >= 0 else item.data_length)
    runs = runs_of(memoryview(out))
    try:
        pieces, _ = reader.pieces(frame_table(item, "w's file"), runs, "w's file", index, True)
        store.read(plan_requests(pieces, gap=store.coalesce_gap, max_request=16 << 20))
        reader.work.wait()
    finally:
        reader.work.close()
    return reader, runs, out


WHOLE = pytest.param(lambda out: [(0, out)], 3, id="direct")
# Runs that cut frames 0/1 and 1/2: every frame goes through scratch.
CUT = pytest.param(lambda out: [(100, out[100:70_000]), (70_000, out[70_000:150_001])], 3, id="scratch")
# Only the middle of frame 1: one frame read, through scratch.
MIDDLE = pytest.param(lambda out: [(FRAME + 10, out[FRAME + 10 : FRAME + 5000])], 1, id="one-frame")


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize(("runs_of", "frames"), [WHOLE, CUT, MIDDLE])
def test_intact_frames_are_all_checked(tmp_path: Path, compression: str | None, runs_of: Any, frames: int) -> None:
    url, tensor = _saved(tmp_path, compression)
    reader, runs, out = _read(url, runs_of)
    raw = tensor.view(torch.uint8).numpy().tobytes()
    for start, dest in runs:
        assert bytes(dest) == raw[start : start + dest.nbytes]
    assert reader.stats.verified == frames
    assert reader.stats.decoded == (frames if compression else 0)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize(("runs_of", "frames"), [WHOLE, CUT, MIDDLE])
def test_damaged_frame_is_caught_before_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str | None, runs_of: Any, frames: int
) -> None:
    """Frame 1 (read on every path) damaged: ChecksumMismatchError naming
    frame 2 of 3, and no decoder ever sees its bytes."""
    url, _ = _saved(tmp_path, compression)
    _, _, item = _item(url)
    damaged_at = _frame_start(item, 1) + 7
    flip_byte(url / item.relative_path, damaged_at)
    bad = bytes(Path(url / item.relative_path).read_bytes()[_frame_start(item, 1) : _frame_start(item, 2)])
    seen: list[bytes] = []
    decode_fault = frames_module.decode_fault

    def watching(transforms: Any, stored: memoryview, out: memoryview) -> Any:
        seen.append(bytes(stored))
        return decode_fault(transforms, stored, out)

    monkeypatch.setattr(frames_module, "decode_fault", watching)
    with pytest.raises(dcp_ext.ChecksumMismatchError) as info:
        _read(url, runs_of)
    assert "frame 2 of 3" in str(info.value) and "'w'" in str(info.value)
    assert bad not in seen


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_damaged_frame_fails_a_load(tmp_path: Path, compression: str | None) -> None:
    """Through dcp_ext.load (the reader's own pieces): a flipped byte in the
    last, partial frame is caught; with verification off, an uncompressed
    load returns the damaged bytes."""
    url, tensor = _saved(tmp_path, compression)
    _, _, item = _item(url)
    flip_byte(url / item.relative_path, _frame_start(item, 2) + 3)
    state = {"w": tensor, "b": torch.randn(10)}
    with pytest.raises(dcp_ext.ChecksumMismatchError, match="frame 3 of 3"):
        dcp_ext.load(zeros_like_state(state), url)
    if compression is None:
        out = zeros_like_state(state)
        dcp_ext.load(out, url, verify_checksums=False)
        assert not torch.equal(out["w"], tensor)


def test_an_item_built_while_its_file_is_attached_keeps_the_frame_tables(tmp_path: Path) -> None:
    """A read-once load looks items up from two threads: the reading thread
    (which attaches frame indexes) and the exchanging one (items received).
    An item built from the columns while the other thread attached its file's
    frame index must not replace the attached version: it would stay
    un-attached for the rest of the load ("the frame index of this file was
    not read before its frames", seen once in a 3-rank read-once reshard).
    The interleaving is forced here: the other thread's attach runs inside
    the build."""
    url, _ = _saved(tmp_path, None)
    store, decoded, locations = _decoded(url)
    assert isinstance(locations, ChunkLocations)
    index = next(i for i in locations.keys() if i.fqn == "w")
    build = locations._item
    attached = []

    def build_while_the_other_thread_attaches(fqn: str, row: list[int]) -> Any:
        item = build(fqn, row)
        if not attached:  # the other thread, once (its attach builds items too)
            attached.append(True)
            _attach_all(store, decoded, locations)
        return item

    locations._item = build_while_the_other_thread_attaches  # type: ignore[method-assign]
    assert locations[index].indexed is False  # the attached version, with its frame table
    del locations._item
    assert locations[index].indexed is False and locations.attached_files
    frame_table(locations[index], "w's file")  # raises on an item left un-attached
