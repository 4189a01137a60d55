"""Shared fixtures: real S3 servers on 127.0.0.1 and one fixture per storage backend.

The servers start once per test session, only when a test asks for them.
``backend`` is parametrized over every storage dcp_ext supports, so a test
that takes it runs against memory://, local disk, moto and SeaweedFS.
The helpers behind them live in ``tests/support/``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import dist as _dist
from tests.support.backends import BUCKET, Backend, backend_for
from tests.support.s3_servers import S3Server, isolated_aws_env, serving

# Spawned worlds fork their ranks from one server process that imported torch
# once, instead of paying a fresh interpreter and `import torch` per rank
# (see tests/support/dist.py).
_dist.START_METHOD = "forkserver"


@pytest.fixture(scope="session", autouse=True)
def _isolated_aws_env() -> Iterator[None]:
    with isolated_aws_env():
        yield


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with serving("moto", tmp_path_factory.mktemp("moto"), BUCKET) as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with serving("seaweedfs", tmp_path_factory.mktemp("seaweedfs"), BUCKET) as server:
        yield server


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(params=["memory", "local", "moto", "seaweedfs"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Every storage backend (memory, local disk, moto S3, SeaweedFS S3)."""
    return backend_for(request.param, request, tmp_path)


@pytest.fixture(params=["local", "moto"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """Backends that several processes can share (for multi-rank tests)."""
    return backend_for(request.param, request, tmp_path)


@pytest.fixture
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Build a backend by name inside a test."""
    return lambda kind: backend_for(kind, request, tmp_path)


#: The slowest test files (measured: ``--durations`` of a whole run on 2 cores),
#: longest first. ``--dist loadfile`` hands files to the two workers in
#: collection order, so starting with these leaves short files for the end
#: instead of one worker finishing a 2-minute file while the other idles.
_SLOWEST_FILES_FIRST = (
    "test_tiers.py", "test_tutorials.py", "test_torture.py", "test_deletion_rule.py", "test_checkpoint_api.py",
    "test_demo_and_readme.py", "test_resources.py", "test_reshard.py", "test_hf_export.py", "test_s3_request_rate.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
