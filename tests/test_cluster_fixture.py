"""The namespace cluster of tests/support/cluster.py: hosts, S3, ranks, cuts, kills, cleanup.

One 3-host cluster with S3 serves the module; the cleanup tests build their own.
Each test needs root and iproute2: it skips without them, and fails under ``CI=true``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import cluster as cluster_module
from tests.support import cluster_workers as workers
from tests.support.cluster import Availability, Cluster, cluster_fixture, require_cluster
from tests.support.cluster_reaper import REGISTRY, netns_pids, sweep_stale

BUCKET = "cluster-fixture"
PROBE_TIMEOUT = 1.0


cluster = cluster_fixture(3)


@pytest.fixture(scope="module")
def bucket(cluster: Cluster) -> str:
    assert cluster.s3 is not None
    cluster.s3.boto3_client().create_bucket(Bucket=BUCKET)
    return BUCKET


def _netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_hosts_have_their_own_name_address_and_node_local_directory(cluster: Cluster) -> None:
    # start="exec": a fresh interpreter per process through `ip netns exec ... unshare --uts`.
    facts = cluster.run(workers.host_facts, start="exec", init_process_group=False, timeout=60)
    assert len({h.name for h in cluster.hosts}) == 3 and len({h.ip for h in cluster.hosts}) == 3
    for host, seen in zip(cluster.hosts, facts):
        assert seen["hostname"] == host.name and seen["loopback"]
        assert seen["source_ip"] == host.ip and seen["resolved"] == host.ip
        # Its own node-local files only, at the same path on every host; the other hosts' are hidden.
        assert seen["local_files"] == [f"rank{host.index}"] and seen["hosts_dir_visible"] == []
        assert (host.local_dir / f"rank{host.index}").read_text() == host.name


def test_ranks_on_three_hosts_form_one_gloo_world(cluster: Cluster) -> None:
    # start="fork" (the default): ranks forked from the fork server enter the hosts themselves.
    results = cluster.spawn(workers.identity, timeout=60).wait()
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results)
    names = [h.name for h in cluster.hosts]
    for host, result in zip(cluster.hosts, results):
        seen = result.value
        assert (seen["hostname"], seen["source_ip"], seen["resolved"]) == (host.name, host.ip, host.ip)
        assert seen["all_reduce"] == 6.0 and seen["gathered_names"] == names
        assert seen["local_files"] == [f"rank{host.index}"]


def test_every_host_reaches_s3(cluster: Cluster, bucket: str) -> None:
    got = cluster.run(workers.s3_roundtrip, args=(cluster.s3, bucket), init_process_group=False, timeout=60)
    assert got == [f"hello/{h.name}".encode() for h in cluster.hosts]
    assert cluster.s3 is not None
    listed = cluster.s3.boto3_client().list_objects_v2(Bucket=bucket, Prefix="hello/")["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted(f"hello/{h.name}" for h in cluster.hosts)


def test_a_cut_to_s3_times_out_that_host_only_until_restored(cluster: Cluster, bucket: str) -> None:
    cut = cluster.hosts[1]
    cluster.cut_link(cut, "s3")
    try:
        results = cluster.run(workers.all_reduce_and_s3_probe, args=(cluster.s3, bucket, PROBE_TIMEOUT), timeout=60)
    finally:
        cluster.restore_link(cut)
    for host, seen in zip(cluster.hosts, results):
        assert seen["all_reduce"] == [3.0] * 4  # host-to-host gloo still works
        if host is cut:
            # Silence, not a refusal or a reset: the connect waits out its whole timeout.
            assert seen["connect"] == "timeout" and seen["connect_seconds"] >= PROBE_TIMEOUT - 0.1
            assert seen["boto3"] == "ConnectTimeoutError"
        else:
            assert (seen["connect"], seen["boto3"]) == ("ok", "ok")
    after = cluster.run(workers.s3_probe, args=(cluster.s3, bucket, PROBE_TIMEOUT), init_process_group=False,
                        timeout=60)
    assert [(seen["connect"], seen["boto3"]) for seen in after] == [("ok", "ok")] * 3


def test_a_host_cut_off_mid_collective_leaves_the_others_waiting_until_the_pg_timeout(
        cluster: Cluster, tmp_path: Path) -> None:
    pg_timeout = 5.0
    run = cluster.spawn(workers.collective_across_cut, args=(str(tmp_path), 1), pg_timeout=pg_timeout,
                        final_barrier=False, timeout=60)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # ranks 0 and 2 are inside the all_reduce, waiting for rank 1
    cluster.cut_link(1, "hosts")
    (tmp_path / "cut").write_text(repr(time.time()))
    try:
        results = run.wait()
    finally:
        cluster.restore_link(1)
    for r in results:
        seen = r.value
        assert seen is not None, r.describe()
        # gloo honours the process group's timeout for a peer gone silent: RuntimeError
        # "Timed out waiting 5000ms for recv/send operation to complete", naming no peer.
        assert seen["error"] == "builtins.RuntimeError", r.describe()
        assert "Timed out waiting 5000ms" in seen["message"]
        assert pg_timeout - 0.5 <= seen["seconds_in_collective"] <= pg_timeout + 5
    assert cluster.run(workers.all_reduce_once, timeout=60) == [3.0] * 3  # restored


def test_kill_host_kills_every_process_and_peers_hear_a_close(cluster: Cluster, tmp_path: Path) -> None:
    victim = cluster.hosts[2]
    untracked = cluster.popen(victim, ["sh", "-c", "sleep 300 & sleep 300 & wait"])
    server = cluster.spawn(workers.serve_until_killed, args=(7001, str(tmp_path / "serving")),
                           hosts=[victim.index], init_process_group=False, timeout=60)
    _wait_for(tmp_path / "serving")
    client = cluster.spawn(workers.connect_and_wait, args=(victim.ip, 7001, str(tmp_path / "connected"), 10.0),
                           hosts=[0], init_process_group=False, timeout=60)
    _wait_for(tmp_path / "connected")
    before = set(cluster.pids(victim))
    assert untracked.pid in before and set(server.pids.values()) <= before and len(before) >= 4

    killed = cluster.kill_host(victim)

    assert set(killed) >= before and cluster.pids(victim) == []
    assert untracked.wait(timeout=5) == -signal.SIGKILL
    assert server.wait()[0].exit_code == -signal.SIGKILL
    seen = client.check()[0]
    assert seen["outcome"] == "closed" and seen["seconds"] < 2  # the kernel closed the dead process's socket
    assert cluster.check_output(0, ["hostname"]).strip() == cluster.hosts[0].name  # the others live on


def test_a_silent_kill_leaves_peers_hearing_nothing(cluster: Cluster, tmp_path: Path) -> None:
    victim = cluster.hosts[2]
    cluster.spawn(workers.serve_until_killed, args=(7002, str(tmp_path / "serving")), hosts=[victim.index],
                  init_process_group=False, timeout=60)
    _wait_for(tmp_path / "serving")
    client = cluster.spawn(workers.connect_and_wait, args=(victim.ip, 7002, str(tmp_path / "connected"), 1.5),
                           hosts=[0], init_process_group=False, timeout=60)
    _wait_for(tmp_path / "connected")
    try:
        cluster.kill_host(victim, silent=True)
        assert cluster.pids(victim) == []
        seen = client.check()[0]
    finally:
        cluster.restore_link(victim)
    assert seen["outcome"] == "silence" and seen["seconds"] >= 1.4


def test_close_removes_every_namespace_link_process_and_directory() -> None:
    require_cluster()
    c = Cluster(3).start()
    sleeper = c.popen(c.hosts[0], ["sleep", "300"])
    assert _eventually(lambda: sleeper.pid in c.pids(0))
    names, link, base = c.netns_names, c.root_link, c.base_dir
    record = REGISTRY / f"{c.cluster_id}.json"
    pids = [pid for ns in names for pid in netns_pids(ns)]  # weed and sleep
    assert len(pids) >= 2 and all(n in _netns_list() for n in names) and link in _links() and record.exists()
    c.close()
    assert sleeper.returncode == -signal.SIGKILL
    c.close()  # idempotent
    listed, links = _netns_list(), _links()
    assert not any(n in listed for n in names) and c.cluster_id not in listed and link not in links
    assert not base.exists() and not record.exists()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def _start_owner() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    code = ("import json, sys, time\n"
            "from tests.support.cluster import Cluster\n"
            "c = Cluster(2, s3=False).start()\n"
            "c.popen(0, ['sleep', '300'])\n"
            "print(json.dumps({'netns': c.netns_names, 'base': str(c.base_dir), 'link': c.root_link,"
            " 'watchdog': c._watchdog.pid}), flush=True)\n"
            "time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line, "the owner process failed to build its cluster"
    return owner, json.loads(line)


def _gone(made: dict[str, Any]) -> bool:
    listed = _netns_list()
    return not any(str(n) in listed for n in made["netns"]) and not Path(str(made["base"])).exists() \
        and str(made["link"]) not in _links()


def test_a_killed_owner_is_cleaned_up_by_its_watchdog_or_the_next_sweep() -> None:
    require_cluster(s3=False)
    # SIGKILL: no atexit, no finally; the watchdog sees its pipe close.
    owner, made = _start_owner()
    owner.kill()
    owner.wait()
    assert _eventually(lambda: _gone(made)), made
    # Watchdog killed too: the leftovers wait for the next cluster's sweep.
    owner, made = _start_owner()
    os.kill(int(str(made["watchdog"])), signal.SIGKILL)
    owner.kill()
    owner.wait()
    time.sleep(0.2)
    assert not _gone(made)
    sweep_stale()
    assert _gone(made)


def test_require_cluster_skips_here_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cluster_module._AVAILABILITY, True, Availability(False, "no namespaces in this test"))
    assert not Cluster.available()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no namespaces in this test"):
        require_cluster()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no namespaces in this test"):
        require_cluster()


def _wait_for(path: Path, seconds: float = 30.0) -> None:
    assert _eventually(path.exists, seconds), f"{path} did not appear"


def _eventually(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()
