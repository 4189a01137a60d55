"""Repeated saves in one process (run by test_resources.py in a fresh interpreter).

``python -m tests.support.resource_job ROOT [STORAGE_OPTIONS_JSON]`` (from the
repository root) saves a 16 MiB model
``ROUNDS`` times through ``CheckpointManager`` (alternating synchronous and
asynchronous saves, keep 2) and loads the newest after each, then prints one
JSON line: peak RSS (``VmHWM``: ``ru_maxrss`` would carry the peak of the
parent across ``exec``), open file descriptors, OS threads and Python
threads at the start and after rounds 1, 2 and the last (``last``). Round 1 is the baseline
of open files: torch starts its native intra-op thread pool on first use;
round 2 (the first asynchronous save, which creates the manager's staging
threads, kept for reuse) the baseline of threads.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
from torch import nn

import dcp_ext
from tests.support.compare import assert_same_state

ROUNDS = 8
#: Linear(1024, 1024) layers of 4 MiB: a leaked copy of the model (16 MiB) is well above the 4 MiB of
#: RSS growth the test allows, and fewer bytes keep moto's rounds short (the moto case alone: 40 s with
#: 8 layers, 24 s with 4).
LAYERS = 4


def os_threads(samples: int = 20, interval_s: float = 0.025) -> int:
    """The fewest OS threads seen in ``samples`` looks ``interval_s`` apart.

    A Python thread that has just finished leaves ``threading``'s list before
    its OS thread exits: one look can count it (seen once in 8 runs beside a
    CPU burner: 5 threads against 4, with equal Python threads). A leaked
    thread is in every look.
    """
    fewest = len(os.listdir("/proc/self/task"))
    for _ in range(samples - 1):
        time.sleep(interval_s)
        fewest = min(fewest, len(os.listdir("/proc/self/task")))
    return fewest


def memory_kib() -> dict[str, int]:
    """Peak and current RSS, KiB."""
    status = open("/proc/self/status").read()
    return {
        "peak_rss_kib": int(status.split("VmHWM:")[1].split()[0]),
        "rss_kib": int(status.split("VmRSS:")[1].split()[0]),
    }


def snapshot() -> dict[str, int]:
    return {
        **memory_kib(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": os_threads(),
        "python_threads": threading.active_count(),
    }


def main() -> None:
    root = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(LAYERS)])  # 16 MiB
    optim = torch.optim.Adam(model.parameters())
    # S3: 5 MiB parts, 2 in flight (3 part buffers per rank, shared by the
    # model and optimizer files), so that the upload's share of the peak is
    # small next to a leak of the size this test looks for.
    config = dcp_ext.IOConfig(part_size=5 << 20, max_concurrency=2) if options else None
    manager = dcp_ext.CheckpointManager(root, storage_options=options, config=config)
    out = {"start": snapshot()}
    for n in range(1, ROUNDS + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        manager.save(f"step{n}", model, optim, num_kept_partial_checkpoints=2, async_save=n % 2 == 0)
        manager.wait()
        probe = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(LAYERS)])
        manager.resume(probe)
        assert_same_state(model.state_dict(), probe.state_dict(), f"round {n}")
        memory = memory_kib()
        out.setdefault("peaks", []).append(memory["peak_rss_kib"] // 1024)
        out.setdefault("rss", []).append(memory["rss_kib"] // 1024)
        if n in (1, 2):
            out[f"after{n}"] = snapshot()
    out["last"] = snapshot()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
