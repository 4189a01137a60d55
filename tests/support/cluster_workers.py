"""Rank functions for tests/test_cluster_fixture.py (run by ``Cluster.spawn`` on the cluster's hosts)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from tests.support.cluster import S3Endpoint


def _source_ip(toward: str) -> str:
    """The address this host sends from toward ``toward`` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((toward, 9))
        return str(s.getsockname()[0])


def host_facts() -> dict[str, Any]:
    """Who and where this process is: host name, address, node-local files (writes one named after its rank)."""
    local = Path(os.environ["DCP_CLUSTER_LOCAL_DIR"])
    (local / f"rank{os.environ['RANK']}").write_text(socket.gethostname())
    return {
        "hostname": socket.gethostname(),
        "resolved": socket.gethostbyname(socket.gethostname()),
        "source_ip": _source_ip(os.environ["MASTER_ADDR"]),
        "local_files": sorted(p.name for p in local.iterdir()),
        "hosts_dir_visible": sorted(os.listdir(local.parent / "hosts")),
        "loopback": _loopback_works(),
    }


def _loopback_works() -> bool:
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname(), timeout=2):
            return True


def identity() -> dict[str, Any]:
    """:func:`host_facts`, an all_reduce of rank + 1 and every rank's host name through gloo."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return {**host_facts(), "all_reduce": total.item(), "gathered_names": names}


def s3_roundtrip(s3: S3Endpoint, bucket: str) -> bytes:
    """Put an object named after this host and read it back."""
    client = s3.boto3_client(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1})
    key = f"hello/{socket.gethostname()}"
    client.put_object(Bucket=bucket, Key=key, Body=key.encode())
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def connect_probe(ip: str, port: int, timeout: float) -> tuple[str, float]:
    """Connect to ``ip:port``: ("ok" | "timeout" | "refused" | other error name, seconds)."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            outcome = "ok"
    except TimeoutError:
        outcome = "timeout"
    except ConnectionRefusedError:
        outcome = "refused"
    except OSError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - t0


def s3_probe(s3: S3Endpoint, bucket: str, timeout: float) -> dict[str, Any]:
    """A raw TCP connect to S3 and a boto3 GET, each bounded by ``timeout``."""
    outcome, seconds = connect_probe(s3.ip, s3.port, timeout)
    # total_max_attempts counts the first attempt (max_attempts counts retries: 1 = two connects).
    client = s3.boto3_client(connect_timeout=timeout, read_timeout=timeout, retries={"total_max_attempts": 1})
    t0 = time.monotonic()
    try:
        client.head_bucket(Bucket=bucket)
        boto = "ok"
    except Exception as exc:  # the test asserts which one
        boto = type(exc).__name__
    return {"host": socket.gethostname(), "connect": outcome, "connect_seconds": seconds, "boto3": boto,
            "boto3_seconds": time.monotonic() - t0}


def all_reduce_and_s3_probe(s3: S3Endpoint, bucket: str, timeout: float) -> dict[str, Any]:
    """An all_reduce across the hosts, then :func:`s3_probe`."""
    import torch
    import torch.distributed as dist

    total = torch.ones(4)
    dist.all_reduce(total)
    return {"all_reduce": total.tolist(), **s3_probe(s3, bucket, timeout)}


def collective_across_cut(marker_dir: str, cut_rank: int) -> dict[str, Any]:
    """Every rank but ``cut_rank`` enters an all_reduce and waits there; the test cuts
    ``cut_rank``'s host off and writes ``cut`` (its time) into ``marker_dir``; then
    ``cut_rank`` enters too. Reports what each rank saw and when, relative to the cut."""
    import torch
    import torch.distributed as dist

    markers = Path(marker_dir)
    rank = dist.get_rank()
    dist.barrier()
    (markers / f"ready{rank}").write_text("")
    if rank == cut_rank:
        while not (markers / "cut").exists():
            time.sleep(0.02)
    entered = time.time()
    try:
        dist.all_reduce(torch.ones(1024))
        outcome: dict[str, Any] = {"error": None}
    except Exception as exc:  # the report is the point
        outcome = {"error": f"{type(exc).__module__}.{type(exc).__qualname__}", "message": str(exc)[:600]}
    ended = time.time()
    cut_at = float((markers / "cut").read_text() or "nan") if (markers / "cut").exists() else float("nan")
    return {"rank": rank, "host": socket.gethostname(), **outcome, "entered": entered, "ended": ended,
            "seconds_after_cut": ended - cut_at, "seconds_in_collective": ended - entered}


def all_reduce_once() -> float:
    """One all_reduce of a small tensor; returns the sum (the world size)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def serve_until_killed(port: int, ready: str) -> None:
    """Accept connections on ``port`` and hold them open (never returns; the test kills the host)."""
    server = socket.create_server(("0.0.0.0", port))
    held = []
    Path(ready).write_text("")
    while True:
        conn, _ = server.accept()
        held.append(conn)


def connect_and_wait(ip: str, port: int, connected: str, timeout: float) -> dict[str, Any]:
    """Connect to ``ip:port``, say so in the file ``connected``, then wait up to
    ``timeout`` seconds for the peer to say anything: "closed" (FIN), "reset"
    (RST) or "silence"."""
    conn = socket.create_connection((ip, port), timeout=5)
    conn.settimeout(timeout)
    Path(connected).write_text("")
    t0 = time.monotonic()
    try:
        outcome = "data" if conn.recv(1) else "closed"
    except TimeoutError:
        outcome = "silence"
    except ConnectionResetError:
        outcome = "reset"
    return {"outcome": outcome, "seconds": time.monotonic() - t0}
