"""Tiers across real hosts (issue 41, tests 4 and 5): tiered saves with
``replicas=1`` on the 3-host namespace cluster (tests/support/cluster.py), one
rank per host, each host's local tier in its own node-local directory, the
persistent root on the cluster's S3 server (SeaweedFS).

A host is lost (its processes killed, its directory wiped: a replacement
host) and the new world restores from the survivors' copies and replicas;
a host is cut from the others in the middle of the replica exchange and the
save fails typed, naming it, while every later restore reads only completely
written copies. One cluster serves the module; skipped without root, never
under ``CI=true``. Rank functions: tests/support/cluster_tier_workers.py.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from dcp_ext.layout import partial_dir
from dcp_ext.metadata import METADATA_FILE
from tests.support import cluster_tier_workers as workers
from tests.support.cluster import Cluster, cluster_fixture

TIMEOUT = 8.0  # collective_timeout of every save and restore here
BOUND = TIMEOUT + 30.0  # what the issue allows a survivor
PIECE = 512 << 10  # replicas cross in pieces of this size: a 2 MiB file in 4
TMP_MARK = ".dcp_ext-tmp-"  # a file being written (dcp_ext.storage's atomic writers)

cluster = cluster_fixture(3)


@pytest.fixture(scope="module")
def bucket(cluster: Cluster) -> str:
    assert cluster.s3 is not None
    cluster.s3.boto3_client().create_bucket(Bucket="tiers")
    return "tiers"


def _run(cluster: Cluster, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
    return cluster.spawn(fn, args=args, kwargs=kwargs, final_barrier=False, pg_timeout=60, timeout=150).check()


def _tag_files(cluster: Cluster, host: int, tier: str, tag: str) -> dict[str, bytes]:
    """Every file of ``tag`` in host ``host``'s local tier ``tier``, by name (read from outside the host)."""
    folder = cluster.hosts[host].local_dir / tier / partial_dir(tag)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else {}


def _check_restore(reports: list[dict[str, Any]], tag: str, fetches: list[tuple[str, int, int]],
                   healed: list[int]) -> None:
    """Every rank restored ``tag`` bit-exact from the local tiers alone, healing as planned."""
    for rank, report in enumerate(reports):
        assert report["tag"] == tag and report["same"], (rank, report)
        assert report["local_complete"] and report["fetches"] == fetches and report["healed_nodes"] == healed, report
        # Bytes counted by the restore's reader: none from the root, even where it is a source.
        assert report["by_source"]["local"] > 0 and report["by_source"].get("root", 0) == 0, (rank, report)
        assert set(report["files_by_source"].values()) == {"local"}, (rank, report)
        assert f"model_rank{rank}.distcp" in report["files_by_source"], (rank, report)


def test_a_lost_host_restores_from_its_peers_bit_exact_with_no_byte_from_s3(cluster: Cluster, bucket: str) -> None:
    """Test 4: step1 and step2 saved tiered (each drained to S3) by 3 hosts;
    host 1's processes are killed while the job runs and its node-local
    directory is wiped (a replacement host). A new world restores step2 on
    every rank bit-exact: ranks 0 and 2 from their own tiers, rank 1 from
    node 2's replica of its files, sent over the process group; 0 bytes from
    S3, which is a source of the restore (step2 is there too), counted by
    the reader. Node 1 is healed: step2 committed again in its tier, its file
    identical to the one it lost."""
    assert cluster.s3 is not None
    options, root, tier = cluster.s3.storage_options(), f"s3://{bucket}/lost-host", str(cluster.local_path / "t4")
    hold = Path(cluster.base_dir) / "t4-hold"
    run = cluster.spawn(workers.save, args=(tier, root, options, TIMEOUT, [(1, True), (2, True)]),
                        kwargs={"hold": str(hold)}, final_barrier=False, pg_timeout=60, timeout=150)
    # The job "trains" once both saves are drained; then host 1 dies.
    deadline = time.monotonic() + 120
    while not all(Path(f"{hold}.{rank}").exists() for rank in range(3)):
        assert time.monotonic() < deadline, "the saves did not end"
        time.sleep(0.05)
    before = _tag_files(cluster, 1, "t4", "step2")
    # Node 1 holds its own file and its partner node 0's replica; node 2 holds node 1's.
    assert {"model_rank0.distcp", "model_rank1.distcp"} <= set(before), sorted(before)
    assert _tag_files(cluster, 2, "t4", "step2")["model_rank1.distcp"] == before["model_rank1.distcp"]
    killed = cluster.kill_host(1)
    assert killed, "host 1 ran no process"
    shutil.rmtree(cluster.hosts[1].local_dir / "t4")
    hold.touch()
    results = run.wait()
    assert results[1].value is None, results[1].describe()  # killed
    for result in (results[0], results[2]):
        assert result.value is not None and [o["ok"] for o in result.value] == [True, True], result.describe()

    reports = _run(cluster, workers.restore, tier, root, options, TIMEOUT)
    _check_restore(reports, "step2", fetches=[("model_rank1.distcp", 2, 1)], healed=[1])
    assert all(report["in_root"] for report in reports)  # S3 was a source: its count above is a real 0
    healed = _tag_files(cluster, 1, "t4", "step2")
    assert healed["model_rank1.distcp"] == before["model_rank1.distcp"] and METADATA_FILE in healed, sorted(healed)
    assert healed[METADATA_FILE] == before[METADATA_FILE]


def test_a_host_cut_off_during_the_replica_exchange_fails_typed_and_no_partial_replica_is_read(
        cluster: Cluster, bucket: str) -> None:
    """Test 5: step1 saved tiered and drained; in step2's replica exchange
    host 2 is cut from the other hosts (its rank paused at ``mid_replication``
    till the cut; replicas cross in 512 KiB pieces, so at most the first
    piece of node 1's 2 MiB file reaches node 2). Step2 was committed on every node before any
    replica was sent, so the save cannot "commit with the replicas it has";
    it fails: both survivors raise RankFailedError naming rank 2 and its host
    within collective_timeout + 30 s, saying step2 is committed in every
    local tier with replicas possibly incomplete; the cut host raises it too,
    naming rank 0 (the store's host it cannot reach). Only whole replicas
    exist afterwards. With the link back, a new world restores step2
    bit-exact from each node's own copy; then node 1 is wiped and node 2
    given a truncated copy of node 1's file under its name (a replica not
    completely written): the restore does not trust it and restores step1,
    healing node 1 from node 2's whole step1 replica, 0 bytes from S3."""
    assert cluster.s3 is not None
    options, root, tier = cluster.s3.storage_options(), f"s3://{bucket}/partition", str(cluster.local_path / "t5")
    gate = Path(cluster.base_dir) / "t5-gate"
    run = cluster.spawn(workers.save, args=(tier, root, options, TIMEOUT, [(1, True), (2, False)]),
                        kwargs={"victim": 2, "point": "mid_replication", "gate": str(gate), "piece": PIECE},
                        final_barrier=False, pg_timeout=60, timeout=150)
    deadline = time.monotonic() + 120
    while not Path(f"{gate}.reached").exists():
        assert time.monotonic() < deadline, "rank 2 never reached mid_replication"
        time.sleep(0.05)
    cluster.cut_link(2, "hosts")
    gate.touch()
    results = run.wait()
    host2 = cluster.hosts[2].name
    for result in results:
        assert result.value is not None and len(result.value) == 2 and result.value[0]["ok"], result.describe()
        outcome = result.value[1]
        assert not outcome["ok"] and outcome["type"] == "RankFailedError", outcome
        assert outcome["seconds"] <= BOUND and outcome["step"] in ("replicate", "replicated"), outcome
        assert "Checkpoint 'step2' is committed in every node's local tier" in outcome["message"], outcome
        if result.rank == 2:  # its side of the cut: the store's host (host 0) does not answer
            assert outcome["ranks"] == [0] and "rendezvous store" in outcome["message"], outcome
        else:
            assert outcome["ranks"] == [2] and outcome["hosts"] == [host2], outcome
            assert f"rank 2 on {host2}" in outcome["message"] and "silent" in outcome["message"], outcome
    # Step2 is committed everywhere with every rank's own file; of the replicas only the
    # one that crossed no cut (node 0's on node 1) exists; nothing half written is left.
    files = [_tag_files(cluster, h, "t5", "step2") for h in range(3)]
    for host, found in enumerate(files):
        assert METADATA_FILE in found and f"model_rank{host}.distcp" in found, (host, sorted(found))
        assert not [name for name in found if TMP_MARK in name], (host, sorted(found))
    assert files[1]["model_rank0.distcp"] == files[0]["model_rank0.distcp"]
    assert "model_rank2.distcp" not in files[0] and "model_rank1.distcp" not in files[2], [sorted(f) for f in files]

    cluster.restore_link(2)
    reports = _run(cluster, workers.restore, tier, root, options, TIMEOUT)
    _check_restore(reports, "step2", fetches=[], healed=[])  # each node's own copy; no replica needed

    # A replacement node 1, and node 2 holding a truncated copy of node 1's step2 file under its name.
    lost = files[1]["model_rank1.distcp"]
    shutil.rmtree(cluster.hosts[1].local_dir / "t5")
    planted = cluster.hosts[2].local_dir / "t5" / partial_dir("step2") / "model_rank1.distcp"
    planted.write_bytes(lost[:PIECE])
    reports = _run(cluster, workers.restore, tier, root, options, TIMEOUT)
    _check_restore(reports, "step1", fetches=[("model_rank1.distcp", 2, 1)], healed=[1])
    assert all(report["in_root"] for report in reports)
    assert (cluster.hosts[1].local_dir / "t5" / partial_dir("step1") / METADATA_FILE).exists()
    assert not (cluster.hosts[1].local_dir / "t5" / partial_dir("step2")).exists()
