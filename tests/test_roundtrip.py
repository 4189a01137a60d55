"""Single-process round trips through stock dcp.save / dcp.load on every backend."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

import dcp_ext
from dcp_ext import CheckpointReader, CheckpointWriter
from tests.support.metadata_edit import stored_items
from tests.support.backends import Backend
from tests.support.compare import assert_same_state
from tests.support.hostile import code_running_pickle
from tests.support.states import zeros_like_state

MiB = 1024 * 1024


def _sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g)
    return {
        "f32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(8, 300, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 7, 3, generator=g).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (123,), generator=g),
        "i8": torch.randint(-128, 127, (9, 9), generator=g, dtype=torch.int8),
        "bool": torch.rand(31, generator=g) > 0.5,
        "zero_d": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # non-contiguous view
        "strided": base[::3, 5:20],  # view with offset and steps
        "nested": {"step": 17, "name": "run-a", "lr": [0.1, 0.01], "blob": io.BytesIO(b"\x00raw\xff")},
    }


def test_round_trip_every_dtype_and_value(backend: Backend) -> None:
    url = backend.url()
    state = _sample_state()
    dcp.save(state, storage_writer=CheckpointWriter(url, storage_options=backend.storage_options))
    loaded = zeros_like_state(state)
    reader = CheckpointReader(url, storage_options=backend.storage_options)
    dcp.load(loaded, storage_reader=reader)
    assert_same_state(state, loaded)
    # Everything came from the one data file, in very few requests.
    snap = reader.store.stats.snapshot()
    assert snap.files_read == frozenset({"__0_0.distcp"})
    assert snap.read_requests <= 2


def test_checkpoint_id_and_async_save(backend: Backend) -> None:
    state = _sample_state()
    first, second = backend.url("a"), backend.url("b")
    writer = CheckpointWriter(first, storage_options=backend.storage_options)
    dcp.save(state, storage_writer=writer)
    # The same writer re-targeted through checkpoint_id, asynchronously.
    future = dcp.async_save(state, storage_writer=writer, checkpoint_id=second)
    future.result(timeout=120)
    reader = CheckpointReader(first, storage_options=backend.storage_options)
    for url in (first, second):
        loaded = zeros_like_state(state)
        dcp.load(loaded, storage_reader=reader, checkpoint_id=url)
        assert_same_state(state, loaded)


def test_loads_only_the_bytes_it_needs(make_backend) -> None:
    # Local disk and SeaweedFS: one 32 MiB file, one small tensor wanted.
    for kind in ("local", "seaweedfs"):
        backend = make_backend(kind)
        url = backend.url()
        big = {f"layer{i}": torch.randn(1024, 1024) for i in range(8)}  # 8 x 4 MiB
        dcp.save(big, storage_writer=CheckpointWriter(url, storage_options=backend.storage_options))
        one = {"layer5": torch.zeros(1024, 1024)}
        reader = CheckpointReader(url, storage_options=backend.storage_options)
        dcp.load(one, storage_reader=reader)
        assert torch.equal(one["layer5"], big["layer5"])
        snap = reader.store.stats.snapshot()
        tensor_bytes = 1024 * 1024 * 4
        assert tensor_bytes <= snap.bytes_read <= tensor_bytes + 64 * 1024, (kind, snap)


def test_slice_of_a_stored_tensor_reads_only_that_slice(tmp_path) -> None:
    # A row slice is one run; a column slice is many runs.
    url = str(tmp_path / "ck")
    weight = torch.randn(2048, 512)
    dcp.save({"w": weight}, storage_writer=CheckpointWriter(url))
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    from torch.distributed.checkpoint.metadata import MetadataIndex

    class SlicePlanner(DefaultLoadPlanner):
        """Loads rows [512, 768) x columns [128, 384) of w into a 256x256 tensor."""

        def create_local_plan(self):
            item = ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex("w", (0, 0)),
                dest_offsets=torch.Size((0, 0)),
                storage_index=MetadataIndex("w", (0, 0)),
                storage_offsets=torch.Size((512, 128)),
                lengths=torch.Size((256, 256)),
            )
            return LoadPlan([item])

    out = {"w": torch.zeros(256, 256)}
    reader = CheckpointReader(url, verify_checksums=False)
    dcp.load(out, storage_reader=reader, planner=SlicePlanner())
    assert torch.equal(out["w"], weight[512:768, 128:384])
    snap = reader.store.stats.snapshot()
    # 256 rows of 1 KiB runs with 1 KiB gaps: read as one covering span,
    # about 2x the slice, never the 4 MiB tensor.
    assert snap.bytes_read < 2 * 256 * 256 * 4 + 4096, snap
    # With checksum verification (the default) the reader reads the whole
    # 1 MiB frames covering the span (rows 512-767 are bytes [1, 1.5) MiB),
    # verifies them, and still not the 4 MiB tensor.
    out["w"].zero_()
    reader = CheckpointReader(url)
    dcp.load(out, storage_reader=reader, planner=SlicePlanner())
    assert torch.equal(out["w"], weight[512:768, 128:384])
    assert reader.store.stats.snapshot().bytes_read == 1 << 20
    assert reader.frame_stats.verified == 1


def test_interop_with_torch_writers_and_readers(make_backend) -> None:
    state = _sample_state()
    flat = {k: v for k, v in state.items() if k != "nested"}
    for kind in ("local", "moto"):
        backend = make_backend(kind)
        opts = backend.storage_options
        # dcp_ext writes -> torch reads.
        ours = backend.url("ours")
        dcp.save(state, storage_writer=CheckpointWriter(ours, storage_options=opts))
        loaded = zeros_like_state(state)
        torch_reader = FileSystemReader(ours) if kind == "local" else FsspecReader(ours, **opts)
        dcp.load(loaded, storage_reader=torch_reader)
        assert_same_state(state, loaded)
        # torch writes -> dcp_ext reads.
        theirs = backend.url("theirs")
        torch_writer = FileSystemWriter(theirs) if kind == "local" else FsspecWriter(theirs, **opts)
        dcp.save(flat, storage_writer=torch_writer)
        loaded = zeros_like_state(flat)
        dcp.load(loaded, storage_reader=CheckpointReader(theirs, storage_options=opts))
        assert_same_state(flat, loaded)
    # And with torch's own FsspecReader on memory://.
    url = "memory://interop/ck"
    dcp.save(flat, storage_writer=CheckpointWriter(url))
    loaded = zeros_like_state(flat)
    dcp.load(loaded, storage_reader=FsspecReader(url))
    assert_same_state(flat, loaded)


def test_metadata_is_json_and_written_last(tmp_path) -> None:
    url = tmp_path / "ck"
    dcp.save({"w": torch.arange(10.0)}, storage_writer=CheckpointWriter(url))
    doc = json.loads((url / "dcp_ext.metadata.json").read_text())
    assert doc["format"] == "dcp_ext" and doc["version"] == 3
    assert doc["state_dict"]["w"] == {
        "kind": "tensor", "dtype": "float32", "size": [10], "requires_grad": False, "table": [0, 1],
    }
    item = stored_items(url)["w"]
    raw = (url / item["file"]).read_bytes()
    start = item["at"] + item["data_at"]
    assert raw[start : start + item["data_length"]] == torch.arange(10.0).numpy().tobytes()
    ((name, size, index_at, index_length, _),) = doc["files"]
    assert name == item["file"] and size == len(raw) == index_at + index_length  # its frame index last
    # Metadata comes after the data: dcp_ext's JSON (the commit), then torch's
    # .metadata, the newest file (a directory with .metadata alone is never a
    # crashed dcp_ext save: dcp_ext/root.py).
    names = [".metadata", "dcp_ext.metadata.json", item["file"]]
    mtimes = [os.stat(url / n).st_mtime_ns for n in names]
    assert mtimes == sorted(mtimes, reverse=True)


def test_existing_checkpoint_is_protected_then_overwritten_cleanly(tmp_path) -> None:
    url = tmp_path / "ck"
    dcp.save({"a": torch.ones(3)}, storage_writer=CheckpointWriter(url, files_per_rank=3))
    with pytest.raises(dcp_ext.CheckpointExistsError, match="overwrite=True") as info:
        dcp_ext.save({"a": torch.zeros(3)}, url)
    assert isinstance(info.value, FileExistsError)
    out = {"a": torch.zeros(3)}
    dcp_ext.load(out, url)
    assert torch.equal(out["a"], torch.ones(3))  # untouched
    dcp_ext.save({"a": torch.full((3,), 7.0), "b": torch.ones(2)}, url, overwrite=True, files_per_rank=2)
    out = {"a": torch.zeros(3), "b": torch.zeros(2)}
    dcp_ext.load(out, url)
    assert torch.equal(out["a"], torch.full((3,), 7.0))
    # The new data went beside the old (which stayed loadable until the commit); the old files are gone.
    names = sorted(os.listdir(url))
    assert names == [".metadata", "__0_g1_0.distcp", "__0_g1_1.distcp", "dcp_ext.metadata.json"]
    dcp_ext.save({"a": torch.full((3,), 8.0)}, url, overwrite=True, files_per_rank=2)
    assert sorted(os.listdir(url)) == [".metadata", "__0_0.distcp", "dcp_ext.metadata.json"]  # one item: one file


def test_restricted_unpickler_refuses_code(tmp_path) -> None:
    """A torch-style checkpoint whose .metadata would run code is refused."""
    url = tmp_path / "evil"
    dcp.save({"a": torch.ones(2)}, storage_writer=FileSystemWriter(str(url)))
    marker = tmp_path / "pwned"
    (url / ".metadata").write_bytes(code_running_pickle(marker))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="posix.system|os.system"):
        dcp_ext.load({"a": torch.zeros(2)}, url)
    assert not marker.exists()


def test_saves_skip_dcps_per_key_wrapping_unless_a_value_is_stateful(tmp_path, monkeypatch) -> None:
    """dcp_ext's saves go straight to DCP's _save_state_dict when no top-level
    value is Stateful (dcp.save would wrap each key in its call logger first),
    and through dcp.save, whose wrapping calls state_dict(), when one is;
    both load back bit-exact."""
    from torch.distributed.checkpoint import state_dict_saver

    wrapped: list[int] = []
    original = state_dict_saver._stateful_to_state_dict

    def recording(state_dict):  # type: ignore[no-untyped-def]
        wrapped.append(len(state_dict))
        return original(state_dict)

    monkeypatch.setattr(state_dict_saver, "_stateful_to_state_dict", recording)
    state = {key: value for key, value in _sample_state().items() if key != "nested"}  # its BytesIO is refused
    dcp_ext.save(state, tmp_path / "plain")
    assert wrapped == []
    dest = zeros_like_state(state)
    dcp_ext.load(dest, tmp_path / "plain")
    assert_same_state(dest, state)

    class Counter:
        def __init__(self) -> None:
            self.value = torch.arange(4)
            self.saved = 0

        def state_dict(self) -> dict[str, torch.Tensor]:
            self.saved += 1
            return {"value": self.value}

        def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
            self.value = state_dict["value"]

    counter = Counter()
    dcp_ext.save({**state, "counter": counter}, tmp_path / "stateful")
    assert wrapped == [len(state) + 1] and counter.saved == 1
    restored = Counter()
    restored.value = torch.zeros(4, dtype=torch.int64)
    dest = zeros_like_state(state)
    dcp_ext.load({**dest, "counter": restored}, tmp_path / "stateful")
    assert_same_state(dest, state)
    assert torch.equal(restored.value, torch.arange(4))


def test_stock_save_pauses_the_collector_on_the_main_thread_only(tmp_path) -> None:
    """Stock dcp.save on the main thread: the cyclic collector is paused from
    the writer's set_up_storage_writer through DCP's local plan, the plan
    exchange, the global plan and write_data to the end of finish, and runs again afterwards. The
    same save on another thread (where dcp.async_save runs it) pauses
    nothing. A save that fails between the hooks ends the pause at the
    writer's next reset; dcp_ext.save ends it on failure."""
    import gc
    import threading

    from torch.distributed.checkpoint import DefaultSavePlanner

    seen: list[bool] = []

    class Recording(DefaultSavePlanner):
        fail = False

        def create_local_plan(self):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().create_local_plan()

        def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("planning failed")
            return super().create_global_plan(all_plans)

        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().resolve_data(write_item)

    state = _sample_state()
    assert gc.isenabled()
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "main")), planner=Recording())
    assert seen and not any(seen) and gc.isenabled()
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=CheckpointReader(str(tmp_path / "main")))
    assert_same_state(dest, state)

    seen.clear()
    other = threading.Thread(target=lambda: dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "thread")),
                                                     planner=Recording()))
    other.start()
    other.join()
    assert seen and all(seen) and gc.isenabled()
    assert (tmp_path / "thread" / ".metadata").exists()

    seen.clear()
    failing = Recording()
    failing.fail = True
    writer = CheckpointWriter(str(tmp_path / "failed"))
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException (a BaseException)
        dcp.save(state, storage_writer=writer, planner=failing)
    assert "planning failed" in repr(getattr(failed.value, "failures", failed.value))
    assert seen == [False, False] and not gc.isenabled()  # write_data and finish never came
    writer.reset()
    assert gc.isenabled()
    with pytest.raises(BaseException) as failed:
        dcp_ext.save(state, tmp_path / "failed2", planner=failing)
    assert "planning failed" in repr(getattr(failed.value, "failures", failed.value))
    assert seen[-1] is False and gc.isenabled()


def test_stock_load_pauses_the_collector_from_plan_exchange_to_the_last_read(tmp_path) -> None:
    """Stock dcp.load: the cyclic collector is paused from the reader's
    prepare_local_plan through DCP's plan exchange and global plan to the end
    of read_data, and runs again afterwards; reading metadata alone leaves it
    running; a stock load that fails in between ends the pause at the reader's
    next reset, or when the lease runs out; dcp_ext.load ends it on failure."""
    import gc
    import time

    from torch.distributed.checkpoint import DefaultLoadPlanner

    from dcp_ext._runtime import GcLease

    seen: list[bool] = []

    class Recording(DefaultLoadPlanner):
        fail = False

        def create_global_plan(self, global_plan):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            if self.fail:
                raise RuntimeError("planning failed")
            return super().create_global_plan(global_plan)

        def finish_plan(self, new_plan):  # type: ignore[no-untyped-def]
            seen.append(gc.isenabled())
            return super().finish_plan(new_plan)

    state = _sample_state()
    dcp.save(state, storage_writer=CheckpointWriter(str(tmp_path / "c")))
    assert gc.isenabled()
    reader = CheckpointReader(str(tmp_path / "c"))
    reader.read_metadata()  # inspecting a checkpoint pauses nothing afterwards
    assert gc.isenabled()
    dest = zeros_like_state(state)
    dcp.load(dest, storage_reader=reader, planner=Recording())
    assert seen == [False, False] and gc.isenabled()
    assert_same_state(dest, state)

    failing = Recording()
    failing.fail = True
    with pytest.raises(BaseException) as failed:  # DCP's CheckpointException (a BaseException)
        dcp.load(zeros_like_state(state), storage_reader=reader, planner=failing)
    assert "planning failed" in repr(getattr(failed.value, "failures", failed.value))
    assert seen == [False, False, False] and not gc.isenabled()  # read_data never came
    reader.reset()
    assert gc.isenabled()
    # dcp_ext.load ends the pause itself when the load fails before read_data.
    with pytest.raises(BaseException) as failed:
        dcp_ext.load(zeros_like_state(state), tmp_path / "c", planner=failing)
    assert "planning failed" in repr(getattr(failed.value, "failures", failed.value))
    assert seen[-1] is False and gc.isenabled()

    lease = GcLease(0.2)
    assert not gc.isenabled()
    time.sleep(0.6)
    assert gc.isenabled()
    lease.release()  # after the time limit: nothing more to end
    assert gc.isenabled()
