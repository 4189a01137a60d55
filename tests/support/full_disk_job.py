"""Saves onto a file system that fills up: ``python -m tests.support.full_disk_job DIR``.

Run by tests/test_tiers.py inside ``unshare --user --map-root-user --mount``
(no privileges needed): the job mounts a 3 MiB tmpfs on ``DIR/small``, then

1. saves a small checkpoint there with a plain manager, then one larger than
   the file system: the second must fail with ``StorageFullError`` naming a
   file under ``DIR/small``, and the first stay ``newest`` and load bit-exact;
2. uses the tmpfs as the local tier of a tiered manager (root ``DIR/root`` on
   the real disk): the small save commits locally, the large one goes to the
   root and raises ``StorageFullError`` naming node 0's tier.

Prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


def main(base: str) -> None:
    import torch

    import dcp_ext

    small = os.path.join(base, "small")
    os.makedirs(small, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", small], check=True)
    report: dict[str, object] = {}
    torch.manual_seed(0)
    little = torch.nn.Linear(64, 64)  # 16 KiB
    big = torch.nn.Linear(1024, 1024)  # 4 MiB

    plain = dcp_ext.CheckpointManager(os.path.join(small, "plain"))
    plain.save("a", little)
    try:
        plain.save("b", big)
    except dcp_ext.StorageFullError as err:
        report["plain_error"] = str(err)
    report["plain_newest"] = plain.read_newest()
    report["plain_tags"] = plain.tags()
    probe = torch.nn.Linear(64, 64)
    plain.resume(probe)
    report["plain_exact"] = all(torch.equal(a, b) for a, b in zip(probe.state_dict().values(),
                                                                     little.state_dict().values()))
    report["plain_leftovers"] = sorted(os.listdir(os.path.join(small, "plain")))
    shutil.rmtree(os.path.join(small, "plain"))  # room for the tier part

    tiered = dcp_ext.CheckpointManager(os.path.join(base, "root"), local_tier=os.path.join(small, "tier"),
                                       persist_every=0)
    tiered.save("t1", little)
    try:
        tiered.save("t2", big)
    except dcp_ext.StorageFullError as err:
        report["tier_error"] = str(err)
    report["tier_root_tags"] = tiered.tags()
    report["tier_local"] = sorted(os.listdir(os.path.join(small, "tier")))
    probe = torch.nn.Linear(1024, 1024)
    report["tier_resumed"] = tiered.resume(probe).tag
    report["tier_exact"] = all(torch.equal(a, b) for a, b in zip(probe.state_dict().values(),
                                                                    big.state_dict().values()))
    tiered.close()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
