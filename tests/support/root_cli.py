"""Jobs and ``dcp-ext`` commands on one checkpoint root, run in other processes
(tests/test_deletion_rule.py, tests/test_liveness.py).

:class:`PausedJob` is one training job's save (``tests/support/root_jobs.py``)
paused at a failpoint until the test says go; :func:`run_cli` runs a real
``dcp-ext`` command in another process; :class:`NamespaceCli` runs several commands, one after another, in one
interpreter of its own in a new PID namespace (one interpreter start and
torch import for all of them).
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
    paused at ``point`` until :meth:`go`. The process is forked from the
    suite's fork server (tests/support/forked.py), as ``python -m
    tests.support.root_jobs`` would run it, without a fresh interpreter."""

    def __init__(self, backend: Backend, root: str, tag: str, step: int, gate: Path, keep: int | None = None,
                 point: str = "before_metadata", **extra_env: str) -> None:
        from tests.support import forked

        self.gate = gate
        argv = [root, json.dumps(backend.storage_options), tag, str(step)] + ([str(keep)] if keep else [])
        self.proc = forked.start("tests.support.root_jobs:main", argv, cwd=REPO, text=True,
                                 env=env(backend, DCP_EXT_PAUSE_AT=point, DCP_EXT_PAUSE_FILE=str(gate), **extra_env))
        deadline = time.monotonic() + 120
        while not Path(f"{gate}.reached").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the job never reached {point}: {self.proc.communicate(30)}")
            time.sleep(0.05)

    def go(self) -> tuple[int, str]:
        self.gate.touch()
        _, err = self.proc.communicate(timeout=120)
        return self.proc.returncode or 0, err


_SERVE = """
import contextlib, io, json, sys
from dcp_ext.cli import main
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(json.loads(line))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    print(json.dumps([code or 0, out.getvalue(), err.getvalue()]), flush=True)
"""


class NamespaceCli:
    """``dcp-ext`` commands run in one process of their own in a new PID
    namespace (``unshare -p -f --mount-proc``): a process there sees none of
    this namespace's PIDs, as a command on another host would not. Use as a
    context manager; :meth:`run` returns what :func:`run_cli` would."""

    def __init__(self, backend: Backend, **extra_env: str) -> None:
        self.backend = backend
        self.proc = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, "-c", _SERVE], cwd=REPO,
                                     env=env(backend, **extra_env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``dcp-ext ARGS`` (with the backend's storage options) in the namespace."""
        options = ["--storage-options", json.dumps(self.backend.storage_options)] if self.backend.storage_options else []
        argv = [*options, *args]
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the namespace's dcp-ext process ended: {self.proc.stderr.read() if self.proc.stderr else ''}")
        code, out, err = json.loads(line)
        return subprocess.CompletedProcess(["dcp-ext", *argv], code, out, err)

    def __enter__(self) -> NamespaceCli:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.proc.communicate(timeout=60)  # its input closed: it ends
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def run_cli(backend: Backend, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in another process, forked from the suite's fork
    server (no fresh interpreter and torch import; :class:`NamespaceCli` for
    another PID namespace)."""
    from tests.support import forked

    options = ["--storage-options", json.dumps(backend.storage_options)] if backend.storage_options else []
    return forked.run("dcp_ext.cli:main", [*options, *args], env=env(backend, **extra_env), cwd=REPO)
