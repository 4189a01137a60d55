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
# (see tests/support/dist.py); it imports dcp_ext once too, failure points
# disarmed (see tests/support/forkserver_preload.py).
_dist.START_METHOD = "forkserver"
_dist.FORKSERVER_PRELOAD = [*_dist.FORKSERVER_PRELOAD, "tests.support.forkserver_preload"]


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


#: Seconds each test file took (its tests' durations, on 2 cores with three
#: workers running, 2026-11-29); files not listed count as
#: :data:`_UNLISTED_SECONDS`. Longest first is the order the workers get
#: files in (``--dist loadfile``: each file on one worker; a worker is sent its
#: next file when it has two tests left), so that the last files handed out
#: are short ones, instead of one worker finishing a 2-minute file while the
#: others idle. Re-measure with ``--durations=0`` when a file's time changes
#: a lot.
_FILE_SECONDS = {
    "test_tutorials.py": 205, "test_tiers.py": 106, "test_cluster.py": 94, "test_integrations_megatron.py": 78,
    "test_accelerate_recipe.py": 70, "test_demo_and_readme.py": 62, "test_liveness.py": 55,
    "test_cluster_tiers.py": 55, "test_resources.py": 55, "test_async_staging.py": 41, "test_fuzz_inputs.py": 40,
    "test_checkpoint_api.py": 39, "test_hf_export.py": 39, "test_integrations_lightning.py": 36,
    "test_torture.py": 35, "test_s3_request_rate.py": 34, "test_store_gcs.py": 34, "test_plan_caching.py": 33,
    "test_deletion_rule.py": 33, "test_integrations_torch_checkpointing.py": 30, "test_lightning_s3_resume.py": 28,
    "test_store_contract.py": 27, "test_s3_servers.py": 26, "test_cluster_fixture.py": 25,
    "test_adapter_deletion.py": 23, "test_damage_and_hostile.py": 19, "test_scale.py": 18, "test_reshard.py": 18,
    "test_store_azure.py": 17, "test_s3_faults_and_errors.py": 17, "test_smp_parity.py": 17,
    "test_incremental.py": 16, "test_s3_timeouts.py": 16, "test_save_lock.py": 15, "test_multirank.py": 15,
    "test_read_once.py": 14, "test_integrations_torchtitan.py": 13, "test_hostile_inputs.py": 11, "test_cli.py": 11,
    "test_codecs_and_integrity.py": 11, "test_architecture.py": 10, "test_bench_gpu.py": 8, "test_roundtrip.py": 7,
    "test_overwrite.py": 7, "test_tier_names.py": 6, "test_integrations_accelerate.py": 5,
}
_UNLISTED_SECONDS = 4.0


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist (3.x) sorts the files of --dist loadfile by how many tests
    # each holds, unless told not to: a 2-minute file with one test would go
    # last. It reads this option when it schedules, after configuration.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -_FILE_SECONDS.get(item.path.name, _UNLISTED_SECONDS))  # stable within a file
