"""The storage contract: every backend (memory, local, moto S3, SeaweedFS S3) passes it."""

from __future__ import annotations

import os
import random

import pytest

from dcp_ext._ranges import Piece, plan_requests
from dcp_ext.config import IOConfig
from dcp_ext.errors import CheckpointCorruptError, CheckpointNotFoundError, DcpExtError
from dcp_ext.storage import Store, open_store
from dcp_ext.storage import TMP_MARK
from tests.support.backends import Backend

MiB = 1024 * 1024
CONFIG = IOConfig(part_size=5 * MiB, max_concurrency=3, read_request_size=1 * MiB)


def _store(backend: Backend, config: IOConfig = CONFIG) -> Store:
    return open_store(backend.url(), config, backend.storage_options)


def _payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _visible(store: Store) -> list[str]:
    return store.list_names()


def test_commit_makes_file_visible_and_durable(backend: Backend) -> None:
    store = _store(backend)
    assert not store.root_exists()
    store.ensure_root()
    data = _payload(300_000)
    writer = store.open_writer("a.distcp")
    writer.write(data[:1000])
    writer.write(memoryview(data)[1000:])
    assert writer.position == len(data)
    # Nothing under the final name before commit.
    assert not store.exists("a.distcp")
    assert "a.distcp" not in _visible(store)
    writer.commit()
    assert store.exists("a.distcp")
    assert store.read_file("a.distcp") == data
    assert _visible(store) == ["a.distcp"]
    assert store.root_exists()
    snap = store.stats.snapshot()
    assert (snap.files_written, snap.bytes_written) == (1, len(data))


def test_abort_leaves_nothing(backend: Backend) -> None:
    store = _store(backend)
    store.ensure_root()
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_writer("b.distcp") as writer:
            writer.write(_payload(12 * MiB))  # S3: two parts already uploading
            raise RuntimeError("boom")
    assert not store.exists("b.distcp")
    assert [n for n in _visible(store) if "b.distcp" in n] == []
    if backend.server is not None:
        client = backend.server.boto3_client()
        bucket, prefix = backend.root[5:].split("/", 1)
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        assert [u for u in uploads if u["Key"].endswith("b.distcp")] == []
    if backend.name == "local":
        assert not any(TMP_MARK in n for n in os.listdir(store.url))


def test_multipart_stream_round_trip(backend: Backend) -> None:
    store = _store(backend)
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
    if backend.server is not None:
        client = backend.server.boto3_client()
        bucket, prefix = backend.root[5:].split("/", 1)
        key = store.describe("big.distcp")[len(f"s3://{bucket}/"):]
        etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
        assert etag.strip('"').endswith("-3"), etag  # 5 + 5 + 3 MiB parts
    # A stream that ends exactly on a part boundary (no short last part).
    exact = _payload(2 * CONFIG.part_size, seed=3)
    writer = store.open_writer("exact.distcp", size_hint=len(exact))
    writer.write(exact[: CONFIG.part_size])
    writer.write(exact[CONFIG.part_size:])
    writer.commit()
    assert store.read_file("exact.distcp") == exact


def test_ranged_reads_merge_split_and_count(backend: Backend) -> None:
    store = _store(backend)
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


def test_read_past_end_is_a_corruption_error(backend: Backend) -> None:
    store = _store(backend)
    store.ensure_root()
    with store.open_writer("t.distcp") as writer:
        writer.write(_payload(1000))
        writer.commit()
    buf = bytearray(100)
    with pytest.raises(CheckpointCorruptError, match="t.distcp"):
        store.read(plan_requests([Piece("t.distcp", 950, memoryview(buf))], gap=0, max_request=MiB))


def test_missing_files(backend: Backend) -> None:
    store = _store(backend)
    store.ensure_root()
    with pytest.raises(CheckpointNotFoundError, match="nothing.json") as info:
        store.read_file("nothing.json")
    assert isinstance(info.value, FileNotFoundError)
    buf = bytearray(10)
    with pytest.raises(DcpExtError, match="nothing.distcp"):
        store.read(plan_requests([Piece("nothing.distcp", 0, memoryview(buf))], gap=0, max_request=MiB))
    assert not store.exists("nothing.distcp")
    store.delete("nothing.distcp")  # deleting a missing file is fine


def test_small_files_replace_atomically_and_delete(backend: Backend) -> None:
    store = _store(backend)
    store.ensure_root()
    store.write_file("meta.json", b"v1")
    store.write_file("meta.json", b"version two")
    assert store.read_file("meta.json") == b"version two"
    assert _visible(store) == ["meta.json"]
    store.delete("meta.json")
    assert not store.exists("meta.json")
    assert _visible(store) == []


def test_directories_heads_and_sizes(backend: Backend) -> None:
    root = _store(backend)
    root.ensure_root()
    root.write_file("top.json", b"{}")
    url = backend.url("child")
    parent = open_store(url.rsplit("/", 1)[0] if "://" in url else os.path.dirname(url), CONFIG, backend.storage_options)
    child = open_store(url, CONFIG, backend.storage_options)
    child.ensure_root()
    child.write_file("a.bin", b"0123456789")
    assert os.path.basename(url.rstrip("/")) in parent.list_dirs()
    assert child.list_dirs() == []
    assert child.size("a.bin") == 10
    assert child.read_head("a.bin", 4) == b"0123"
    assert child.read_head("a.bin", 100) == b"0123456789"  # short at the end of the file
    assert child.read_range("a.bin", 3, 5) == b"34567"
    child.write_file("3f/b.bin", b"x")  # a key-prefix sub-directory (IOConfig.key_prefixes)
    child.delete("a.bin")
    child.remove_root_if_empty()
    assert child.list_names() == []
    name = os.path.basename(url.rstrip("/"))
    assert name in parent.list_dirs()  # 3f/b.bin is still there
    child.delete("3f/b.bin")
    child.remove_root_if_empty()
    # Gone from the listing (SeaweedFS keeps empty directories until their own key is deleted),
    # so a deleted checkpoint is not found again, as an unfinished save, by every later sweep.
    assert name not in parent.list_dirs()
    assert not child.root_exists()
