"""A third-party store, added without touching dcp_ext (issue 42): a small
store class defined here passes the contract suite by class alone
(``StoreTests.store_factory``) and through ``register_store``, saves and loads
checkpoints by its own URL scheme, and is found through the
``dcp_ext.stores`` entry point group of an installed distribution."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_ext
from dcp_ext import IOConfig
from dcp_ext.errors import CheckpointNotFoundError
from dcp_ext.storage import Location, ObjectWriter, ReadRequest, Store, register_store, registered_schemes
from dcp_ext.storage import _registry
from dcp_ext.testing.store import StoreTests
from dcp_ext.testing.store import Location as Space

# The toy storage: one process-wide dict of full paths -> (bytes, mtime).
_OBJECTS: dict[str, tuple[bytes, float]] = {}
_LOCK = threading.Lock()


class _ToyWriter(ObjectWriter):
    def __init__(self, store: ToyStore, name: str) -> None:
        super().__init__(name)
        self._store, self._parts = store, bytearray()

    def write(self, data: memoryview | bytes | bytearray) -> None:
        self._parts += memoryview(data).cast("B")
        self.position += memoryview(data).nbytes

    def commit(self) -> None:
        self._store.write_file(self.name, bytes(self._parts))
        self._store.stats.add_written_file(len(self._parts))

    def abort(self) -> None:
        self._parts = bytearray()


class ToyStore(Store):
    """A checkpoint under ``toy://prefix``, kept in this process's memory: the smallest complete :class:`Store`."""

    kind = "toy"

    def __init__(self, url: str, config: IOConfig, storage_options: dict[str, Any] | None = None,
                 options: Any = None) -> None:
        super().__init__(url, config)
        self.root = url.split("://", 1)[1].strip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_file(self, name: str) -> bytes:
        with _LOCK:
            found = _OBJECTS.get(self._path(name))
        if found is None:
            raise CheckpointNotFoundError(f"{self.describe(name)} does not exist", self.describe(name))
        return found[0]

    def write_file(self, name: str, data: bytes) -> None:
        with _LOCK:
            _OBJECTS[self._path(name)] = (bytes(data), time.time())

    def create_exclusive(self, name: str, data: bytes) -> bool:
        with _LOCK:
            if self._path(name) in _OBJECTS:
                return False
            _OBJECTS[self._path(name)] = (bytes(data), time.time())
            return True

    def modified(self, name: str) -> float | None:
        with _LOCK:
            found = _OBJECTS.get(self._path(name))
        if found is None:
            raise CheckpointNotFoundError(f"{self.describe(name)} does not exist", self.describe(name))
        return found[1]

    def open_writer(self, name: str, size_hint: int | None = None) -> ObjectWriter:
        return _ToyWriter(self, name)

    def _run_reads(self, requests: Sequence[ReadRequest]) -> None:
        for request in requests:
            data = self.read_file(request.name)
            if request.offset + request.length > len(data):
                raise self._short_read(request.name, request.offset, request.length, len(data) - request.offset)
            for at, view in request.targets:
                start = request.offset + at
                view[:] = data[start : start + view.nbytes]
            self._finished(request)

    def exists(self, name: str) -> bool:
        with _LOCK:
            return self._path(name) in _OBJECTS

    def delete(self, name: str) -> None:
        with _LOCK:
            _OBJECTS.pop(self._path(name), None)

    def _under(self) -> list[str]:
        with _LOCK:
            return [k[len(self.root) + 1:] for k in _OBJECTS if k.startswith(self.root + "/")]

    def list_names(self) -> list[str]:
        return sorted(n for n in self._under() if "/" not in n)

    def list_dirs(self) -> list[str]:
        return sorted({n.split("/", 1)[0] for n in self._under() if "/" in n})

    def list_tree(self) -> list[str]:
        return sorted(self._under())

    def remove_root_if_empty(self) -> None:
        pass

    def root_exists(self) -> bool:
        return bool(self._under())

    def ensure_root(self) -> None:
        pass


@pytest.fixture(scope="module", autouse=True)
def _registered() -> Any:
    register_store("toy", ToyStore)
    yield
    with _registry._LOCK:
        _registry._FACTORIES.pop("toy", None)


class TestToyStoreByClass(StoreTests):
    """The contract with the class alone (not looked up by scheme)."""

    store_factory = ToyStore

    @pytest.fixture
    def location(self, request: pytest.FixtureRequest) -> Space:
        return (lambda name: f"toy://class/{request.node.name}/{name}"), {}


class TestToyStoreRegistered(StoreTests):
    """The contract through the registry, as dcp_ext opens stores."""

    @pytest.fixture
    def location(self, request: pytest.FixtureRequest) -> Space:
        return (lambda name: f"toy://registry/{request.node.name}/{name}"), {}


def test_checkpoints_save_and_load_on_a_registered_scheme(tmp_path: Path) -> None:
    assert "toy" in registered_schemes()
    assert isinstance(Location("toy://x/y").open(), ToyStore)
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    dcp_ext.save(state, "toy://ckpt/one", compression="zstd")
    back = {"w": torch.zeros(3, 4), "step": torch.tensor(0)}
    dcp_ext.load(back, "toy://ckpt/one")
    assert torch.equal(back["w"], state["w"]) and int(back["step"]) == 7
    assert dcp_ext.verify("toy://ckpt/one").ok
    manager = dcp_ext.CheckpointManager("toy://root", retention=dcp_ext.KeepLast(1))
    model = torch.nn.Linear(4, 4)
    for step in (1, 2):
        manager.save(f"step{step}", model)
    assert manager.tags() == ["step2"]
    with pytest.raises(ValueError, match="already served"):
        register_store("toy", lambda *a: None)  # type: ignore[arg-type,return-value]


def test_an_installed_package_adds_a_scheme_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on the path declaring ``toy2 = ...`` in the ``dcp_ext.stores``
    group serves ``toy2://`` the first time it is opened, without any call."""
    (tmp_path / "toy2_plugin.py").write_text(textwrap.dedent("""
        from tests.test_store_registry import ToyStore

        def open_toy2(url, config, storage_options, options):
            return ToyStore(url, config, storage_options, options)
    """))
    info = tmp_path / "toy2_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy2-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dcp_ext.stores]\ntoy2 = toy2_plugin:open_toy2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registry, "_ENTRY_POINTS_READ", False)
    try:
        store = Location("toy2://plugged/in").open()
        assert type(store).__name__ == "ToyStore" and "toy2" in registered_schemes()
        dcp_ext.save({"x": torch.ones(3)}, "toy2://plugged/ck")
        back = {"x": torch.zeros(3)}
        dcp_ext.load(back, "toy2://plugged/ck")
        assert torch.equal(back["x"], torch.ones(3))
    finally:
        with _registry._LOCK:
            _registry._FACTORIES.pop("toy2", None)
        sys.modules.pop("toy2_plugin", None)


def test_one_location_value_through_the_public_entry_points(tmp_path: Path) -> None:
    """A Location (URL + options + config + backend options) is accepted
    wherever a path is; the manager's option groups mean what the keyword
    arguments mean, and giving both is refused."""
    from dcp_ext.storage import S3Options

    config = IOConfig(frame_size=64 * 1024)
    where = Location(str(tmp_path / "ck"), {}, config)
    writer = dcp_ext.CheckpointWriter(where, compression="zstd")
    assert writer.location == where and writer.config.frame_size == 64 * 1024 and writer.path == where.url
    state = {"w": torch.arange(6.0)}
    torch.distributed.checkpoint.save(state, storage_writer=writer)
    back = {"w": torch.zeros(6)}
    dcp_ext.load(back, where)
    assert torch.equal(back["w"], state["w"])
    assert dcp_ext.verify(where).ok and dcp_ext.CheckpointReader(where).path == where.url
    root = Location(str(tmp_path / "root"), {}, config)
    manager = dcp_ext.CheckpointManager(root, incremental=dcp_ext.IncrementalOptions(True, max_chain=1))
    assert manager.checkpoints.location == root and manager.incremental_options.max_chain == 1
    model = torch.nn.Linear(4, 4)
    manager.save("a", model)
    manager.save("full", model, partial=False, full=dcp_ext.FullSaveOptions(full_format="torch"))
    assert (tmp_path / "root" / "full").is_file()
    with pytest.raises(ValueError, match="not both"):
        manager.save("b", model, partial=False, full_format="torch", full=dcp_ext.FullSaveOptions())
    with pytest.raises(ValueError, match="not beside it"):
        dcp_ext.CheckpointManager(root, incremental=dcp_ext.IncrementalOptions(True), max_chain=3)
    with pytest.raises(ValueError, match="not both"):
        dcp_ext.CheckpointManager(root, tiers=dcp_ext.TierOptions(str(tmp_path / "t")), replicas=1)
    with pytest.raises(ValueError, match="in the Location"):
        dcp_ext.CheckpointWriter(where, storage_options={"x": 1})
    # S3's own settings object; the IOConfig fields it replaces still work.
    assert S3Options.from_config(IOConfig(s3_read_timeout=7.0)).read_timeout == 7.0
    with pytest.raises(ValueError, match="part_size"):
        S3Options(part_size=1)
    assert Location("s3://b/r/step1_partial").parent() == Location("s3://b/r")
    assert Location("s3://bucket").parent() is None and Location("/x/y").child("z").url == "/x/y/z"
    manager.close()
