"""Resource bounds: repeated sync and async saves do not grow memory, open
files or threads (each run in a fresh interpreter so peak RSS is its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = str(Path(__file__).resolve().parent / "resource_job.py")


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_repeated_saves_do_not_grow(kind: str, tmp_path: Path, make_backend) -> None:
    backend = make_backend(kind)
    args = [sys.executable, JOB, backend.url("res")]
    if backend.storage_options:
        args.append(json.dumps(backend.storage_options))
    result = subprocess.run(args, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr
    data = json.loads(lines[0].removeprefix("RESULT "))
    two, twenty, before = data["after2"], data["after20"], data["before"]
    print(kind, data)
    assert twenty["peak_rss_kib"] <= two["peak_rss_kib"] * 1.05, data
    assert twenty["fds"] <= two["fds"] and twenty["threads"] <= two["threads"], data
    # Back to the baseline of the process before its first save (S3 keeps one
    # pooled client, whose connections stay open for reuse).
    assert twenty["threads"] == before["threads"], data
    if kind == "local":
        assert twenty["fds"] == before["fds"], data
