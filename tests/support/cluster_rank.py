"""One rank of a :meth:`tests.support.cluster.Cluster.spawn` run:
``python -m tests.support.cluster_rank SPEC``, started inside a host of the cluster.

The rank reads its place from the environment torchrun would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), joins a gloo process group
through ``env://`` when the spec asks for one, calls the target and pickles
``{"value", "error", "exc_type", "seconds", "timeline"}`` to
``rank<RANK>.pkl`` in the run directory (written before the final barrier, so a
result survives a barrier that fails). It then leaves with ``os._exit`` without
tearing gloo down (as ``tests/support/dist.py`` does: a rank torn down while a
peer is still in gloo can abort the peer).

Exit codes: 0 the target returned (and the final barrier passed), 1 the target
(or the process group's start) raised, 2 the final barrier failed.

:func:`run_forked` is the same rank started the fast way: forked from a fork
server that imported torch once (``Cluster.spawn(start="fork")``), it enters the
host's namespaces itself, as ``ip netns exec NS unshare --uts`` and the mounts
of ``Cluster.popen`` would have put it there, then runs :func:`main`.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib
import os
import pickle
import sys
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["enter_host", "main", "resolve_target", "run_forked"]

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


def resolve_target(spec: str) -> Any:
    """The function named ``"package.module:qualified.name"``."""
    module_name, _, qualname = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _write_result(path: Path, result: dict[str, Any]) -> None:
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # an unpicklable return value is the target's error, not a lost rank
        payload = pickle.dumps({**result, "value": None, "error": f"result not picklable: {exc!r}",
                                "exc_type": type(exc).__qualname__})
    tmp = path.with_suffix(".partial")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def main(spec_path: Path) -> int:
    spec = pickle.loads(spec_path.read_bytes())
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"value": None, "error": None, "exc_type": None, "timeline": {"main": time.time()}}
    started = time.monotonic()
    group = False
    try:
        if spec["init_process_group"]:
            import torch.distributed as dist

            seconds = spec["pg_timeout"]
            timeout = None if seconds is None else datetime.timedelta(seconds=seconds)  # None: torch's default
            dist.init_process_group("gloo", init_method="env://", timeout=timeout)
            group = True
            result["timeline"]["process_group"] = time.time()
        target = resolve_target(spec["target"])
        result["timeline"]["target_imported"] = time.time()
        result["value"] = target(*spec["args"], **spec["kwargs"])
    except BaseException as exc:  # reported to the test process, which decides
        result["error"] = traceback.format_exc()
        result["exc_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
    result["seconds"] = time.monotonic() - started
    result["timeline"]["target_returned"] = time.time()
    _write_result(Path(spec["run_dir"]) / f"rank{rank}.pkl", result)
    code = 0 if result["error"] is None else 1
    if code == 0 and group and spec["final_barrier"]:
        try:
            import torch.distributed as dist

            dist.barrier()
        except BaseException:
            traceback.print_exc()
            code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def enter_host(entry: dict[str, Any]) -> None:
    """Move this (single-threaded, freshly forked) process into a host: its network
    namespace, a UTS namespace with its host name, and a mount namespace (slave
    propagation, so nothing leaks back) with ``/sys`` remounted for that network,
    ``binds`` bound and ``hide`` covered by an empty tmpfs.

    ``entry`` is plain data (it crosses a pickle): ``{"netns": str, "hostname":
    str, "binds": [(src, dst), ...], "hide": [path, ...]}``.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/run/netns/{entry['netns']}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns {entry['netns']}")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWUTS | _CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "make / a slave mount")
    libc.umount2(b"/sys", _MNT_DETACH)  # as ip netns exec does: /sys/class/net of this network
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount /sys")
    socket_module = importlib.import_module("socket")
    socket_module.sethostname(entry["hostname"])
    for src, dst in entry["binds"]:
        check(libc.mount(os.fsencode(src), os.fsencode(dst), None, _MS_BIND | _MS_REC, None), f"bind {src} {dst}")
    for path in entry["hide"]:
        check(libc.mount(b"dcpc-hidden", os.fsencode(path), b"tmpfs", 0, b"size=64k,mode=0755"), f"hide {path}")


def run_forked(entry: dict[str, Any], environ: dict[str, str], cwd: str, log: str, spec_path: str) -> None:
    """The target of a forked rank: output to ``log``, a session of its own, the
    host's namespaces, the rank's environment, then :func:`main`; never returns."""
    code = 1
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.setsid()
        enter_host(entry)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        code = main(Path(spec_path))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    os._exit(main(Path(sys.argv[1])))
