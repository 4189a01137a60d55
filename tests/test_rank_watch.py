"""How a survivor of a failed collective names the missing ranks
(``RankWatch.culprits``) when the other failed ranks end their processes.

tests/test_cluster.py's stalled-rank case named ranks [0, 2] for a stalled
rank 2 (a local suite run and a fresh-clone ``.ci/run``, 2026-11-29). Two
ways a rank that failed too could look dead, each tested with real processes
(a gloo rank on a TCPStore) ending with ``os._exit``, as multiprocessing ends a rank:

* its ``ended`` record was queued on the writer thread and lost at exit;
* it hosted the store (rank 0 under env://), so the survivor's second read
  of the records got no answer, which counted as every record gone.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import torch.distributed as dist

from dcp_ext._runtime.rank_watch import (  # imported once, before the forks
    SAVE_PHASES,
    Member,
    RankWatch,
    WatchedGroup,
    watched_group,
)


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


def _host_store(port_out: Any) -> None:
    """(a child) Serve the rendezvous store, as rank 0 does under env://, until killed."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port_out.put(master.port)
    while True:
        time.sleep(1)


def _diagnose_while_the_store_goes(port: int, host_pid: int, out: Any) -> None:
    """(a child) Rank 1 of 3 diagnoses a failed collective; rank 0 (hosting the
    store, failed too) ends during the diagnosis; rank 2 is stalled in ``write_data``."""
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
    dist.init_process_group("gloo", store=client, rank=0, world_size=1)
    members = tuple(Member(rank, f"host{rank}", f"10.0.0.{rank}") for rank in range(3))
    group = WatchedGroup(dist.group.WORLD, members, 5.0, "gtest")
    watch = RankWatch(group, SAVE_PHASES, interval=1.0)
    watch.rank = 1  # this process plays rank 1; the others' records are written as they would be
    watch.phase("written")
    store = dist.distributed_c10d._get_default_store()
    store.set(watch._key(0), json.dumps(["written", time.time(), 7]))
    store.set(watch._key(2), json.dumps(["write_data", time.time() - 9, 9]))
    threading.Timer(0.5, os.kill, (host_pid, signal.SIGKILL)).start()  # between the two reads, 1.5 s apart
    culprits, step = watch.culprits()
    out.put(([(c.member.rank, c.reason) for c in culprits], step))
    out.close()
    out.join_thread()
    os._exit(0)


def test_the_store_going_between_the_two_reads_does_not_blame_every_rank() -> None:
    """Rank 0, which hosts the store under env://, failed too and its process
    ended between the survivor's two reads of the records: only the stalled rank is named."""
    ctx = multiprocessing.get_context("fork")
    ports, out = ctx.Queue(), ctx.Queue()
    host = ctx.Process(target=_host_store, args=(ports,))
    host.start()
    try:
        rank1 = ctx.Process(target=_diagnose_while_the_store_goes, args=(ports.get(timeout=30), host.pid, out))
        rank1.start()
        culprits, step = out.get(timeout=60)
        rank1.join(30)
    finally:
        host.kill()
        host.join(10)
    assert step == "written"
    assert culprits == [(2, culprits[0][1])] and "alive but still in 'write_data'" in culprits[0][1], culprits
