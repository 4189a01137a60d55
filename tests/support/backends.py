"""The storage backends tests run against (built by the fixtures in conftest.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.s3_servers import S3Server

__all__ = ["BUCKET", "Backend", "backend_for"]

#: The bucket the session's S3 servers hold (created when each server starts).
BUCKET = "dcp-ext-tests"


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


def backend_for(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh ``kind`` backend (memory, local, moto, seaweedfs); S3 kinds
    use the session's ``{kind}_server`` fixture."""
    run = uuid.uuid4().hex[:8]
    if kind == "local":
        return Backend("local", str(tmp_path))
    if kind == "memory":
        return Backend("memory", f"memory://dcp-ext-{run}")
    server: S3Server = request.getfixturevalue(f"{kind}_server")
    return Backend(kind, f"s3://{BUCKET}/{run}", server.storage_options(), server)
