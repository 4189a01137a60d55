"""dcp_ext.use_for_dcp: stock dcp.save / async_save / load given only checkpoint_id.

Run against the torch the project installs: what the patch replaces is put
back object for object, calls it does not take over keep torch's behaviour,
and a torch whose storage selection does not look as expected is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import _async_process_executor, _async_thread_executor, _storage_utils
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

import dcp_ext
from dcp_ext.whole_state import load_whole
from dcp_ext.dcp_default import UnsupportedTorchError, active_dcp_default, stop_using_for_dcp, use_for_dcp
from tests.support.compare import assert_same_state
from tests.support.whole_states import training_state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _torch_objects() -> list[object]:
    return [
        _storage_utils._storage_setup,
        state_dict_saver._storage_setup,
        state_dict_loader._storage_setup,
        _async_thread_executor._ThreadBasedAsyncCheckpointExecutor.__dict__["execute_save"],
        _async_process_executor._ProcessBasedAsyncCheckpointExecutor.__dict__["execute_save"],
    ]


@pytest.fixture(autouse=True)
def _torch_restored():
    before = _torch_objects()
    yield
    stop_using_for_dcp()
    assert all(a is b for a, b in zip(before, _torch_objects())), "torch was not restored"


def _written_by_dcp_ext(path: str) -> bool:
    return os.path.exists(os.path.join(path, "dcp_ext.metadata.json"))


def test_save_async_save_and_load_in_a_block(tmp_path) -> None:
    state = training_state()
    before = _torch_objects()
    with use_for_dcp(compression="zstd") as handle:
        assert active_dcp_default() is handle and handle.active
        dcp.save(state, checkpoint_id=str(tmp_path / "a"))
        dcp.save(state, checkpoint_id=tmp_path / "a")  # again: overwrite=True by default
        future = dcp.async_save(state, checkpoint_id=f"file://{tmp_path}/b")
    # The writer was chosen when async_save was called, inside the block.
    future.result()
    assert not handle.active and active_dcp_default() is None
    assert all(a is b for a, b in zip(before, _torch_objects()))
    for name in ("a", "b"):
        assert _written_by_dcp_ext(str(tmp_path / name)), name
        assert_same_state(state, load_whole(tmp_path / name), name)
    with use_for_dcp():
        loaded = training_state(seed=99)  # same structure, other values
        dcp.load(loaded, checkpoint_id=str(tmp_path / "a"))
        assert_same_state(state, loaded)
    # Outside, torch chooses its own writer again.
    dcp.save(state, checkpoint_id=str(tmp_path / "c"))
    assert not _written_by_dcp_ext(str(tmp_path / "c"))
    assert os.path.exists(tmp_path / "c" / ".metadata")


def test_overwrite_false_and_nesting(tmp_path) -> None:
    state = {"w": torch.arange(4.0)}
    outer = use_for_dcp(overwrite=False)  # global, no block
    dcp.save(state, checkpoint_id=str(tmp_path / "x"))
    with pytest.raises(BaseException) as info:
        dcp.save(state, checkpoint_id=str(tmp_path / "x"))
    assert isinstance(dcp_ext.unwrap_checkpoint_exception(info.value), dcp_ext.CheckpointExistsError)
    with use_for_dcp(overwrite=True) as inner:  # the innermost call wins
        assert active_dcp_default() is inner
        dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "x"))
    assert active_dcp_default() is outer
    outer.off()
    outer.off()  # idempotent
    assert active_dcp_default() is None
    assert torch.equal(load_whole(tmp_path / "x")["w"], torch.ones(4))


def test_explicit_writers_and_foreign_ids_stay_torchs(tmp_path) -> None:
    state = {"w": torch.arange(4.0)}
    with use_for_dcp():
        dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "t")))
        with pytest.raises(BaseException, match="Cannot detect which StorageReader or StorageWriter"):
            dcp.save(state, checkpoint_id="no-such-protocol://bucket/x")
    assert os.path.exists(tmp_path / "t" / ".metadata") and not _written_by_dcp_ext(str(tmp_path / "t"))


def test_stock_save_to_s3(make_backend) -> None:
    """What a framework that passes only checkpoint_id does, on SeaweedFS."""
    backend = make_backend("seaweedfs")
    state = training_state(seed=2)
    url = backend.url("stock")
    with use_for_dcp(storage_options=backend.storage_options, compression="zstd"):
        dcp.save(state, checkpoint_id=url)
        dcp.async_save(state, checkpoint_id=url + "-async").result()
        loaded = training_state(seed=99)  # same structure, other values
        dcp.load(loaded, checkpoint_id=url)
    assert_same_state(state, loaded)
    for u in (url, url + "-async"):
        assert_same_state(state, load_whole(u, storage_options=backend.storage_options), u)


def test_unrecognised_torch_is_refused(monkeypatch) -> None:
    """Another patch in place of torch's own _storage_setup (as an unknown torch
    would look) is refused before anything changes."""
    def elsewhere(storage, checkpoint_id, reader=False):  # pragma: no cover - never called
        raise AssertionError

    monkeypatch.setattr(state_dict_saver, "_storage_setup", elsewhere)
    before = _torch_objects()
    with pytest.raises(UnsupportedTorchError, match=r"state_dict_saver\._storage_setup.*Nothing was patched"):
        use_for_dcp()
    assert all(a is b for a, b in zip(before, _torch_objects())) and active_dcp_default() is None
    assert isinstance(UnsupportedTorchError("x"), dcp_ext.DcpExtError)


def test_bad_options_are_refused() -> None:
    with pytest.raises(TypeError, match="no option"):
        use_for_dcp(writer_options={"no_such_option": 1})
    with pytest.raises(TypeError, match="no option"):
        use_for_dcp(reader_options={"storage_options": {}})
    assert active_dcp_default() is None
