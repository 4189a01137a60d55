"""An ``overwrite=True`` save that is killed leaves the checkpoint it replaces
loadable (issue 40, finding 11: Lightning's ``last.ckpt`` was lost in 8 of 8
kills). The new data is written beside the old under free names; the old
checkpoint is un-committed only when every byte of the new one is durable,
just before the new one's own files and metadata go in (a window of a few
small writes, documented). Real processes killed at each crash point, on
local disk and SeaweedFS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_ext
from dcp_ext.errors import CheckpointIncompleteError
from tests.support import forked
from tests.support.backends import backend_for
from tests.support.overwrite_job import model, state
from tests.support.root_cli import REPO, env


def _overwrite(kind: str, path: str, value: float, options: dict[str, Any], crash: str | None) -> int:
    extra = {"DCP_EXT_CRASH_AT": crash} if crash else {}
    # Forked from the suite's fork server (tests/support/forked.py): a process of its own, no fresh interpreter.
    done = forked.run("tests.support.overwrite_job:main", [kind, path, str(value), json.dumps(options)],
                      cwd=REPO, env=env(None, **extra))
    return done.returncode


def _plain_holds(path: str, value: float, options: dict[str, Any]) -> bool:
    want = state(value)
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp_ext.load(back, path, storage_options=options)
    return all(torch.equal(back[k], want[k]) for k in want)


def _manager_holds(root: str, value: float, options: dict[str, Any]) -> bool:
    manager = dcp_ext.CheckpointManager(root, storage_options=options)
    layer = torch.nn.Linear(512, 512)
    result = manager.resume(layer, tag="last")
    manager.close()
    want = model(value)
    return (torch.equal(layer.weight, want.weight) and torch.equal(layer.bias, want.bias)
            and result.user_content == {"value": value})


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_a_killed_overwrite_keeps_the_old_checkpoint(kind: str, request: pytest.FixtureRequest,
                                                     tmp_path: Path) -> None:
    backend = backend_for(kind, request, tmp_path)
    options = backend.storage_options
    # Every point before the commit behaves alike (the old checkpoint is un-committed only in the
    # writer's finish, after before_metadata); two of them here, all four in bench.torture-style runs.
    points = ("mid_data", "before_metadata") if kind == "local" else ("mid_data",)
    plain, root = backend.url("plain"), backend.url("root")
    assert _overwrite("plain", plain, 1.0, options, None) == 0
    assert _overwrite("manager", root, 1.0, options, None) == 0
    for n, point in enumerate(points, start=2):
        for job, path, holds in (("plain", plain, _plain_holds), ("manager", root, _manager_holds)):
            assert _overwrite(job, path, float(n), options, point) == -9, (job, point)
            assert holds(path, 1.0, options), f"{job}: the old checkpoint is lost after a kill at {point}"
    # The next overwrite commits, and nothing of the killed ones stays.
    assert _overwrite("plain", plain, 9.0, options, None) == 0 and _plain_holds(plain, 9.0, options)
    assert _overwrite("manager", root, 9.0, options, None) == 0 and _manager_holds(root, 9.0, options)
    store = dcp_ext.storage.open_store(plain, dcp_ext.IOConfig(), options)
    data = sorted(n for n in store.list_tree() if n.endswith(".distcp"))
    assert len(data) == 2 and len(set(data) & set(dcp_ext.metadata.decode_metadata(
        store.read_file("dcp_ext.metadata.json"), "m").files)) == 2, data


def test_the_commit_window_is_the_documented_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one window the overwrite does not cover: between un-committing the
    old checkpoint and committing the new one, the manager writes its
    partition.json and user content. A failure there (a ``before_commit``
    that raises, as a kill at that moment would stop it) leaves no checkpoint
    at the tag, loudly, never the old data with the new user content; the
    next save's cleanup removes the directory."""
    from dcp_ext.manager._partial import CommitFiles

    root = str(tmp_path / "root")
    assert _overwrite("manager", root, 1.0, {}, None) == 0
    original = CommitFiles.__call__

    def failing(self: Any, store: Any) -> None:
        original(self, store)
        raise RuntimeError("stopped between the commit files and the metadata")

    monkeypatch.setattr(CommitFiles, "__call__", failing)
    manager = dcp_ext.CheckpointManager(root)
    with pytest.raises(RuntimeError, match="stopped between"):
        manager.save("last", model(2.0), user_content={"value": 2.0}, overwrite=True)
    monkeypatch.setattr(CommitFiles, "__call__", original)
    with pytest.raises(CheckpointIncompleteError):
        manager.resume(torch.nn.Linear(512, 512), tag="last")
    manager.save("next", model(3.0))
    assert not (tmp_path / "root" / "last_partial").exists()
    manager.close()
