"""dcp_ext.integrations.torch_checkpointing: a torch_checkpointing 0.1.1 ``Storage`` on dcp_ext's stores.

In one process (torch_checkpointing's asynchronous saver spawns its own):

* conformance: every ``Storage`` method (writes of every buffer kind,
  ``torch.save`` into ``stream_write``, full and ranged reads with
  ``seek``/``readinto``, missing files, ``ls``/``glob``/``exists``/``isdir``,
  each row of the ``rename`` table, ``delete``, ``rmdir``, ``mkdir``) against
  torch_checkpointing's own ``LocalFileSystemStorage``: dcp_ext's storage on
  a local path gives the same outcomes except that a failed ``stream_write``
  leaves no partial file; on SeaweedFS also the same except where object
  stores have no directories (each difference listed). What a storage wrote
  is checked through a side door (``os``, boto3); the config pickles;
* ``CheckpointManager`` (model, AdamW state, plain values) saved and loaded
  bit-exact on SeaweedFS: synchronously with torch_checkpointing's default
  commit (a temporary directory renamed: a copy on S3) and with
  ``write_to_temp_dir=False`` + ``commit_marker``, then asynchronously (the
  config pickled into the spawned saver process); the marker seals the
  directory (a second save there is refused before it writes), ``rmdir``
  un-commits first. Locally the temporary directory is renamed with ``os.rename``;
* how a save reaches S3 (what the module doc's "Throughput on object stores"
  says), from the requests the store sends: each file one multipart upload
  whose parts are in flight together (the first two parts of a file wait for
  each other: sent one at a time, the save would fail), the files of
  torch_checkpointing's ``file_write_max_threads`` threads uploaded at once
  (their first parts wait for each other too), a file under one part one
  PUT, no other request but the directory's seal check and the marker.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.checkpoint_writer import CallbackArgs
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

from dcp_ext.errors import InvalidOptionError
from dcp_ext.storage.s3 import S3Store
from dcp_ext.integrations.torch_checkpointing import (
    COMMIT_MARKER,
    DcpExtStorage,
    DcpExtStorageConfig,
    commit_marker,
    is_committed,
)
from tests.support.compare import state_diff
from tests.support.doc_examples import run_examples
from tests.support.torch_checkpointing_cases import PAYLOAD, config_round_trip, exercise, outcome

#: Where dcp_ext's storage on a local path differs from torch_checkpointing's local backend, by design.
LOCAL_DIFFERENCES = {
    "after failed stream_write": (True, False),  # theirs leaves the partial file; ours never shows one
}
#: ... and on an object store: no directories (mkdir creates nothing, a write needs no parent).
OBJECT_STORE_DIFFERENCES = {
    **LOCAL_DIFFERENCES,
    "isdir after mkdir": (True, False),
    "stream_write missing parent": ("raises RuntimeError", None),
    "delete directory": ("raises IsADirectoryError", "raises FileNotFoundError"),
    "mkdir not recursive, missing parent": ("raises FileNotFoundError", None),
}


def _reference(tmp_path: Path) -> dict[str, Any]:
    return exercise(LocalFileSystemStorageConfig(use_direct_io=False).create_storage(), tmp_path / "reference")


def _compare(reference: dict[str, Any], ours: dict[str, Any], differences: dict[str, Any]) -> None:
    assert set(reference) == set(ours)
    for key, value in reference.items():
        if key in differences:
            assert (value, ours[key]) == differences[key], (key, value, ours[key])
        elif key == "ls":  # the partial file (local backend), the empty directory "sub" (object stores)
            assert set(ours[key]) == set(value) - {"partial.bin"} - ({"sub"} if "isdir after mkdir" in differences else set())
        else:
            assert ours[key] == value, (key, value, ours[key])


def test_storage_conformance_local(tmp_path: Path) -> None:
    reference = _reference(tmp_path)
    assert reference["rename directory -> populated"] == "raises FileExistsError"  # the table, as the reference has it
    ours = exercise(config_round_trip(DcpExtStorageConfig()), tmp_path / "ours")
    _compare(reference, ours, LOCAL_DIFFERENCES)
    # Side door: the files are where a local path says (bytes.bin deleted after the listing), no temporary left.
    assert sorted(os.listdir(tmp_path / "ours" / "d")) == sorted(set(ours["ls"]) - {"bytes.bin"})
    assert (tmp_path / "ours" / "d" / "stream.bin").stat().st_size == len(PAYLOAD)


def test_storage_conformance_seaweedfs(make_backend, tmp_path: Path) -> None:
    backend = make_backend("seaweedfs")
    url = backend.url("tc")
    storage = config_round_trip(DcpExtStorageConfig(storage_options=backend.storage_options,
                                                    io_options={"read_request_size": "64KiB"}))
    ours = exercise(storage, Path(url))  # a Path, as torch_checkpointing passes: s3:/bucket/...
    _compare(_reference(tmp_path), ours, OBJECT_STORE_DIFFERENCES)
    # Side door: what the bucket holds (full reads were 4 ranged requests of 64 KiB each).
    bucket, prefix = url[len("s3://"):].split("/", 1)
    client = backend.server.boto3_client()
    keys = {o["Key"][len(prefix) + 1:]: o["Size"] for o in
            client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])}
    assert keys["d/stream.bin"] == len(PAYLOAD) and keys["d/empty.bin"] == 0, keys
    assert not any(k.startswith("r/") for k in keys) and "d/partial.bin" not in keys, keys


def _training_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()  # the optimizer has state to save (and a template to load into)
    return model, optimizer


def _save_and_load(config: Any, path: str) -> list[str]:
    """Save a model, its AdamW state and plain values; load into another
    model and optimizer (other values); the differences."""
    model, optimizer = _training_state(0)
    saved = {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": {"step": 7, "name": "run"}}
    manager = config.build()
    try:
        future = manager.save(path, saved)
        if future is not None:
            future.result(timeout=300)
        fresh, fresh_optimizer = _training_state(1)
        loaded = manager.load(path, into={"model": fresh.state_dict(), "optim": fresh_optimizer.state_dict(),
                                          "extra": None})
    finally:
        manager.close()
    return state_diff(saved, dict(loaded))


def _marker_config(options: dict[str, Any], asynchronous: bool = False) -> Any:
    config = CheckpointManager.Config.with_async_save() if asynchronous else CheckpointManager.Config.with_sync_save()
    config.storage_config = DcpExtStorageConfig(storage_options=options)
    config.save.writer_config.write_to_temp_dir = False
    config.finalize_callback = commit_marker
    return config


def test_checkpoint_manager_on_seaweedfs(make_backend, tmp_path: Path) -> None:
    backend = make_backend("seaweedfs")
    options = backend.storage_options
    root = backend.url("tcm")
    # torch_checkpointing's default commit: a temporary directory, renamed (on S3: copied, then deleted).
    default = CheckpointManager.Config.with_sync_save()
    default.storage_config = DcpExtStorageConfig(storage_options=options)
    assert _save_and_load(default, f"{root}/renamed") == []
    storage = DcpExtStorage(DcpExtStorageConfig(storage_options=options))
    assert storage.ls(Path(root)) == ["renamed"]  # the temporary directory is gone
    assert sorted(storage.ls(Path(f"{root}/renamed"))) == ["extra_0.pt", "model_0.pt", "optim_0.pt"]
    # Written in place, committed by the marker.
    assert _save_and_load(_marker_config(options), f"{root}/marked") == []
    assert is_committed(f"{root}/marked", options) and not is_committed(f"{root}/renamed", options)
    assert COMMIT_MARKER in storage.ls(Path(f"{root}/marked"))
    # Sealed: a second save there is refused before it writes anything; rmdir un-commits it first.
    manager = _marker_config(options).build()
    with pytest.raises(FileExistsError, match="committed checkpoint"):
        manager.save(f"{root}/marked", {"model": torch.nn.Linear(2, 2).state_dict()})
    manager.close()
    storage.rmdir(Path(f"{root}/marked"))
    assert not is_committed(f"{root}/marked", options) and not storage.exists(Path(f"{root}/marked"))
    # Asynchronous: the storage config is pickled into torch_checkpointing's spawned saver process.
    assert _save_and_load(_marker_config(options, asynchronous=True), f"{root}/async") == []
    assert is_committed(f"{root}/async", options)


def test_s3_save_sends_parts_and_files_in_parallel(make_backend, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend("seaweedfs")
    options = backend.storage_options
    where = backend.url("parallel") + "/step_1"
    meeting: dict[str, threading.Barrier] = {}
    sent: list[tuple[str, str]] = []  # (method, file)
    lock = threading.Lock()
    call = S3Store.call

    def meet(name: str) -> None:
        """The two parties named ``name`` each wait here for the other (a minute at most)."""
        with lock:
            barrier = meeting.setdefault(name, threading.Barrier(2, timeout=60))
        barrier.wait()

    def recorded(self: S3Store, method: str, doing: str, key: str | None = None, **kwargs: Any) -> Any:
        name = (key or "").rsplit("/", 1)[-1]
        number = int(kwargs.get("PartNumber", 0))
        with lock:
            sent.append((method, name))
        if method == "upload_part" and number in (1, 2):
            meet(f"parts of {name}")  # part 2 is sent while part 1 is in flight
        if method == "upload_part" and number == 1:
            meet("files")  # model_0.pt's first part is in flight while optim_0.pt's is
        return call(self, method, doing, key, **kwargs)

    monkeypatch.setattr(S3Store, "call", recorded)
    torch.manual_seed(3)
    saved = {"model": {"w": torch.randn(3 << 20)}, "optim": {"m": torch.randn(3 << 20)}, "step": 5}  # 12 MiB each
    config = _marker_config(options)
    config.storage_config = DcpExtStorageConfig(storage_options=options,
                                                io_options={"part_size": "5MiB", "max_concurrency": 4})
    config.save.writer_config.file_write_max_threads = 2
    manager = config.build()
    try:
        assert manager.save(where, saved) is None
        monkeypatch.setattr(S3Store, "call", call)
        loaded = manager.load(where, into={"model": {"w": torch.zeros(3 << 20)}, "optim": {"m": torch.zeros(3 << 20)},
                                           "step": None})
    finally:
        manager.close()
    assert state_diff(saved, dict(loaded)) == []
    counts = Counter(sent)
    # Every request of the save (12 MiB + torch.save's framing: 3 parts of 5 MiB per file), and nothing else:
    # no listing, no HEAD per file; mkdir checks the bucket and the seal once for the directory.
    files = {(method, name): n for name in ("model_0.pt", "optim_0.pt") for method, n in
             (("create_multipart_upload", 1), ("upload_part", 3), ("complete_multipart_upload", 1))}
    assert counts == Counter({**files, ("put_object", "step_0.pt"): 1, ("head_bucket", ""): 1,
                              ("head_object", COMMIT_MARKER): 1, ("put_object", COMMIT_MARKER): 1}), counts
    assert is_committed(where, options)


def test_local_save_renames_the_temporary_directory(tmp_path: Path) -> None:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = DcpExtStorageConfig()
    assert _save_and_load(config, str(tmp_path / "step_1")) == []
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    assert sorted(os.listdir(tmp_path / "step_1")) == ["extra_0.pt", "model_0.pt", "optim_0.pt"]


def test_settings_are_checked_and_the_marker_needs_dcp_ext_storage(tmp_path: Path) -> None:
    with pytest.raises(InvalidOptionError, match="io_options: .*max_concurency"):
        DcpExtStorageConfig(io_options={"max_concurency": 2})
    with pytest.raises(InvalidOptionError, match="storage_options must be a dict"):
        DcpExtStorageConfig(storage_options="s3")  # type: ignore[arg-type]
    storage = DcpExtStorageConfig(io_options={"max_concurrency": 3, "read_request_size": "1MiB"}).create_storage()
    assert (storage.mmap_fill_workers, storage.mmap_fill_chunk_bytes) == (3, 1 << 20)
    local = LocalFileSystemStorageConfig().create_storage()
    args = CallbackArgs(path=str(tmp_path), storage=local, event_logger=None)  # type: ignore[arg-type]
    assert outcome(lambda: commit_marker(args)) == "raises ValueError"  # InvalidOptionError, naming the fix


def test_documented_examples_run(tmp_path: Path) -> None:
    """The torch_checkpointing examples of README.md and the framework guide run as written."""
    blocks = {("README.md", "torch-checkpointing"): tmp_path / "readme",
              ("docs/guides/integrations.md", "torch-checkpointing-guide"): tmp_path / "guide"}
    assert run_examples(blocks) == {}
    assert sorted(os.listdir(tmp_path / "guide" / "ckpt" / "step_1")) == [COMMIT_MARKER, "model_0.pt", "step_0.pt"]
