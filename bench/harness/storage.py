"""Where one benchmark run saves: a local directory, or a bucket on a SeaweedFS server of its own.

Used by ``bench.blocking`` and ``bench.tiers``; removed after the run.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BUCKET = "bench"


@contextlib.contextmanager
def storage(kind: str, workdir: Path, name: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """Where one run saves, as (root, storage options), removed afterwards: a
    directory under ``workdir``, or for S3 a bucket on a SeaweedFS server started
    for this run alone (so deleted checkpoints never pile up in its volumes)."""
    if kind != "s3":
        root = workdir / "local" / name
        try:
            yield str(root), None
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    from tests.support.s3_servers import isolated_aws_env, start_seaweedfs

    data = workdir / "seaweedfs" / name
    server = start_seaweedfs(data)
    try:
        server.create_bucket(BUCKET)
        with isolated_aws_env(server):  # the spawned ranks inherit it
            yield f"s3://{BUCKET}/{name}", server.storage_options()
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
