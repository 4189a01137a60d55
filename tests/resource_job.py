"""Repeated saves in one process (run by test_resources.py in a fresh interpreter).

``python tests/resource_job.py ROOT [STORAGE_OPTIONS_JSON]`` saves a 32 MiB model
20 times through ``CheckpointManager`` (alternating synchronous and
asynchronous saves, keep 2) and loads the newest after each, then prints one
JSON line: peak RSS (ru_maxrss) after 2 and after 20 rounds, and open file
descriptors and OS threads before the first round, after 2 and after 20.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import torch
from torch import nn

import dcp_ext


def snapshot() -> dict[str, int]:
    return {
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
    }


def main() -> None:
    root = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])  # 32 MiB
    optim = torch.optim.Adam(model.parameters())
    manager = dcp_ext.CheckpointManager(root, storage_options=options)
    out = {"before": snapshot()}
    for n in range(1, 21):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        manager.save(f"step{n}", model, optim, num_kept_partial_checkpoints=2, async_save=n % 2 == 0)
        manager.wait()
        probe = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
        manager.resume(probe)
        assert all(torch.equal(a, b) for a, b in zip(probe.parameters(), model.parameters()))
        if n in (2, 20):
            out[f"after{n}"] = snapshot()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
