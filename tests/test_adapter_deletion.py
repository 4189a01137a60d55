"""Every delete path of the framework adapters goes by dcp_ext's one deletion rule
(:func:`dcp_ext.root.delete_checkpoint_dir`).

Before, ``remove_checkpoint`` of the Lightning plug-ins (and torchtitan's purge)
deleted every file under the path: Lightning's ``last.ckpt`` link
(``ModelCheckpoint(save_last="link")``) had its *target* emptied and stayed, so
a kept top-k checkpoint was wiped whenever Lightning removed a previous link; a
plain directory with no checkpoint in it went whole (with or without a trailing
slash), and so did a user's files inside a checkpoint. Now a link is removed,
never followed; only a checkpoint dcp_ext wrote is deleted (un-committed
first), and of it only dcp_ext's files; anything else is refused with
``ForeignCheckpointError`` and left as it was. Local disk, SeaweedFS, a real
Lightning ``Trainer`` and torchtitan's purge thread; processes killed in the
middle of a save and of a deletion.
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_ext import CheckpointWriter
from dcp_ext.config import IOConfig
from dcp_ext.errors import CheckpointInUseError, ForeignCheckpointError, InvalidPathError
from dcp_ext.guard import SaveLock
from dcp_ext.integrations import _checkpoint_dirs as dirs
from dcp_ext.root import delete_checkpoint_dir
from dcp_ext.storage import Location, open_store
from tests.support.adapter_deletion_workers import (
    delete_killed_after_uncommit,
    file_tree,
    frameworks_suite,
    save_killed_before_commit,
    small_state,
)
from tests.support.compare import state_diff
from tests.support.dist import context, process, run_world

OWN = {".metadata", "dcp_ext.metadata.json"}


@pytest.fixture(scope="module")
def plugins() -> tuple[type, type]:
    warnings.filterwarnings("ignore", module="lightning")
    from dcp_ext.integrations.lightning import DcpExtCheckpointIO, DcpExtModelParallelStrategy

    return DcpExtCheckpointIO, DcpExtModelParallelStrategy


def _saved(io: object, path: Path | str, seed: int) -> dict:
    state = small_state(seed)
    io.save_checkpoint(state, str(path))  # type: ignore[attr-defined]
    return state


def _loads_exact(io: object, path: Path | str, state: dict) -> list[str]:
    return state_diff(state, io.load_checkpoint(str(path)))  # type: ignore[attr-defined]


def test_removing_a_link_removes_the_link_only(plugins, tmp_path: Path) -> None:
    """``last.ckpt`` -> ``epoch=1.ckpt`` (relative, as Lightning links it), with
    and without a trailing slash: the link goes, the kept checkpoint stays whole
    and loads bit-exact."""
    io = plugins[0]()
    state = _saved(io, tmp_path / "epoch=1.ckpt", 1)
    before = file_tree(str(tmp_path / "epoch=1.ckpt"))
    assert OWN <= set(before)
    for link in ("last.ckpt", "last-v1.ckpt"):
        os.symlink("epoch=1.ckpt", tmp_path / link)
    io.remove_checkpoint(str(tmp_path / "last.ckpt"))
    io.remove_checkpoint(str(tmp_path / "last-v1.ckpt") + "/")
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt"]
    assert file_tree(str(tmp_path / "epoch=1.ckpt")) == before
    assert _loads_exact(io, tmp_path / "epoch=1.ckpt", state) == []


def test_a_link_pointing_outside_leaves_its_target(plugins, tmp_path: Path) -> None:
    """Links to a checkpoint and to a plain directory outside the checkpoint
    folder, and a dangling one: each link goes, no target is touched."""
    io, strategy = plugins[0](), plugins[1]()
    elsewhere = tmp_path / "elsewhere"
    state = _saved(io, elsewhere / "best.ckpt", 2)
    (elsewhere / "data").mkdir()
    (elsewhere / "data" / "x.bin").write_bytes(b"user data")
    before = file_tree(str(elsewhere))
    folder = tmp_path / "ckpts"
    folder.mkdir()
    os.symlink("../elsewhere/best.ckpt", folder / "last.ckpt")
    os.symlink(str(elsewhere / "data"), folder / "data.ckpt")
    os.symlink(str(tmp_path / "gone"), folder / "dangling.ckpt")
    io.remove_checkpoint(str(folder / "last.ckpt"))
    strategy.remove_checkpoint(str(folder / "data.ckpt"))
    io.remove_checkpoint(str(folder / "dangling.ckpt"))
    assert os.listdir(folder) == []
    assert file_tree(str(elsewhere)) == before
    assert _loads_exact(io, elsewhere / "best.ckpt", state) == []


@pytest.mark.parametrize("slash", ["", "/"])
def test_a_plain_directory_is_refused(plugins, tmp_path: Path, slash: str) -> None:
    """``userdata/sub/x.bin``: removing ``userdata/sub`` or ``userdata`` (and a
    plain file) is refused by both plug-ins, naming the path; nothing changes."""
    io, strategy = plugins[0](), plugins[1]()
    (tmp_path / "userdata" / "sub").mkdir(parents=True)
    (tmp_path / "userdata" / "sub" / "x.bin").write_bytes(b"precious")
    (tmp_path / "userdata" / "plain.ckpt").write_bytes(b"a torch.save file")
    before = file_tree(str(tmp_path))
    for target in ("userdata/sub", "userdata"):
        for remover in (io, strategy):
            with pytest.raises(ForeignCheckpointError, match="holds no checkpoint dcp_ext wrote") as info:
                remover.remove_checkpoint(str(tmp_path / target) + slash)
            assert info.value.path == str(tmp_path / target) and str(tmp_path / target) in str(info.value)
            assert isinstance(info.value, PermissionError)
    with pytest.raises(ForeignCheckpointError, match="is a file, not a checkpoint directory"):
        io.remove_checkpoint(str(tmp_path / "userdata" / "plain.ckpt") + slash)
    assert file_tree(str(tmp_path)) == before


def test_a_checkpoint_goes_and_the_users_files_stay(plugins, tmp_path: Path) -> None:
    """A checkpoint with data under key prefixes, a user's file, sub-directory
    and links in it: dcp_ext's files all go (commit markers first), the user's
    stay with the directory, and then the directory is refused as not dcp_ext's.
    The strategy deletes its ``meta.pt`` with its checkpoint; the directory
    goes when nothing else is left."""
    io, strategy = plugins[0](), plugins[1]()
    path = tmp_path / "epoch=0.ckpt"
    config = IOConfig.from_env().with_overrides(key_prefixes=3)
    dirs.save_alone(small_state(0), CheckpointWriter(path, config=config))
    written = set(file_tree(str(path)))
    assert any("/" in name for name in written), written  # data files under key-prefix directories
    (tmp_path / "outside.bin").write_bytes(b"outside")
    (path / "notes.txt").write_bytes(b"mine")
    (path / "mine").mkdir()
    (path / "mine" / "keep.bin").write_bytes(b"keep")
    os.symlink(str(tmp_path / "outside.bin"), path / "link.bin")
    report = delete_checkpoint_dir(path)
    assert list(report.deleted[:2]) == [".metadata", "dcp_ext.metadata.json"]
    assert set(report.deleted) == written and set(report.kept) == {"notes.txt", "mine/keep.bin", "link.bin"}
    assert file_tree(str(path)) == {"notes.txt": b"mine", "mine/keep.bin": b"keep",
                                    "link.bin": "-> " + str(tmp_path / "outside.bin")}
    assert (tmp_path / "outside.bin").read_bytes() == b"outside"
    with pytest.raises(ForeignCheckpointError):
        io.remove_checkpoint(str(path))

    # The strategy's checkpoint: DCP shards plus meta.pt (written before the commit).
    from dcp_ext.integrations._lightning_common import _MetaWriter

    for extra in (False, True):
        path = tmp_path / f"fsdp-{extra}.ckpt"
        dirs.save_alone(small_state(1), CheckpointWriter(path, before_commit=_MetaWriter(b"loops and callbacks")))
        assert "meta.pt" in os.listdir(path)
        if extra:
            (path / "notes.txt").write_bytes(b"mine")
        strategy.remove_checkpoint(str(path))
        assert (os.listdir(path) == ["notes.txt"]) if extra else not os.path.lexists(path)
    # Its single-file mode (the stock strategy's torch.save file) is deleted as the stock strategy does.
    single = tmp_path / "single.ckpt"
    single.write_bytes(b"torch.save")
    plugins[1](save_distributed_checkpoint=False).remove_checkpoint(str(single))
    assert not single.exists()
    # A missing checkpoint is not an error.
    io.remove_checkpoint(str(tmp_path / "never-saved.ckpt"))


def test_torch_writers_checkpoint_is_refused(plugins, tmp_path: Path) -> None:
    """A checkpoint of torch's ``FileSystemWriter``: refused by both plug-ins
    and the function; every file stays and torch's reader loads it bit-exact."""
    io, strategy = plugins[0](), plugins[1]()
    path = tmp_path / "torch.ckpt"
    saved = {"w": torch.randn(16, 8), "step": torch.tensor(7)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    before = file_tree(str(path))
    for remove in (io.remove_checkpoint, strategy.remove_checkpoint, delete_checkpoint_dir):
        with pytest.raises(ForeignCheckpointError, match="written by torch's own writer") as info:
            remove(str(path))
        assert info.value.path == str(path)
    assert file_tree(str(path)) == before
    loaded = {"w": torch.zeros(16, 8), "step": torch.tensor(0)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    assert state_diff(saved, loaded) == []


def test_a_live_save_a_failed_save_and_a_cut_off_deletion(plugins, tmp_path: Path) -> None:
    """A live save's lock: refused (``CheckpointInUseError``), nothing deleted.
    A save killed before its commit leaves data and its lock: deleted (the
    lock of a dead process is taken over). A deletion killed right after its
    un-commit leaves data files in a directory that no longer looks committed
    (what torchtitan's step search and Lightning's loads go by), and the
    next deletion finishes it. A root's tag directory is refused."""
    io = plugins[0]()
    busy = tmp_path / "busy.ckpt"
    state = _saved(io, busy, 3)
    before = file_tree(str(busy))
    lock = SaveLock(open_store(str(busy), IOConfig.from_env()), "a-save-in-progress")
    lock.acquire()
    try:
        with pytest.raises(CheckpointInUseError, match="in progress") as info:
            io.remove_checkpoint(str(busy))
        assert info.value.path == str(busy)
    finally:
        lock.release()
    assert file_tree(str(busy)) == before and _loads_exact(io, busy, state) == []

    ctx = context()
    failed, cut = tmp_path / "failed.ckpt", tmp_path / "cut.ckpt"
    _saved(io, cut, 4)
    children = [process(ctx, target, (str(path),))
                for target, path in ((save_killed_before_commit, failed), (delete_killed_after_uncommit, cut))]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [-signal.SIGKILL] * 2
    for path in (failed, cut):
        left = set(os.listdir(path))
        assert ".dcp_ext.saving" in left and any(n.endswith(".distcp") for n in left), left
        assert not left & OWN and not dirs.is_committed(Location.of(path)), left
        io.remove_checkpoint(str(path))
        assert not path.exists()

    root = tmp_path / "root"
    (root / "step1_partial").mkdir(parents=True)
    (root / "newest").write_text("step1")
    with pytest.raises(InvalidPathError, match=r"CheckpointRoot\(.*\)\.delete\('step1'\)"):
        delete_checkpoint_dir(root / "step1_partial")


def test_s3_checkpoint_and_plain_prefix(plugins, make_backend) -> None:
    """SeaweedFS: a checkpoint with a user's object goes but for that object (a
    second, trailing slash, goes whole); a plain prefix is refused at both
    levels, with and without a trailing slash, and so is a plain object; the
    other checkpoint loads bit-exact throughout. Listed through boto3."""
    backend = make_backend("seaweedfs")
    io = plugins[0](storage_options=backend.storage_options)
    url = backend.url("adapters")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    client = backend.server.boto3_client()

    def keys() -> set[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        return {o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", [])
                if not o["Key"].endswith("/")}

    _saved(io, f"{url}/epoch=0.ckpt", 0)
    kept = _saved(io, f"{url}/epoch=1.ckpt", 1)
    client.put_object(Bucket=bucket, Key=f"{prefix}/epoch=0.ckpt/notes.txt", Body=b"mine")
    client.put_object(Bucket=bucket, Key=f"{prefix}/userdata/sub/x.bin", Body=b"precious")
    client.put_object(Bucket=bucket, Key=f"{prefix}/plain.ckpt", Body=b"a torch.save file")
    epoch1 = {k for k in keys() if k.startswith("epoch=1.ckpt/")}
    assert {"epoch=1.ckpt/dcp_ext.metadata.json", "epoch=1.ckpt/.metadata"} <= epoch1

    io.remove_checkpoint(f"{url}/epoch=0.ckpt")
    assert keys() == {"epoch=0.ckpt/notes.txt", "userdata/sub/x.bin", "plain.ckpt"} | epoch1
    assert _loads_exact(io, f"{url}/epoch=1.ckpt", kept) == []
    for target in ("userdata/sub", "userdata", "userdata/sub/", "userdata/", "epoch=0.ckpt"):
        with pytest.raises(ForeignCheckpointError, match="holds no checkpoint dcp_ext wrote") as info:
            io.remove_checkpoint(f"{url}/{target}")
        assert info.value.path == f"{url}/{target}".rstrip("/")
    with pytest.raises(ForeignCheckpointError, match="is a file"):
        io.remove_checkpoint(f"{url}/plain.ckpt")
    assert client.get_object(Bucket=bucket, Key=f"{prefix}/userdata/sub/x.bin")["Body"].read() == b"precious"
    io.remove_checkpoint(f"{url}/epoch=1.ckpt/")
    assert keys() == {"epoch=0.ckpt/notes.txt", "userdata/sub/x.bin", "plain.ckpt"}


def test_lightning_trainer_and_torchtitan_purge(tmp_path: Path) -> None:
    """One process (a 1-rank gloo world).

    Lightning: 4 epochs, ``save_top_k=2``, ``save_last="link"`` named
    ``last-{epoch}`` (so each previous link is handed to ``remove_checkpoint``):
    the two newest epochs stay and load bit-exact (model, AdamW state, step),
    and the one link names the newest. Before, removing ``last-epoch=2.ckpt``
    emptied the kept ``epoch=2-step=6.ckpt``.

    torchtitan: ``keep_latest_k=2`` over steps 1-4 in a folder holding a
    torch-written ``step-0``: the purge refuses ``step-0`` (left byte for byte),
    deletes ``step-1`` but for the user's ``notes.txt``, deletes ``step-2``;
    steps 3 and 4 resume bit-exact.
    """
    out = run_world(1, frameworks_suite, str(tmp_path), timeout=300)[0]
    lightning = out["lightning"]
    assert lightning["epochs"] == [0, 1, 2, 3]
    assert lightning["listing"] == ["epoch=2-step=6.ckpt", "epoch=3-step=8.ckpt", "last-epoch=3.ckpt"], lightning
    assert lightning["links"] == {"last-epoch=3.ckpt": "epoch=3-step=8.ckpt"}
    assert lightning["loads"] == {"epoch=2-step=6.ckpt": [], "epoch=3-step=8.ckpt": []}, lightning["loads"]

    titan = out["torchtitan"]
    assert titan["steps"] == ["step-0", "step-1", "step-3", "step-4"], titan["steps"]
    assert titan["foreign_same"] is True
    assert titan["step1"] == {"notes.txt": b"mine"}
    assert titan["committed"] == {"step-0": True, "step-1": False, "step-3": True, "step-4": True}
    for step, (loaded, diff) in titan["resumed"].items():
        assert loaded is True and diff == [], (step, diff[:10])
