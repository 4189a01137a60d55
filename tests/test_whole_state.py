"""dcp_ext.whole_state.load_whole: the whole checkpoint as a nested dict, no template.

Checked bit-exact against the saved state (model, Adam with its integer
parameter keys, non-tensor values) for checkpoints written by dcp_ext
(uncompressed and zstd) and by torch's own writers, on local disk and on S3
(SeaweedFS).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

import dcp_ext
from dcp_ext.whole_state import load_whole, restore_optimizer_keys
from tests.support.compare import assert_same_state
from tests.support.whole_states import NotPlainData, trained, training_state


def _write(kind: str, state: dict, url: str, storage_options: dict | None = None) -> None:
    if kind == "torch":
        writer = FileSystemWriter(url) if "://" not in url else FsspecWriter(url, **(storage_options or {}))
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        dcp_ext.save(state, url, storage_options=storage_options, compression=None if kind == "raw" else "zstd")


@pytest.mark.parametrize("kind", ["raw", "zstd", "torch"])
def test_bit_exact_local(tmp_path, kind: str) -> None:
    state = training_state()
    _write(kind, state, str(tmp_path / "ckpt"))
    loaded = load_whole(tmp_path / "ckpt")
    assert_same_state(state, loaded, kind)
    assert sorted(loaded["optimizer"]["state"]) == [0, 1, 2, 3]
    assert loaded["optimizer"]["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_bit_exact_s3(make_backend) -> None:
    backend = make_backend("seaweedfs")
    state = training_state(seed=1)
    for kind in ("raw", "zstd", "torch"):
        url = backend.url(kind)
        _write(kind, state, url, backend.storage_options)
        assert_same_state(state, load_whole(url, storage_options=backend.storage_options), kind)


def test_loaded_optimizer_state_resumes_training(tmp_path) -> None:
    """The restored integer keys are what optimizer.load_state_dict needs:
    a fresh Adam given the loaded state takes the same next step."""
    model, optimizer = trained(steps=3)
    dcp_ext.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "c",
                 compression="zstd")
    loaded = load_whole(tmp_path / "c")
    fresh_model, _ = trained(steps=0, seed=5)
    fresh_model.load_state_dict(loaded["model"])
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded["optimizer"])
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(9))
    for m, opt in ((model, optimizer), (fresh_model, fresh)):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    assert_same_state(model.state_dict(), fresh_model.state_dict(), "model after one more step")
    assert_same_state(optimizer.state_dict(), fresh.state_dict(), "optimizer after one more step")


def test_name_keyed_optimizer_and_never_stepped_optimizer(tmp_path) -> None:
    """get_optimizer_state_dict's parameter-name keys stay strings; an optimizer
    that never stepped (empty ``state``, which DCP does not store) gets ``{}``."""
    model, optimizer = trained(steps=1)
    idle = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"named": get_optimizer_state_dict(model, optimizer), "idle": idle.state_dict()}
    dcp_ext.save(state, tmp_path / "c")
    loaded = load_whole(tmp_path / "c")
    assert_same_state(state, loaded)
    assert sorted(loaded["named"]["state"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert loaded["idle"]["state"] == {}


def test_restore_rule_touches_only_parameter_ids() -> None:
    state = {"opt": {"state": {"0": 1, "7": 2, "x": 3, "01": 4}, "param_groups": [{"params": [0, 1]}]},
             "plain": {"0": "kept"}}
    restore_optimizer_keys(state)
    assert state["opt"]["state"] == {0: 1, "7": 2, "x": 3, "01": 4}
    assert state["plain"] == {"0": "kept"}


def test_values_that_are_not_plain_data(tmp_path) -> None:
    dcp_ext.save({"w": torch.ones(3), "obj": NotPlainData("x")}, tmp_path / "c")
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"'obj'.*weights_only=False"):
        load_whole(tmp_path / "c")
    assert load_whole(tmp_path / "c", weights_only=False)["obj"] == NotPlainData("x")


def test_selected_keys_and_errors(tmp_path) -> None:
    state = training_state()
    dcp_ext.save(state, tmp_path / "c")
    only = load_whole(tmp_path / "c", keys=["model", "optimizer.param_groups."])
    assert sorted(only) == ["model", "optimizer"]
    assert_same_state(state["model"], only["model"])
    assert sorted(only["optimizer"]) == ["param_groups", "state"]  # no tensors read for state
    with pytest.raises(dcp_ext.CheckpointKeyError, match="none of the keys"):
        load_whole(tmp_path / "c", keys=["nothing"])
    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="missing"):
        load_whole(tmp_path / "missing")
