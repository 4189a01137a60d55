"""Read-once loads: stored bytes several ranks need are read once and exchanged.

Real gloo worlds: DDP (4 ranks need everything), HSDP 2x2 (each half needed
by two ranks), FSDP2 with replicated buffers, 4 -> 3 resharding; bit-exact,
with the bytes each rank read from storage counted; a damaged file and a rank
failing mid-exchange make every rank raise the same error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dcp_ext.dcp_io._read_once import MIN_PIECE, RankExchange, plan_read_once
from tests.support import dist, read_once_workers
from tests.support.dist import run_world

_SLACK = 1.05


def test_replicated_loads_read_every_byte_once(tmp_path: Path) -> None:
    four = run_world(4, read_once_workers.four_rank_suite, str(tmp_path), timeout=300)
    three = run_world(3, read_once_workers.three_rank_reshard, str(tmp_path), timeout=240)

    def check(rows: list[dict], stored: int, what: str, needed_per_rank: int | None = None) -> list[int]:
        assert all(not r["diff"] for r in rows), (what, [r["diff"][:3] for r in rows])
        per_rank = [r["bytes_read"] for r in rows]
        print(f"{what}: stored {stored}, bytes read per rank {per_rank}, sent {[r['sent'] for r in rows]}, "
              f"received {[r['received'] for r in rows]}, batches {rows[0]['batches']}")
        assert sum(per_rank) <= stored * _SLACK, (what, per_rank, stored)
        return per_rank

    ddp_stored = four[0]["ddp_stored"]
    per_rank = check([r["ddp/True"] for r in four], ddp_stored, "DDP 4 read-once")
    # Spread evenly: the 24 MiB tensor is split among owners, so no rank reads much more than its share.
    assert max(per_rank) <= ddp_stored / 4 * 1.3 + MIN_PIECE, per_rank
    assert all(r["ddp/True"]["received"] > 0 and r["ddp/True"]["sent"] > 0 for r in four)
    # Today's path (read_once=False): every rank reads everything.
    naive = [r["ddp/False"] for r in four]
    assert all(not r["diff"] for r in naive)
    assert sum(r["bytes_read"] for r in naive) >= 4 * ddp_stored * 0.99
    assert all(r["received"] == 0 for r in naive)
    # Same host: everything through shared memory; network only: nothing
    # through it; two simulated nodes: both, each item to the other node once
    # per receiver there.
    assert all(r["ddp/True"]["remote"] == 0 and r["ddp/True"]["nearby"] > 0 for r in four)
    network = [r["ddp/network"] for r in four]
    check(network, ddp_stored, "DDP 4 network only")
    assert all(r["nearby"] == 0 and r["remote"] > 0 for r in network)
    auto = [r["ddp/auto_one_host"] for r in four]
    assert all(not r["diff"] and r["received"] == 0 for r in auto)
    assert sum(r["bytes_read"] for r in auto) >= 4 * ddp_stored * 0.99
    mixed = [r["ddp/two_nodes"] for r in four]
    check(mixed, ddp_stored, "DDP 4 as two nodes")
    assert all(r["nearby"] > 0 and r["remote"] > 0 for r in mixed)
    small = [r["ddp/small_batches"] for r in four]
    check(small, ddp_stored, "DDP 4 read-once, 1 MiB batches")
    assert small[0]["batches"] >= 8

    hsdp = check([r["hsdp"] for r in four], four[0]["hsdp_stored"], "HSDP 2x2")
    assert min(hsdp) > 0  # every rank reads part of its half

    fsdp = [r["fsdp"] for r in four]
    check(fsdp, four[0]["fsdp_stored"], "FSDP2 + buffers")
    # The buffers (needed by every rank) travel: received bytes cover 3/4 of them per rank on average.
    assert sum(r["received"] for r in fsdp) >= 3 * four[0]["fsdp_buffer_bytes"]

    # Failures: the same error on every rank, quickly.
    for case, expected_type in (("damaged", "ChecksumMismatchError"), ("mid_exchange", "InjectedFailure")):
        rows = [r[case] for r in four]
        assert {(r["type"], r["message"]) for r in rows} == {(expected_type, rows[0]["message"])}, rows
        assert all(r["seconds"] < 30 for r in rows), rows
    assert "ddp_damaged" in four[0]["damaged"]["message"]
    assert four[0]["shm_left"] == []  # no segment left behind, failures included
    after = [r["after_failures"] for r in four]
    check(after, ddp_stored, "DDP 4 after the failures")

    # 4 -> 3.
    check([r["ddp"] for r in three], ddp_stored, "DDP checkpoint on 3 ranks")
    check([r["hsdp"] for r in three], four[0]["hsdp_stored"], "HSDP checkpoint whole on 3 ranks")
    # Sharded over 3 (uneven rows): bit-exact; only the 0-d and non-tensor
    # values are shared, so read-once reads no more than each rank alone
    # (both read whole frames at the shard boundaries).
    resharded = [r["hsdp_to_fsdp3/True"] for r in three]
    alone = [r["hsdp_to_fsdp3/False"] for r in three]
    assert all(not r["diff"] for r in resharded + alone)
    assert sum(r["bytes_read"] for r in resharded) < sum(r["bytes_read"] for r in alone)
    assert sum(r["received"] for r in resharded) > 0


def test_plan_read_once_spreads_and_splits() -> None:
    """The planner alone: ownership is balanced, big items split at the cuts,
    every item read or received exactly once per rank, sends match receives."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    def item(fqn: str, rows: int) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, (0, 0)), torch.Size((0, 0)),
                        MetadataIndex(fqn, (0, 0)), torch.Size((0, 0)), torch.Size((rows, 1024)))

    sizes = {"a": 64, "b": 8192, "c": 16, "d": 2048}  # rows of 4 KiB fp32
    plans = [LoadPlan([item(k, n) for k, n in sizes.items()]) for _ in range(4)]
    out = plan_read_once(plans, lambda i: int(i.lengths[0]) * 4096,
                         lambda i: ("f", "abcd".index(i.storage_index.fqn), tuple(i.storage_offsets)), 8 << 20)
    parts = [p.storage_data for p in out]
    assert all(isinstance(p, RankExchange) for p in parts)
    owned = [sum(s.nbytes for s in p.sends) for p in parts]
    total = sum(sizes.values()) * 4096
    assert sum(owned) == total
    assert max(owned) - min(owned) <= MIN_PIECE * 2, owned
    for rank, (plan, part) in enumerate(zip(out, parts)):
        rows = sum(int(i.lengths[0]) for i in plan.items)
        assert rows == sum(sizes.values())  # the rank gets all its data, split or not
        assert {s.item for s in part.sends} | part.skipped == set(range(len(plan.items)))
        for r in part.receives:
            sender = parts[r.owner]
            match = [s for s in sender.sends if rank in s.receivers and s.batch == r.batch
                     and out[r.owner].items[s.item].storage_offsets == plan.items[r.item].storage_offsets
                     and out[r.owner].items[s.item].storage_index == plan.items[r.item].storage_index]
            assert len(match) == 1
    assert parts[0].batches == max(s.batch for p in parts for s in p.sends) + 1 >= 2


def test_automatic_read_once_skips_exchanges_that_spare_little() -> None:
    """``read_once=None``: a small load sharing only small values reads them
    on each rank; a large share, or a large world, still exchanges."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from dcp_ext.dcp_io._read_once import AUTO_MIN_SAVED_PER_RANK, AUTO_SMALL_WORLD, auto_min_saved

    def item(fqn: str, rows: int) -> ReadItem:
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, (0, 0)), torch.Size((0, 0)),
                        MetadataIndex(fqn, (0, 0)), torch.Size((0, 0)), torch.Size((rows, 1024)))

    def plan(rows: int, world: int) -> list[LoadPlan]:
        plans = [LoadPlan([item("norm", rows), item(f"own{rank}", 64)]) for rank in range(world)]
        # Only "norm" is shared; each rank's own shard is not.
        return plan_read_once(plans, lambda i: int(i.lengths[0]) * 4096,
                              lambda i: ("f", i.storage_index.fqn, tuple(i.storage_offsets)), 8 << 20,
                              min_saved=auto_min_saved(world))

    assert auto_min_saved(2) == 2 * AUTO_MIN_SAVED_PER_RANK
    assert auto_min_saved(AUTO_SMALL_WORLD + 1) == 0
    small = plan(4, 2)  # 16 KiB shared by 2 ranks
    assert all(p.storage_data is None for p in small)
    assert [len(p.items) for p in small] == [2, 2]
    large = plan(1024, 2)  # 4 MiB shared by 2 ranks: spares 4 MiB
    assert all(isinstance(p.storage_data, RankExchange) for p in large)
    wide = plan(4, AUTO_SMALL_WORLD + 1)
    assert all(isinstance(p.storage_data, RankExchange) for p in wide)


def test_a_rank_killed_mid_exchange_stops_the_others_quickly(tmp_path: Path) -> None:
    """Rank 2 of 4 is SIGKILLed as the second exchange batch starts: the other
    three raise ReadOnceExchangeError (dcp_ext.load raises it; stock dcp.load
    raises gloo's error from its next collective) within seconds, and no
    shared-memory segment of the load is left, the dead rank's included."""
    import queue

    ctx = dist.context()  # the suite's: ranks forked from a server that imported torch once
    results = ctx.Queue()
    procs = [dist.process(ctx, read_once_workers.killed_rank_job,
                          (rank, 4, str(tmp_path / "rendezvous"), str(tmp_path), results)) for rank in range(4)]
    for proc in procs:
        proc.start()
    outcomes = []
    try:
        for _ in range(3):
            outcomes.append(results.get(timeout=120))
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert procs[2].exitcode == -9
    assert sorted(o["rank"] for o in outcomes) == [0, 1, 3], outcomes
    assert all(o["error"] == "ReadOnceExchangeError" and o["seconds"] < 30 for o in outcomes), outcomes
    exchange_id = outcomes[0]["exchange_id"]
    assert exchange_id and not list(Path("/dev/shm").glob(f"dcp_ext-{exchange_id}-*"))
