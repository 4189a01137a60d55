"""Jobs and commands in processes forked from the fork server, not fresh interpreters.

``start("tests.support.tier_crash_job:forked_main", argv)`` runs
``forked_main(argv)`` in a process of its own, as ``subprocess.Popen([sys.executable,
"-m", ...])`` would run the module, but forked from the process that already
imported torch and dcp_ext (:mod:`tests.support.dist`'s fork server, preloaded
with :data:`~tests.support.dist.FORKSERVER_PRELOAD`), so it skips the
interpreter start and those imports (3-4 s of CPU each on the test machine;
a killed 2-rank job paid them twice: its own process and its ranks' fork server).

The process is what a ``Popen(..., start_new_session=True)`` child is: its own
session and process group (a crash of ``all`` ranks, ``killpg``, takes the job
and its ranks and nothing else), the environment and working directory it is
given (in place before the target's module is imported; dcp_ext's failure
points, the one setting it reads from the environment at import, are re-read
from it), stdout and stderr in files read back by :meth:`Forked.communicate`,
and an exit code as Python's: the target's return value (``None`` is 0),
``SystemExit``'s code, 1 with the traceback on stderr after an exception,
``-9`` when SIGKILLed. A job whose ranks should also skip the fresh
interpreter forks them from itself: ``tests.support.dist.START_METHOD =
"fork"`` in the job (its process imported torch already, and has started no
thread).

Used where a test is about what processes do (to one checkpoint root, a
README snippet's save), not about starting ``python``: tests/test_torture.py,
tests/test_tiers.py, tests/test_deletion_rule.py,
tests/test_demo_and_readme.py. ``bench/`` keeps fresh interpreters, and so do
the tests of an entry point or of what a fresh process prints or allocates.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.support import dist

__all__ = ["Forked", "python_c", "run", "start"]


def _child(target: str, argv: list[str], environ: dict[str, str], cwd: str | None, out: str, err: str,
           delay: float) -> None:
    """(the forked process) Become a session leader with the given files,
    environment and directory, wait ``delay`` s, then ``sys.exit(target(argv))``."""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    failpoints = sys.modules.get("dcp_ext._runtime.failpoints")
    if failpoints is not None:  # imported before this environment was in place (a preload): re-read it
        failpoints.reload()
    if cwd is not None:
        os.chdir(cwd)
    if delay > 0:
        time.sleep(delay)
    module, _, function = target.partition(":")
    sys.argv = [module, *argv]
    sys.exit(getattr(importlib.import_module(module), function)(argv))


def python_c(argv: list[str]) -> None:
    """``python -c argv[0]``: the code runs as ``__main__`` in fresh globals
    (an uncaught exception: its traceback on stderr, exit code 1)."""
    import builtins

    sys.argv = ["-c", *argv[1:]]
    exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})


class Forked:
    """A started :func:`start` process, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, process: Any, args: list[str], out: Path, err: Path, text: bool) -> None:
        self._process = process
        self.args = args
        self._out, self._err = out, err
        self._text = text

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        code = self._process.exitcode
        return None if code is None else int(code)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return int(self.returncode)

    def kill(self) -> None:
        """SIGKILL the process's group (it is the group leader), or the process
        if it has not made its group yet."""
        if self.returncode is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Wait (``subprocess.TimeoutExpired`` after ``timeout`` s, the process
        left running); its stdout and stderr (``str`` if started with ``text``)."""
        self.wait(timeout)
        out, err = (path.read_bytes() if path.exists() else b"" for path in (self._out, self._err))
        shutil.rmtree(self._out.parent, ignore_errors=True)
        if self._text:
            return out.decode(errors="replace"), err.decode(errors="replace")
        return out, err


def start(target: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
          delay: float = 0.0, text: bool = False) -> Forked:
    """Start ``target`` (``"module:function"``, called with ``argv``) in a forked process.

    Args:
        target: The function to run, by name: its module is imported in the
            new process, after ``env`` is in place.
        argv: Its arguments (strings, as on a command line).
        env: The process's environment (default: this process's, now).
        cwd: Its working directory (default: this process's).
        delay: Seconds it waits before importing and running ``target``.
        text: :meth:`Forked.communicate` returns ``str`` instead of ``bytes``.
    """
    ctx = dist.context() if dist.START_METHOD == "forkserver" else _forkserver()
    files = tempfile.mkdtemp(prefix="dcp_ext_forked_")
    out, err = Path(files) / "stdout", Path(files) / "stderr"
    process = ctx.Process(target=_child, args=(target, [str(a) for a in argv], dict(env if env is not None else os.environ),
                                               None if cwd is None else str(cwd), str(out), str(err), delay))
    process.start()
    return Forked(process, [target, *map(str, argv)], out, err, text)


def _forkserver() -> Any:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(dist.FORKSERVER_PRELOAD)
    return ctx


def run(target: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
        timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """:func:`start` and wait, as ``subprocess.run(..., capture_output=True,
    text=True, timeout=timeout)`` would (the process group is killed, and
    ``subprocess.TimeoutExpired`` raised, after ``timeout`` s)."""
    process = start(target, argv, env=env, cwd=cwd, text=True)
    try:
        out, err = process.communicate(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, int(process.returncode or 0), out, err)
