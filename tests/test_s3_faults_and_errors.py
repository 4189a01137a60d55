"""Transient S3 faults are retried (boundedly); every bad input gets a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_ext
from dcp_ext import CheckpointReader, IOConfig, RetryPolicy
from tests.support.backends import BUCKET
from tests.support.fault_proxy import FaultPlan, FaultProxy
from tests.support.metadata_edit import sign
from tests.support.s3_servers import SEAWEEDFS_READONLY_ACCESS_KEY, SEAWEEDFS_READONLY_SECRET_KEY
from tests.support.states import zeros_like_state

MiB = 1024 * 1024
FAST_RETRY = RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05)


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(1024, 1024 + i, generator=g) for i in range(6)} | {"step": 3}


def _is_upload_part(method: str, path: str) -> bool:
    return method == "PUT" and "partNumber" in parse_qs(urlsplit(path).query)


def test_transient_faults_are_retried_and_data_is_exact(moto_server) -> None:
    state = _state()  # ~24 MiB: 5 parts of 5 MiB
    url = f"s3://{BUCKET}/faults-{uuid.uuid4().hex[:8]}/ck"
    config = IOConfig(part_size=5 * MiB, read_request_size=2 * MiB, max_concurrency=4, retry=FAST_RETRY)
    plan = FaultPlan(rate=0.2, faults=("slowdown", "internal", "reset", "truncate", "delay"), delay=0.3, seed=21)
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        options = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        dcp_ext.save(state, url, storage_options=options, config=config)
        save_faults = len(proxy.faults())
        loaded = zeros_like_state(state)
        dcp_ext.load(loaded, url, storage_options=options, config=config)
        faults = proxy.faults()
        kinds = {f.fault for f in faults}
        requests = len(proxy.log)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
    assert loaded["step"] == 3
    assert save_faults >= 3 and len(faults) - save_faults >= 3, (save_faults, len(faults))
    assert kinds == {"slowdown", "internal", "reset", "truncate", "delay"}, kinds
    assert requests > len(faults)
    # No multipart upload was left behind by retried parts.
    client = moto_server.boto3_client()
    assert client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []


def test_retries_are_bounded_and_a_failed_upload_is_aborted(moto_server) -> None:
    url = f"s3://{BUCKET}/bounded-{uuid.uuid4().hex[:8]}/ck"
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.02)
    config = IOConfig(part_size=5 * MiB, max_concurrency=2, retry=policy)
    # (SlowDown gets more attempts, paced: tests/test_s3_request_rate.py)
    plan = FaultPlan(rate=1.0, faults=("internal",), match=_is_upload_part)
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        options = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        start = time.monotonic()
        with pytest.raises(dcp_ext.StorageError, match="InternalError") as info:
            dcp_ext.save({"w": torch.randn(3 * MiB)}, url, storage_options=options, config=config)
        elapsed = time.monotonic() - start
        attempts: dict[str, int] = {}
        for entry in proxy.log:
            if _is_upload_part(entry.method, entry.path):
                number = parse_qs(urlsplit(entry.path).query)["partNumber"][0]
                attempts[number] = attempts.get(number, 0) + 1
    assert "__0_0.distcp" in str(info.value)
    assert attempts and set(attempts.values()) == {3}, attempts  # exactly max_attempts each
    assert elapsed < 20, elapsed
    client = moto_server.boto3_client()
    prefix = url[len(f"s3://{BUCKET}/"):]
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    assert listed == []  # no data object, no metadata
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    assert uploads == []  # aborted


def test_s3_access_errors_are_clear(seaweedfs_server) -> None:
    good = seaweedfs_server.storage_options()
    url = f"s3://{BUCKET}/errors-{uuid.uuid4().hex[:8]}/ck"
    dcp_ext.save({"w": torch.ones(4)}, url, storage_options=good)
    retry = IOConfig(retry=RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.02))

    wrong_secret = dict(good, secret="not-the-secret")
    with pytest.raises(dcp_ext.CredentialsError, match="credentials") as info:
        dcp_ext.load({"w": torch.zeros(4)}, url, storage_options=wrong_secret, config=retry)
    assert isinstance(info.value, PermissionError)
    with pytest.raises(dcp_ext.CredentialsError):
        dcp_ext.save({"w": torch.ones(4)}, url + "2", storage_options=wrong_secret, config=retry)

    no_credentials = {k: v for k, v in good.items() if k not in ("key", "secret")}
    with pytest.raises(dcp_ext.CredentialsError, match="AWS_ACCESS_KEY_ID"):
        dcp_ext.load({"w": torch.zeros(4)}, url, storage_options=no_credentials, config=retry)

    read_only = dict(good, key=SEAWEEDFS_READONLY_ACCESS_KEY, secret=SEAWEEDFS_READONLY_SECRET_KEY)
    loaded = {"w": torch.zeros(4)}
    dcp_ext.load(loaded, url, storage_options=read_only)  # reading is allowed
    assert torch.equal(loaded["w"], torch.ones(4))
    with pytest.raises(dcp_ext.StoragePermissionError, match="access denied") as info:
        dcp_ext.save({"w": torch.ones(4)}, url + "-ro", storage_options=read_only, config=retry)
    assert isinstance(info.value, PermissionError)

    for call in (
        lambda: dcp_ext.load({"w": torch.zeros(4)}, "s3://no-such-bucket-x/ck", storage_options=good),
        lambda: dcp_ext.save({"w": torch.ones(4)}, "s3://no-such-bucket-x/ck", storage_options=good),
    ):
        with pytest.raises(dcp_ext.BucketNotFoundError, match="no-such-bucket-x") as info:
            call()
        assert isinstance(info.value, FileNotFoundError)

    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="does not exist"):
        dcp_ext.load({"w": torch.zeros(4)}, url + "-missing", storage_options=good)

    unreachable = seaweedfs_server.storage_options(endpoint_url="http://127.0.0.1:9")  # discard port: nothing listens
    start = time.monotonic()
    with pytest.raises(dcp_ext.StorageError, match="endpoint_url"):
        dcp_ext.load({"w": torch.zeros(4)}, url, storage_options=unreachable, config=retry)
    assert time.monotonic() - start < 15


def test_local_errors_are_clear(tmp_path) -> None:
    target = {"w": torch.zeros(4)}
    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="does not exist"):
        dcp_ext.load(target, tmp_path / "missing")

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(dcp_ext.NotACheckpointError, match="not a DCP checkpoint"):
        dcp_ext.load(target, tmp_path / "notes")
    with pytest.raises(dcp_ext.NotACheckpointError, match="is a file"):
        dcp_ext.load(target, tmp_path / "notes" / "readme.txt")

    incomplete = tmp_path / "incomplete"
    dcp_ext.save({"w": torch.ones(4)}, incomplete)
    (incomplete / "dcp_ext.metadata.json").unlink()
    (incomplete / ".metadata").unlink()
    with pytest.raises(dcp_ext.CheckpointIncompleteError, match="incomplete"):
        dcp_ext.load(target, incomplete)
    # Stock dcp.load wraps it, but our message survives inside.
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=CheckpointReader(incomplete))
    assert "is incomplete: it has 1 data file(s) but no metadata" in str(info.value)

    garbled = tmp_path / "garbled"
    dcp_ext.save({"w": torch.ones(4)}, garbled)
    (garbled / "dcp_ext.metadata.json").write_text('{"format": "dcp_ext", "version": 1, "state')
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="dcp_ext.metadata.json is not valid JSON"):
        dcp_ext.load(target, garbled)

    truncated = tmp_path / "truncated"
    dcp_ext.save({"w": torch.ones(1000)}, truncated)
    data = truncated / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1500])
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="__0_0.distcp is shorter"):
        dcp_ext.load({"w": torch.zeros(1000)}, truncated)

    hostile = tmp_path / "hostile"
    dcp_ext.save({"w": torch.ones(4)}, hostile)
    doc = json.loads((hostile / "dcp_ext.metadata.json").read_text().replace('"__0_0.distcp"', '"../../etc/passwd"'))
    (hostile / "dcp_ext.metadata.json").write_bytes(sign(doc))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="not a plain relative name"):
        dcp_ext.load(target, hostile)


def test_local_permission_denied(tmp_path) -> None:
    """Saving where the process may not write gives StoragePermissionError."""
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:
        locked.chmod(0o555)
        undo = ["chmod", "755", str(locked)]
    else:
        # Root ignores file modes; an immutable directory refuses even root.
        result = subprocess.run(["chattr", "+i", str(locked)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"running as root and chattr +i is unavailable: {result.stderr.strip()}")
        undo = ["chattr", "-i", str(locked)]
    try:
        with pytest.raises(dcp_ext.StoragePermissionError, match="permission denied") as info:
            dcp_ext.save({"w": torch.ones(2)}, locked / "ck")
        assert isinstance(info.value, PermissionError)
        assert str(locked / "ck") in str(info.value)
    finally:
        subprocess.run(undo, check=True)


def test_one_rank_failing_fails_every_rank_promptly(moto_server) -> None:
    """Rank 1's endpoint answers every upload with 503 SlowDown: both ranks
    fail within seconds (not at the collective timeout) with the same error,
    no metadata and no ``newest`` are written, and no multipart upload stays."""
    from tests.support import dist_workers
    from tests.support.dist import run_world

    prefix = f"onerank-{uuid.uuid4().hex[:8]}"
    root = f"s3://{BUCKET}/{prefix}"
    plan = FaultPlan(rate=1.0, faults=("slowdown",), match=lambda method, path: method in ("PUT", "POST"))
    with FaultProxy(moto_server.endpoint_url, plan) as proxy:
        options = [moto_server.storage_options(), moto_server.storage_options(endpoint_url=proxy.endpoint_url)]
        results = run_world(2, dist_workers.faulty_rank_world, root, options, timeout=120)
        injected = len(proxy.faults())
    print(results, injected)
    assert injected >= 3
    assert [r["error"] for r in results] == ["StorageError", "StorageError"], results
    assert results[0]["message"] == results[1]["message"]
    assert "SlowDown" in results[0]["message"] and "model_rank1.distcp" in results[0]["message"]
    assert max(r["seconds"] for r in results) < 20, results
    client = moto_server.boto3_client()
    names = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
    assert not [n for n in names if n.endswith(("newest", "metadata.json", ".metadata"))], names
    assert names == [], names  # rank 0's committed data file was removed too
    assert client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) == []


def test_one_stores_writers_share_a_bounded_part_pool(moto_server) -> None:
    """The files a rank writes at once (model and optimizer shards) share one
    pool of ``max_concurrency + 1`` part buffers; a writer aborted mid-file
    gives its buffers back, so the others finish."""
    import threading
    import tracemalloc

    from dcp_ext.storage import open_store

    config = IOConfig(part_size=5 * MiB, max_concurrency=2)
    store = open_store(f"s3://{BUCKET}/pool-{uuid.uuid4().hex[:8]}/ck", config,
                       moto_server.storage_options())
    store.ensure_root()
    payloads = {name: os.urandom(4 * config.part_size + 123) for name in ("a.distcp", "b.distcp", "c.distcp")}
    errors: list[BaseException] = []

    def write(name: str) -> None:
        try:
            with store.open_writer(name, size_hint=len(payloads[name])) as writer:
                view = memoryview(payloads[name])
                for start in range(0, len(view), 3 * MiB):
                    writer.write(view[start:start + 3 * MiB])
                    if name == "c.distcp" and start >= 2 * config.part_size:
                        raise RuntimeError("abort c")
                writer.commit()
        except RuntimeError as err:
            if "abort c" not in str(err):
                errors.append(err)
        except BaseException as err:
            errors.append(err)

    tracemalloc.start()
    try:
        threads = [threading.Thread(target=write, args=(name,)) for name in payloads]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not any(thread.is_alive() for thread in threads), "a writer hung waiting for a part buffer"
    assert errors == []
    # 3 pooled 5 MiB buffers plus ~3 MiB of HTTP clients and short last
    # parts; a pool per writer would hold 9 buffers (45 MiB).
    assert peak <= 4 * config.part_size, peak / MiB
    for name in ("a.distcp", "b.distcp"):
        assert store.read_file(name) == payloads[name]
    assert not store.exists("c.distcp")
