"""Prove that the real S3 servers from ``tests/support/s3_servers.py`` work end to end."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest

from tests.support.s3_servers import S3Server, start_moto, start_seaweedfs

MiB = 1024 * 1024
PART_SIZE = 5 * MiB  # S3's minimum size for all but the last part
LAST_PART_SIZE = 12345


# --- helpers ---------------------------------------------------------------


def _bucket_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(ip, port) of every TCP socket in LISTEN state owned by process ``pid``."""
    psutil = pytest.importorskip("psutil")
    return {
        (conn.laddr.ip, conn.laddr.port)
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    }


# --- tests -----------------------------------------------------------------


def test_boto3_multipart_upload_and_ranged_get(s3_server: S3Server) -> None:
    client = s3_server.boto3_client()
    bucket = s3_server.create_bucket(_bucket_name("mpu"))
    key = "dir/multipart.bin"
    parts_data = [os.urandom(PART_SIZE) for _ in range(3)] + [os.urandom(LAST_PART_SIZE)]
    data = b"".join(parts_data)

    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, chunk in enumerate(parts_data, start=1):
        resp = client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk
        )
        parts.append({"PartNumber": number, "ETag": resp["ETag"]})
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )

    assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == len(data)
    # A slice crossing the part-1/part-2 boundary (Range end is inclusive).
    start, end = PART_SIZE - 1000, 2 * PART_SIZE + 999
    resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
    assert resp["Body"].read() == data[start : end + 1]
    # The short tail.
    start = len(data) - LAST_PART_SIZE - 7
    resp = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-")
    assert resp["Body"].read() == data[start:]
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == data


def test_s3fs_round_trip(s3_server: S3Server) -> None:
    s3fs = pytest.importorskip("s3fs")
    fs = s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True)
    bucket = s3_server.create_bucket(_bucket_name("fs"))
    small = os.urandom(256 * 1024 + 3)
    path = f"{bucket}/ckpt/small.bin"

    fs.pipe_file(path, small)
    assert fs.cat_file(path) == small
    assert fs.cat_file(path, start=1000, end=5000) == small[1000:5000]
    assert fs.cat_file(path, start=-10) == small[-10:]
    assert fs.ls(f"{bucket}/ckpt", detail=False) == [path]

    # A streamed write large enough for s3fs to use a multipart upload.
    big = os.urandom(2 * PART_SIZE + 77)
    big_path = f"{bucket}/ckpt/big.bin"
    with fs.open(big_path, "wb", block_size=PART_SIZE) as f:
        for i in range(0, len(big), MiB):
            f.write(big[i : i + MiB])
    fs.invalidate_cache()
    assert fs.size(big_path) == len(big)
    assert fs.cat_file(big_path, start=PART_SIZE - 5, end=PART_SIZE + 5) == big[
        PART_SIZE - 5 : PART_SIZE + 5
    ]
    assert sorted(fs.ls(f"{bucket}/ckpt", detail=False)) == [big_path, path]

    fs.rm([path, big_path])
    fs.invalidate_cache()
    assert not fs.exists(path)
    assert not fs.exists(big_path)
    # Not ``ls``: SeaweedFS keeps the emptied "ckpt/" directory (a delimited
    # listing still shows the prefix) until its background cleaner runs.
    assert fs.find(bucket) == []


def test_servers_listen_only_on_loopback(s3_server: S3Server) -> None:
    addresses = _listening_addresses(s3_server.process.pid)
    assert ("127.0.0.1", s3_server.port) in addresses
    assert {ip for ip, _ in addresses} == {"127.0.0.1"}, addresses


def test_seaweedfs_rejects_wrong_secret(seaweedfs_server: S3Server) -> None:
    from botocore.exceptions import ClientError

    impostor = dataclasses.replace(seaweedfs_server, secret_key="not-the-secret")
    client = impostor.boto3_client()
    with pytest.raises(ClientError) as excinfo:
        client.list_buckets()
    assert excinfo.value.response["Error"]["Code"] in {"SignatureDoesNotMatch", "AccessDenied"}


def test_moto_start_stop_start(tmp_path: Path) -> None:
    first = start_moto(tmp_path)
    first.stop()
    assert not first.running
    with start_moto(tmp_path) as second:
        second.create_bucket("after-restart")
        names = [b["Name"] for b in second.boto3_client().list_buckets()["Buckets"]]
        assert names == ["after-restart"]  # moto keeps state in memory only
    assert not second.running
    first.stop()  # idempotent


def test_seaweedfs_start_stop_start_keeps_data(tmp_path: Path) -> None:
    with start_seaweedfs(tmp_path) as first:
        bucket = first.create_bucket("persisted")
        first.boto3_client().put_object(Bucket=bucket, Key="k", Body=b"survives restart")
    assert not first.running
    with start_seaweedfs(tmp_path) as second:
        body = second.boto3_client().get_object(Bucket=bucket, Key="k")["Body"].read()
        assert body == b"survives restart"
    assert not second.running
    leftovers = [p for p in second._cleanup_files if p.exists()]
    assert leftovers == []


def test_seaweedfs_whose_s3_port_another_server_took_starts_on_new_ports(tmp_path: Path, monkeypatch) -> None:
    """The fixture picks SeaweedFS's ports free and releases them before ``weed``
    binds them; here moto holds the one picked for S3 on the first attempt. The
    start must not take moto's answers for SeaweedFS's: it picks new ports.
    (``weed mini`` refuses the taken port itself; without the fixture's
    "Port allocation failed" marker this test fails.)"""
    from tests.support import s3_servers

    picked = s3_servers._free_ports
    calls = []

    def moto_port_for_s3(count: int, exclude: object = ()) -> list[int]:
        ports = picked(count, exclude)
        calls.append(ports)
        if len(calls) == 1:
            ports[6] = int(moto.endpoint_url.rsplit(":", 1)[1])  # (master, ..., s3, s3 grpc)
        return ports

    with start_moto(tmp_path / "moto") as moto:
        monkeypatch.setattr(s3_servers, "_free_ports", moto_port_for_s3)
        with start_seaweedfs(tmp_path / "weed") as weed:
            assert weed.endpoint_url != moto.endpoint_url and len(calls) == 2, (weed.endpoint_url, calls)
            answer = weed.boto3_client().put_object(Bucket=weed.create_bucket("mine"), Key="k", Body=b"x")
            assert answer["ResponseMetadata"]["HTTPHeaders"]["server"].startswith("SeaweedFS")
