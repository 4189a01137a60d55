"""A rank's watch record outlives the rank: a failed save's ``ended`` record is
in the rendezvous store before ``RankWatch.close(ok=False)`` returns.

Seen in tests/test_cluster.py (1 run in 6): two survivors of a stalled rank
timed out; the first raised, exited at once (as a rank process does), and
took its queued ``ended`` record with it; the second, still diagnosing,
found the first's heartbeat stopped and named it as dead beside the stalled
rank. Here a real process (one gloo rank on a TCPStore this test serves)
closes its watch after a failure and leaves with ``os._exit``, the way
multiprocessing ends a rank; the record must say ``ended`` every time.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
from typing import Any

import torch.distributed as dist

from dcp_ext._runtime.rank_watch import SAVE_PHASES, RankWatch, watched_group  # imported once, before the forks


def _rank(port: int, keys: Any) -> None:
    """(the child) One rank: a save's watch in ``write_data``, then a failure, then exit."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    watched = watched_group(None, 5.0)
    assert watched is not None
    watch = RankWatch(watched, SAVE_PHASES)
    watch.phase("write_data")
    keys.put(watch._key(0))
    keys.close()
    keys.join_thread()
    watch.close(ok=False)
    os._exit(0)


def test_a_failed_ranks_ended_record_is_written_before_it_exits() -> None:
    seen = []
    for _ in range(5):  # before the fix: 0 of 10 records said "ended"
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
        ctx = multiprocessing.get_context("fork")
        keys = ctx.Queue()
        child = ctx.Process(target=_rank, args=(master.port, keys))
        child.start()
        key = keys.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0, child.exitcode
        record = dist.PrefixStore("0/", master)  # the default group's keys (torch 2.13)
        seen.append(json.loads(record.get(key))[0])
    assert seen == ["ended"] * 5, seen
