"""Resource bounds: repeated sync and async saves do not grow memory, open
files or threads (each run in a fresh interpreter so peak RSS is its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

#: tests/support/resource_job.py, run as a module from the repository root.
JOB = [sys.executable, "-m", "tests.support.resource_job"]
#: glibc: every allocation of 128 KiB or more is its own mapping, unmapped
#: when freed, so RSS is what is live. With the default (a threshold that
#: rises to the size of the largest block freed), freed part and staging
#: buffers stay in fragmented heaps and RSS drifts up by tens of MiB over 20
#: rounds with nothing leaked; with this setting it is flat to the MiB.
JOB_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.mark.parametrize("kind", ["local", "moto"])
def test_repeated_saves_do_not_grow(kind: str, tmp_path: Path, make_backend) -> None:
    backend = make_backend(kind)
    args = [*JOB, backend.url("res")]
    if backend.storage_options:
        args.append(json.dumps(backend.storage_options))
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO, env=JOB_ENV)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr
    data = json.loads(lines[0].removeprefix("RESULT "))
    one, two, twenty = data["after1"], data["after2"], data["last"]
    print(kind, data)
    # RSS after each round (the model, Adam, the staging buffers) stays flat
    # from round 2 (the first async save allocates the buffers) to the last,
    # and so does the peak within a round (which also holds the part buffers
    # of the uploads in flight). Seen: flat to 1 MiB on both backends.
    assert data["rss"][-1] <= data["rss"][1] + 4, data["rss"]
    assert twenty["peak_rss_kib"] <= two["peak_rss_kib"] + (8 << 10), data["peaks"]
    # Threads after the last round equal those after round 2 (the first async
    # save starts the manager's Stager: one staging thread and its copy
    # threads, kept for reuse); open files equal those after round 1 (S3: one
    # pooled client per endpoint, whose connections stay open for reuse, so
    # its open files may differ by a connection or two).
    assert one["python_threads"] == 1, data
    assert twenty["threads"] == two["threads"] and twenty["python_threads"] == two["python_threads"], data
    if kind == "local":
        assert twenty["fds"] == one["fds"] == two["fds"], data
    else:
        assert twenty["fds"] <= one["fds"] + 2, data
