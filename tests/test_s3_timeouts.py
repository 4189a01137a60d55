"""Bounded waits on S3 (issue 32, finding 5).

An endpoint that accepted connections and never answered held
``dcp_ext.save`` for over 700 s: six attempts of botocore's 60 s read
timeout, then the next request's. Every S3 request now waits at most
``IOConfig.s3_connect_timeout`` + ``s3_read_timeout`` per attempt and starts
no attempt that could end after ``s3_request_deadline``; the error is a
:class:`~dcp_ext.errors.StorageTimeoutError` naming the endpoint, the object
and the settings. The servers here are real sockets on 127.0.0.1: one that
never answers, one that sends the first bytes of an answer and stalls, and a
proxy in front of moto that stalls only the data uploads or downloads.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import pytest
import torch

import dcp_ext
from dcp_ext import IOConfig, RetryPolicy
from dcp_ext.errors import StorageError, StorageTimeoutError
from dcp_ext.storage._s3_client import get_connection
from tests.support.backends import BUCKET
from tests.support.stalling_s3 import FIRST_BYTES, SilentEndpoint, StallingProxy

MiB = 1024 * 1024
#: Small bounds, so that a test waits seconds: attempts of at most 1.5 s, 3 s per request.
CONFIG = IOConfig(s3_connect_timeout=0.5, s3_read_timeout=1.0, s3_request_deadline=3.0, part_size=5 * MiB,
                  retry=RetryPolicy(max_attempts=6, base_delay=0.01, max_delay=0.05))
#: What a save or load does besides waiting on the endpoint (planning, imports,
#: requests that fail at once), generous for a loaded 2-core machine.
OVERHEAD = 4.0


def _worst_request_seconds(config: IOConfig, connect: float, read: float) -> float:
    """The longest one request can take against an endpoint that never answers:
    every attempt waits its connect and read timeouts, with the largest
    backoff between attempts; no attempt starts that could end after the
    deadline (and the first always runs)."""
    policy, attempt_seconds = config.retry, connect + read
    elapsed = attempt_seconds
    for attempt in range(1, policy.max_attempts):
        delay = min(policy.max_delay, policy.base_delay * 2 ** (attempt - 1))
        if elapsed + delay + attempt_seconds > config.s3_request_deadline:
            break
        elapsed += delay + attempt_seconds
    return elapsed


def test_default_waits_fail_a_dead_endpoint_well_within_two_minutes() -> None:
    defaults = IOConfig()
    client = get_connection({"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}, defaults).client
    # The client dcp_ext builds really has the configured timeouts.
    assert client.meta.config.connect_timeout == defaults.s3_connect_timeout == 5.0
    assert client.meta.config.read_timeout == defaults.s3_read_timeout == 20.0
    worst = _worst_request_seconds(defaults, defaults.s3_connect_timeout, defaults.s3_read_timeout)
    # attempts x (connect + read), bounded by the total deadline.
    attempts_alone = defaults.retry.max_attempts * (defaults.s3_connect_timeout + defaults.s3_read_timeout)
    assert worst <= min(attempts_alone + defaults.retry.max_attempts * defaults.retry.max_delay,
                        defaults.s3_request_deadline) <= 60.0
    # A failed save waits out one request; later ones fail at once (the
    # connection remembers the silence), so the save ends within the deadline.
    assert worst < 120 / 2, worst
    # Before: botocore's 60 s + 60 s per attempt, six attempts, no deadline.
    before = dataclasses.replace(defaults, s3_request_deadline=1e9)
    assert _worst_request_seconds(before, 60.0, 60.0) > 700


def test_timeouts_come_from_the_environment_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DCP_EXT_S3_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("DCP_EXT_S3_READ_TIMEOUT", "7.5")
    monkeypatch.setenv("DCP_EXT_S3_REQUEST_DEADLINE", "30")
    config = IOConfig.from_env()
    assert (config.s3_connect_timeout, config.s3_read_timeout, config.s3_request_deadline) == (2.0, 7.5, 30.0)
    monkeypatch.setenv("DCP_EXT_S3_READ_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DCP_EXT_S3_READ_TIMEOUT='soon'"):
        IOConfig.from_env()
    with pytest.raises(ValueError, match="s3_read_timeout must be a positive number"):
        IOConfig(s3_read_timeout=float("nan"))
    with pytest.raises(ValueError, match="s3_request_deadline .* must leave room for one attempt"):
        IOConfig(s3_read_timeout=30.0, s3_request_deadline=20.0)


def _options(endpoint_url: str) -> dict[str, Any]:
    return {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
            "config_kwargs": {"s3": {"addressing_style": "path"}}}


@pytest.mark.parametrize("first_bytes", [b"", FIRST_BYTES], ids=["never-answers", "first-bytes-then-stalls"])
def test_a_save_to_a_silent_endpoint_fails_within_its_deadline(first_bytes: bytes) -> None:
    url = f"s3://{BUCKET}/silent-{uuid.uuid4().hex[:8]}/ck"
    with SilentEndpoint(first_bytes) as server:
        start = time.monotonic()
        with pytest.raises(StorageTimeoutError) as info:
            dcp_ext.save({"w": torch.ones(16)}, url, storage_options=_options(server.endpoint_url), config=CONFIG)
        elapsed = time.monotonic() - start
        connections = len(server.connections)
        requests = list(server.requests)
    error = info.value
    assert isinstance(error, StorageError) and isinstance(error, TimeoutError), type(error).__mro__
    message = str(error)
    for part in (server.endpoint_url, f"s3://{BUCKET}", "connect_timeout=0.5 s", "read_timeout=1 s",
                 "s3_request_deadline=3 s", "IOConfig.s3_read_timeout", "DCP_EXT_S3_REQUEST_DEADLINE"):
        assert part in message, (part, message)
    # One request waited (each attempt a read timeout: the connection opens at
    # once on loopback); every later one failed at once, so the save took
    # one request's worst case and its own work.
    worst = _worst_request_seconds(CONFIG, 0.0, CONFIG.s3_read_timeout)
    assert CONFIG.s3_read_timeout <= elapsed <= worst + OVERHEAD, (elapsed, worst)
    # Attempts k start at (k - 1) * read_timeout at the earliest and only if they can end by the deadline.
    most = 1 + int((CONFIG.s3_request_deadline - CONFIG.s3_connect_timeout - CONFIG.s3_read_timeout)
                   // CONFIG.s3_read_timeout)
    assert 1 <= connections <= most, (connections, requests)
    assert all(line.startswith(("HEAD ", "GET ", "PUT ", "POST ")) for line in requests), requests


def _stall_data(method: str) -> Any:
    return lambda m, path: m == method and ".distcp" in path


def test_manager_save_and_resume_through_stalled_data_requests(moto_server) -> None:
    """A manager on moto behind a proxy: a save whose data uploads stall
    (multipart: 6 MiB in 5 MiB parts) and a resume whose data downloads stall
    each fail within the deadline, naming the data object; nothing is
    committed and the previous tag stays the newest and loads."""
    root = f"s3://{BUCKET}/stalled-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1536)  # 6 MiB of weights: a multipart upload
    client = moto_server.boto3_client()
    prefix = root[len(f"s3://{BUCKET}/"):]
    with StallingProxy(moto_server.endpoint_url) as proxy:
        manager = dcp_ext.CheckpointManager(root, storage_options=moto_server.storage_options(proxy.endpoint_url),
                                           config=CONFIG)
        manager.save("a", model)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)

        proxy.stall = _stall_data("PUT")  # the parts (and a single PUT) of every data file
        start = time.monotonic()
        with pytest.raises(StorageTimeoutError) as info:
            manager.save("b", model)
        elapsed = time.monotonic() - start
        worst = _worst_request_seconds(CONFIG, 0.0, CONFIG.s3_read_timeout)
        assert elapsed <= worst + OVERHEAD, (elapsed, worst)
        message = str(info.value)
        assert "b_partial/model_rank0.distcp" in message and proxy.endpoint_url in message, message
        assert "s3_request_deadline=3 s" in message, message
        assert any("partNumber=" in path for _, _, path, _ in proxy.stalled()), proxy.stalled()  # multipart
        proxy.stall = lambda method, path: False
        time.sleep(CONFIG.s3_connect_timeout + CONFIG.s3_read_timeout)  # the connection's memory of the silence
        # Nothing of b is committed: a is the newest and the only tag, b has no metadata.
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])]
        assert not any(k.startswith(f"{prefix}/b_partial/") and k.endswith(".json") for k in keys), keys
        assert manager.tags() == ["a"] and manager.read_newest() == "a"

        proxy.stall = _stall_data("GET")  # ranged reads of the data files
        fresh = torch.nn.Linear(1024, 1536)
        start = time.monotonic()
        with pytest.raises(StorageTimeoutError) as info:
            manager.resume(fresh)
        elapsed = time.monotonic() - start
        assert elapsed <= worst + OVERHEAD, (elapsed, worst)
        assert "a_partial/model_rank0.distcp" in str(info.value) and "reading" in str(info.value), info.value
        proxy.stall = lambda method, path: False
        time.sleep(CONFIG.s3_connect_timeout + CONFIG.s3_read_timeout)
        assert manager.resume(fresh).tag == "a"
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key], value), key
