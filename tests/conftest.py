"""Shared fixtures: real S3 servers on 127.0.0.1 and one fixture per storage backend.

The servers start once per test session, only when a test asks for them.
``backend`` is parametrized over every storage dcp_ext supports, so a test
that takes it runs against memory://, local disk, moto and SeaweedFS.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from s3_servers import S3Server, isolated_aws_env, start_moto, start_seaweedfs  # noqa: E402

BUCKET = "dcp-ext-tests"


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env() -> Iterator[None]:
    with isolated_aws_env():
        yield


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_moto(tmp_path_factory.mktemp("moto"))
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(f"{request.param}_server")


@dataclass
class Backend:
    """A place to put checkpoints: ``url(name)`` gives a fresh location."""

    name: str
    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    server: S3Server | None = None

    def url(self, name: str = "ckpt") -> str:
        return f"{self.root}/{name}-{uuid.uuid4().hex[:8]}"

    @property
    def is_s3(self) -> bool:
        return self.root.startswith("s3://")


def _make_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    run = uuid.uuid4().hex[:8]
    if kind == "local":
        return Backend("local", str(tmp_path))
    if kind == "memory":
        return Backend("memory", f"memory://dcp-ext-{run}")
    server: S3Server = request.getfixturevalue(f"{kind}_server")
    return Backend(kind, f"s3://{BUCKET}/{run}", server.storage_options(), server)


@pytest.fixture(params=["memory", "local", "moto", "seaweedfs"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every storage backend (memory, local disk, moto S3, SeaweedFS S3)."""
    return _make_backend(request.param, request, tmp_path)


@pytest.fixture(params=["local", "moto"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Backends that several processes can share (for multi-rank tests)."""
    return _make_backend(request.param, request, tmp_path)


@pytest.fixture
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Build a backend by name inside a test."""
    return lambda kind: _make_backend(kind, request, tmp_path)
