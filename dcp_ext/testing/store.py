"""The storage contract every backend passes: :class:`StoreTests`, to subclass in a backend's own test suite.

dcp_ext's own backends (memory, local disk, S3 on moto and SeaweedFS) run it
in ``tests/test_store_contract.py``; a third-party :class:`~dcp_ext.storage.Store`
proves itself the same way::

    import pytest
    from dcp_ext.testing.store import StoreTests

    class TestMyStore(StoreTests):
        @pytest.fixture
        def location(self, tmp_path):
            return lambda name: f"myfs://bucket/{tmp_path.name}/{name}", {"token": "..."}

Each test asks :meth:`StoreTests.location` for fresh URLs, opens stores
from them and checks what it wrote; where a backend can look at its storage
through a side door (the ``side_door_*`` methods, ``None`` by default), the
checks go further (no temporary files or incomplete uploads left, multipart
part counts).

A store class (or any factory ``factory(url, config, storage_options,
options) -> Store``) is enough: set :attr:`StoreTests.store_factory` and the
suite opens its stores with it, registered or not, as zarr's
``StoreTests[store_cls]`` does::

    class TestMyStore(StoreTests):
        store_factory = MyStore

        @pytest.fixture
        def location(self, tmp_path):
            return lambda name: f"myfs://{tmp_path}/{name}", {}

Otherwise stores open through the scheme's registered factory
(:func:`dcp_ext.storage.register_store`), exactly as dcp_ext opens them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from ..config import IOConfig
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, DcpExtError
from ..storage import Location as StoreLocation
from ..storage import Piece, Store, plan_requests

__all__ = ["StoreTests", "Location", "MiB", "CONFIG"]

MiB = 1024 * 1024
#: Small parts and reads, so that multipart uploads and split reads happen on small files.
CONFIG = IOConfig(part_size=5 * MiB, max_concurrency=3, read_request_size=1 * MiB)

#: ``(url_of, storage_options)``: ``url_of(name)`` is a fresh, unused location each call.
Location = tuple[Callable[[str], str], dict[str, Any]]


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


class StoreTests:
    """The contract, as pytest tests; a subclass provides the :meth:`location` fixture.

    Attributes:
        store_factory: Opens the stores under test (a :class:`~dcp_ext.storage.Store`
            subclass or a factory of the registry's signature); ``None``: the
            factory registered for the URL's scheme.
    """

    store_factory: ClassVar[Callable[..., Store] | None] = None

    @pytest.fixture
    def location(self) -> Location:
        """Where the tests may create stores: override in the subclass."""
        raise NotImplementedError("a StoreTests subclass provides a `location` fixture")

    # -- side doors (override where the backend can be looked at directly) -------------
    def side_door_names(self, url: str) -> list[str] | None:
        """Every name the storage holds under ``url``, temporary ones included (``None``: unknown)."""
        return None

    def side_door_incomplete_uploads(self, url: str) -> list[str] | None:
        """Names of incomplete multipart uploads under ``url`` (``None``: no such thing)."""
        return None

    def side_door_parts(self, url: str, name: str) -> int | None:
        """How many parts the object ``name`` under ``url`` was uploaded in (``None``: unknown)."""
        return None

    def open(self, url: str, options: dict[str, Any], config: IOConfig = CONFIG) -> Store:
        """The store at ``url``, through :attr:`store_factory` or the registry."""
        factory = type(self).store_factory
        if factory is not None:
            return factory(url, config, dict(options), None)
        return StoreLocation(url, options, config).open()

    def store(self, location: Location, name: str = "s", config: IOConfig = CONFIG) -> Store:
        url_of, options = location
        return self.open(url_of(name), options, config)

    # -- the contract ------------------------------------------------------------------
    def test_commit_makes_file_visible_and_durable(self, location: Location) -> None:
        store = self.store(location)
        assert not store.root_exists()
        store.ensure_root()
        data = _payload(300_000)
        writer = store.open_writer("a.distcp")
        writer.write(data[:1000])
        writer.write(memoryview(data)[1000:])
        assert writer.position == len(data)
        # Nothing under the final name before commit.
        assert not store.exists("a.distcp")
        assert "a.distcp" not in store.list_names()
        writer.commit()
        assert store.exists("a.distcp")
        assert store.read_file("a.distcp") == data
        assert store.list_names() == ["a.distcp"]
        assert store.root_exists()
        snap = store.stats.snapshot()
        assert (snap.files_written, snap.bytes_written) == (1, len(data))

    def test_abort_leaves_nothing(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        with pytest.raises(RuntimeError, match="boom"):
            with store.open_writer("b.distcp") as writer:
                writer.write(_payload(12 * MiB))  # S3: two parts already uploading
                raise RuntimeError("boom")
        assert not store.exists("b.distcp")
        assert [n for n in store.list_names() if "b.distcp" in n] == []
        uploads = self.side_door_incomplete_uploads(store.url)
        assert uploads is None or [u for u in uploads if u.endswith("b.distcp")] == []
        names = self.side_door_names(store.url)
        assert names is None or not any("b.distcp" in n for n in names), names

    def test_an_aborted_rewrite_leaves_the_committed_file(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        old = _payload(3 * MiB)
        with store.open_writer("c.distcp") as writer:
            writer.write(old)
            writer.commit()
        with pytest.raises(RuntimeError, match="boom"):
            with store.open_writer("c.distcp") as writer:
                writer.write(_payload(12 * MiB, seed=1))  # object stores: parts of the new upload already sent
                raise RuntimeError("boom")
        assert store.read_file("c.distcp") == old
        uploads = self.side_door_incomplete_uploads(store.url)
        assert uploads is None or [u for u in uploads if u.endswith("c.distcp")] == []

    def test_multipart_stream_round_trip(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        data = _payload(13 * MiB + 12345, seed=1)
        writer = store.open_writer("big.distcp", size_hint=len(data))
        view = memoryview(data)
        pos = 0
        rng = random.Random(2)
        while pos < len(data):  # odd-sized writes across part boundaries
            step = rng.choice([17, 4096, 3 * MiB + 5, 700_000])
            writer.write(view[pos : pos + step])
            pos += step
        writer.commit()
        assert store.read_file("big.distcp") == data
        parts = self.side_door_parts(store.url, "big.distcp")
        assert parts is None or parts == 3, parts  # 5 + 5 + 3 MiB parts
        # A stream that ends exactly on a part boundary (no short last part).
        exact = _payload(2 * CONFIG.part_size, seed=3)
        writer = store.open_writer("exact.distcp", size_hint=len(exact))
        writer.write(exact[: CONFIG.part_size])
        writer.write(exact[CONFIG.part_size:])
        writer.commit()
        assert store.read_file("exact.distcp") == exact

    def test_ranged_reads_merge_split_and_count(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        data = _payload(3 * MiB, seed=3)
        with store.open_writer("r.distcp") as writer:
            writer.write(data)
            writer.commit()
        wanted = [(0, 10), (20, 30), (100_000, 5000), (2 * MiB, MiB), (3 * MiB - 7, 7), (50, 0)]
        buffers = [bytearray(n) for _, n in wanted]
        pieces = [Piece("r.distcp", off, memoryview(buf)) for (off, _), buf in zip(wanted, buffers)]
        requests = plan_requests(pieces, gap=64 * 1024, max_request=512 * 1024)
        store.read(requests)
        for (off, n), buf in zip(wanted, buffers):
            assert bytes(buf) == data[off : off + n]
        snap = store.stats.snapshot()
        assert snap.read_requests == len(requests)
        assert snap.bytes_read == sum(r.length for r in requests)
        # [0,10) and [20,50) merge; 100_000 is too far; the 1 MiB piece splits
        # into two direct reads; the tail stands alone; the empty piece is dropped.
        assert [(r.offset, r.length) for r in requests] == [
            (0, 50), (100_000, 5000), (2 * MiB, 512 * 1024), (2 * MiB + 512 * 1024, 512 * 1024),
            (3 * MiB - 7, 7),
        ]
        assert snap.files_read == frozenset({"r.distcp"})

    def test_read_past_end_is_a_corruption_error(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        with store.open_writer("t.distcp") as writer:
            writer.write(_payload(1000))
            writer.commit()
        buf = bytearray(100)
        with pytest.raises(CheckpointCorruptError, match="t.distcp"):
            store.read(plan_requests([Piece("t.distcp", 950, memoryview(buf))], gap=0, max_request=MiB))

    def test_missing_files(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        with pytest.raises(CheckpointNotFoundError, match="nothing.json") as info:
            store.read_file("nothing.json")
        assert isinstance(info.value, FileNotFoundError)
        buf = bytearray(10)
        with pytest.raises(DcpExtError, match="nothing.distcp"):
            store.read(plan_requests([Piece("nothing.distcp", 0, memoryview(buf))], gap=0, max_request=MiB))
        assert not store.exists("nothing.distcp")
        store.delete("nothing.distcp")  # deleting a missing file is fine

    def test_small_files_replace_atomically_and_delete(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        store.write_file("meta.json", b"v1")
        store.write_file("meta.json", b"version two")
        assert store.read_file("meta.json") == b"version two"
        assert store.list_names() == ["meta.json"]
        store.delete("meta.json")
        assert not store.exists("meta.json")
        assert store.list_names() == []

    def test_exclusive_create_has_one_winner(self, location: Location) -> None:
        store = self.store(location)
        store.ensure_root()
        assert store.create_exclusive("lock", b"first")
        assert not store.create_exclusive("lock", b"second")
        assert store.read_file("lock") == b"first"

    def test_racing_creators_have_exactly_one_winner(self, location: Location) -> None:
        """Eight stores of their own (their own clients) create one name at
        once, 10 rounds: exactly one wins each round, and the file holds the
        winner's whole content (the save lock and commit marker rely on it)."""
        url_of, options = location
        url = url_of("race")
        self.open(url, options).ensure_root()
        stores = [self.open(url, options) for _ in range(8)]
        for round_ in range(10):
            name = f"lock{round_}"
            won: list[int] = []
            start = threading.Barrier(len(stores))

            def create(k: int, store: Store, name: str = name, start: threading.Barrier = start,
                       won: list[int] = won) -> None:
                start.wait()
                if store.create_exclusive(name, f"creator {k} ".encode() * 100):
                    won.append(k)

            threads = [threading.Thread(target=create, args=(k, s)) for k, s in enumerate(stores)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(won) == 1, f"round {round_}: {len(won)} creators won: {won}"
            assert stores[0].read_file(name) == f"creator {won[0]} ".encode() * 100

    def test_directories_listings_heads_and_sizes(self, location: Location) -> None:
        parent = self.store(location, "parent")
        parent.ensure_root()
        parent.write_file("top.json", b"{}")
        child = self.open(f"{parent.url.rstrip('/')}/child", location[1])
        child.ensure_root()
        child.write_file("a.bin", b"0123456789")
        assert parent.list_dirs() == ["child"]
        assert parent.list_entries() == (["top.json"], ["child"])
        assert child.list_dirs() == []
        assert child.size("a.bin") == 10
        assert child.read_head("a.bin", 4) == b"0123"
        assert child.read_head("a.bin", 100) == b"0123456789"  # short at the end of the file
        assert child.read_range("a.bin", 3, 5) == b"34567"
        child.write_file("3f/b.bin", b"x")  # a key-prefix sub-directory (IOConfig.key_prefixes)
        assert sorted(child.list_tree()) == ["3f/b.bin", "a.bin"]
        child.delete("a.bin")
        child.remove_root_if_empty()
        assert child.list_names() == []
        assert "child" in parent.list_dirs()  # 3f/b.bin is still there
        child.delete("3f/b.bin")
        child.remove_root_if_empty()
        # Gone from the listing (SeaweedFS keeps empty directories until their own key is deleted),
        # so a deleted checkpoint is not found again, as an unfinished save, by every later sweep.
        assert "child" not in parent.list_dirs()
        assert not child.root_exists()
