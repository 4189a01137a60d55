"""Jobs and ``dcp-ext`` commands on one checkpoint root, run in other processes
(tests/test_deletion_rule.py, tests/test_liveness.py).

:class:`PausedJob` is one training job's save (``tests/support/root_jobs.py``)
paused at a failpoint until the test says go; :func:`run_cli` runs a real
``dcp-ext`` command, optionally in another PID namespace (``unshare -p``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import dcp_ext
from tests.support.backends import Backend
from tests.support.root_jobs import model_at

REPO = Path(__file__).resolve().parent.parent.parent


def same(model: nn.Module, step: int) -> bool:
    """Whether ``model`` equals ``model_at(step)``, bit for bit."""
    expected = model_at(step).state_dict()
    got = model.state_dict()
    return got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def loads(manager: dcp_ext.CheckpointManager, tag: str, step: int) -> bool:
    """Whether ``tag`` resumes into a fresh model equal to ``model_at(step)``, bit for bit."""
    model = model_at(0)
    manager.resume(model, tag=tag)
    return same(model, step)


def manager(backend: Backend, root: str, **kwargs: Any) -> dcp_ext.CheckpointManager:
    return dcp_ext.CheckpointManager(root, storage_options=backend.storage_options, incremental=True, **kwargs)


def env(backend: Backend | None = None, **extra: str) -> dict[str, str]:
    environ = dict(os.environ)
    environ["PYTHONPATH"] = str(REPO) + os.pathsep + environ.get("PYTHONPATH", "")
    environ.update(extra)
    return environ


class PausedJob:
    """A save of ``tag`` (tests/support/root_jobs.py) in another process,
    paused at ``point`` until :meth:`go`."""

    def __init__(self, backend: Backend, root: str, tag: str, step: int, gate: Path, keep: int | None = None,
                 point: str = "before_metadata", **extra_env: str) -> None:
        self.gate = gate
        args = [sys.executable, "-m", "tests.support.root_jobs", root, json.dumps(backend.storage_options), tag,
                str(step)] + ([str(keep)] if keep else [])
        self.proc = subprocess.Popen(args, cwd=REPO, env=env(backend, DCP_EXT_PAUSE_AT=point,
                                                             DCP_EXT_PAUSE_FILE=str(gate), **extra_env),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not Path(f"{gate}.reached").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the job never reached {point}: {self.proc.communicate()}")
            time.sleep(0.05)

    def go(self) -> tuple[int, str]:
        self.gate.touch()
        _, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, err


def run_cli(backend: Backend, *args: str, pid_namespace: bool = False, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in another process (``pid_namespace``: in a new PID
    namespace of its own, through ``unshare -p -f --mount-proc``)."""
    options = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    if not pid_namespace:  # forked from the suite's fork server: no fresh interpreter and torch import
        from tests.support import forked

        return forked.run("dcp_ext.cli:main", [*options, *args], env=env(backend, **extra_env), cwd=REPO)
    command = [sys.executable, "-m", "dcp_ext", *options, *args]
    if pid_namespace:
        command = ["unshare", "-p", "-f", "--mount-proc", *command]
    return subprocess.run(command, cwd=REPO, env=env(backend, **extra_env), capture_output=True, text=True,
                          timeout=120)
