"""Tiered checkpoints: node-local tiers in front of the persistent root.

Four gloo ranks play two nodes (two ranks each), each node with its own
local-tier directory under ``tmp_path``; the worlds run
``tests/support/tier_workers.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests.support.backends import BUCKET
from tests.support.dist import run_world
from tests.support.tier_workers import reshard_restore, tier_suite


def test_local_saves_drains_and_restores_from_the_fastest_intact_copy(tmp_path: Path, moto_server) -> None:
    root = f"s3://{BUCKET}/tiers-{uuid.uuid4().hex[:8]}"
    local_base = tmp_path / "local"
    reports = run_world(4, tier_suite, root, str(local_base), moto_server.storage_options(), timeout=400)
    r0 = reports[0]
    # A different world (2 ranks, one per node) restores f2 of the 4-rank
    # world: from the root's listing, each rank reading its node's files locally.
    resharded = run_world(2, reshard_restore, r0["second_root"], str(local_base), moto_server.storage_options(),
                          timeout=200)
    for report in resharded:
        assert report["tag"] == "f2" and not report["local_complete"], report
        assert report["by_source"]["local"] > 0, report
    # Only what the other node holds comes from the root: none for rank 0 (it
    # needs saved ranks 0-1, its node's); for rank 1 (saved ranks 2-3 and one
    # row of 513 from saved rank 1, on node 0) rank 1's files.
    assert resharded[0]["from_root"] == [] and resharded[0]["by_source"]["root"] == 0, resharded[0]
    assert resharded[1]["from_root"] == ["model_rank1.distcp", "optimizer_rank1.distcp"], resharded[1]
    # f1 is in no root: each node was sent the other node's 4 shard files (the
    # replicated files are on both), and nothing was read from any root.
    for report in resharded:
        f1 = report["f1"]
        assert f1["tag"] == "f1" and f1["gathered"] and f1["fetched"] == 8, f1
        assert f1["by_source"]["local"] > 0 and f1["by_source"].get("root", 0) == 0, f1
    # Saves: s1 and s3 stayed local, s2 (the 2nd save, persist_every=2) was drained.
    for report in reports[::2]:  # one rank per node
        assert report["local_tags"] == ["s2_partial", "s3_partial"], report["local_tags"]  # keep_local=2
        assert report["local_newest"] == "s3"
    assert r0["root_tags"] == ["s2"] and r0["root_newest"] == "s2"
    # Each node's tier holds its own ranks' shards, and every rank's
    # replicated items (Adam's steps, param_groups), which every rank loads.
    def sharded(files: list[str]) -> list[str]:
        return [f for f in files if f.endswith(".distcp") and not f.startswith("replicated_")]

    assert sharded(r0["local_files_s3"]) == [
        "model_rank0.distcp", "model_rank1.distcp", "optimizer_rank0.distcp", "optimizer_rank1.distcp"]
    assert sharded(reports[2]["local_files_s3"]) == [
        "model_rank2.distcp", "model_rank3.distcp", "optimizer_rank2.distcp", "optimizer_rank3.distcp"]
    shared = [f for f in r0["local_files_s3"] if f.startswith("replicated_")]
    assert shared and shared == [f for f in reports[2]["local_files_s3"] if f.startswith("replicated_")]
    for rank, report in enumerate(reports):
        # The newest tag from the local tiers: nothing from the root.
        assert report["restore_local"]["local"] > 0 and "root" not in report["restore_local"], (rank, report)
        # Node 1 wiped: node 0 reads s2 locally, node 1 from the root.
        wiped = report["restore_wiped"]
        if rank < 2:
            assert wiped["local"] > 0 and wiped["root"] == 0, (rank, wiped)
        else:
            assert "local" not in wiped and wiped["root"] > 0, (rank, wiped)
    # The damaged file of rank 0 came from the root; rank 1 read only locally.
    assert reports[0]["restore_damaged"]["root"] > 0
    assert reports[1]["restore_damaged"]["root"] == 0 and reports[1]["restore_damaged"]["local"] > 0
    # A failed drain: the same error on every rank; the retry drained f2.
    errors = {report["drain_error"] for report in reports}
    assert len(errors) == 1 and None not in errors, errors
    assert r0["after_retry_root_tags"] == ["f2"] and r0["after_retry_root_newest"] == "f2"
    # A full tier on node 1: the same error on every rank, the save in the root only.
    assert len({report["full_error"] for report in reports}) == 1
    assert "node 1's local tier" in r0["full_error"] and "saved straight to" in r0["full_error"], r0["full_error"]
    assert r0["full_root_tags"] == ["t1"] and not any(report["full_local_has_t1"] for report in reports)
    for report in reports:
        assert report["restore_past_full"].get("local", 0) == 0 and report["restore_past_full"]["root"] > 0, report
    # Replicas: each node keeps its partner's files too.
    assert sharded(r0["replica_files_r1"]) == sorted(
        f"{kind}_rank{r}.distcp" for kind in ("model", "optimizer") for r in range(4)), r0["replica_files_r1"]
    for rank, report in enumerate(reports):
        # Node 1 wiped: its files came from node 0 over the process group, none from the root.
        assert "root" not in report["restore_from_replica"], (rank, report["restore_from_replica"])
        assert report["restore_from_replica"]["local"] > 0
        # Node 1's 4 shard files and the replicated files, from node 0.
        assert report["replica_fetches"] == 4 + len(shared) and report["healed_has_metadata"]
        # Both nodes wiped: the persisted p1, all from the root.
        assert "local" not in report["restore_both_wiped"] and report["restore_both_wiped"]["root"] > 0
    # Incremental with the tiers (zstd, S3 root, persist_every=2, KeepLast(2) in the root).
    inc = r0["incremental"]
    drained = inc["drained_bytes"]
    print("bytes written to the root per persisted save:", drained)
    # i2 wrote every frame; i4 and i6 only the trained layers' frames (and the small items).
    assert drained["i4"] < 0.5 * drained["i2"] and drained["i6"] < 0.5 * drained["i2"], drained
    assert inc["root_tags"] == ["i4", "i6"] and inc["root_newest"] == "i6", inc
    # i2 is deleted by retention but its frozen frames are used: retired, not gone.
    assert inc["retired"] == ["i2"] and inc["root_dirs"] == ["i2_partial", "i4_partial", "i6_partial"], inc
    assert inc["problems"] == {"missing": [], "unused": []}, inc["problems"]
    for tag, (base, chain) in {"i4": ("i2", 1), "i6": ("i4", 2)}.items():
        section = inc["sections"][tag]
        assert section[:2] == (base, chain) and section[2], (tag, section)
        assert all(name.startswith("../i2_partial/") for name in section[2]), (tag, section)
    for report in reports:
        mine = report["incremental"]
        assert mine["local_tags"] == ["i6_partial", "i7_partial"], mine["local_tags"]  # keep_local=2
        # The local tiers hold full copies: i7 and i6 read locally, no byte from the root.
        for tag in ("i7", "i6"):
            assert mine[f"restore_{tag}"]["local"] > 0 and "root" not in mine[f"restore_{tag}"], mine
        # A damaged local copy (node 0) or a wiped node: the whole tag from the root, on every rank.
        for case in ("restore_damaged", "restore_wiped"):
            assert "local" not in mine[case] and mine[case]["root"] > 0, (case, mine[case])


def test_one_process_tiers_ls_and_verify(tmp_path: Path, capsys) -> None:
    """One process (no process group): local saves, a drain, a restore from
    the local tier, and the CLI's view of the tiers."""
    import torch

    import dcp_ext
    from dcp_ext.cli import main

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optim.step()
    root, local = tmp_path / "root", tmp_path / "local"
    with dcp_ext.CheckpointManager(root, local_tier=local, persist_every=2, keep_local=None) as manager:
        manager.save("a", model, optim)
        manager.save("b", model, optim)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        manager.wait_for_persist()
        assert manager.tags() == ["b"] and manager.read_newest() == "b"
        with torch.no_grad():
            model.weight.zero_()
        manager.resume(model, optim)
        assert manager.last_restore_plan.tag == "b" and manager.last_restore_plan.local_complete
        by_source = manager.last_reader.store.bytes_by_source()
        assert by_source == {"local": manager.last_reader.store.stats.snapshot().bytes_read, "root": 0}, by_source
        assert by_source["local"] > 0
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key

    capsys.readouterr()
    assert main(["ls", str(root), "--local-tier", str(local)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "local tiers only" in rows["a"] and f"local:{local}" in rows["a"] and "persistent" not in rows["a"]
    assert f"persistent, local:{local}" in rows["b"]
    assert main(["verify", str(local / "a_partial"), "--local-copy", "-q"]) == 0
    assert "OK" in capsys.readouterr().out

    # A local tier with no room (local_tier_bytes below one save): the save
    # goes straight to the root and then raises StorageFullError naming the tier.
    tight_root, tight_local = tmp_path / "tight_root", tmp_path / "tight_local"
    with dcp_ext.CheckpointManager(tight_root, local_tier=tight_local, local_tier_bytes=4096) as manager:
        with pytest.raises(dcp_ext.StorageFullError, match=r"node 0's local tier .*tight_local has room for 4096 bytes"):
            manager.save("c", model, optim)
        assert manager.tags() == ["c"] and manager.read_newest() == "c"
        assert not (tight_local / "c_partial").exists()
        with torch.no_grad():
            model.weight.zero_()
        assert manager.resume(model, optim).tag == "c"
        by_source = manager.last_reader.store.bytes_by_source()
        assert by_source.get("local", 0) == 0 and by_source["root"] > 0, by_source
    for key, value in expected.items():
        assert torch.equal(model.state_dict()[key], value), key
    with pytest.raises(ValueError, match="local_tier must be a directory"):
        dcp_ext.CheckpointManager(tight_root, local_tier="s3://bucket/local")


@pytest.mark.parametrize("backend", ["local", "fsspec"])
def test_one_process_incremental_tiers(tmp_path: Path, backend: str) -> None:
    """One process, uncompressed, a local or an fsspec (memory://) root: a
    tiered incremental manager keeps full copies locally and drains only
    changed frames; the drained tags verify, load bit-exact from the root
    alone, and compact; a save that does not fit the tier goes straight to
    the root, incremental too."""
    import torch

    import dcp_ext
    from tests.support.tier_workers import _root_data_bytes, root_problems

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    model[0].requires_grad_(False)  # the frozen base: 1 MiB, one frame
    optim = torch.optim.Adam(model[1].parameters())
    root = str(tmp_path / "root") if backend == "local" else f"memory://dcp-ext-inc-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "local"
    expected: dict[str, dict[str, torch.Tensor]] = {}

    def data_bytes(tag: str) -> int:
        return _root_data_bytes(dcp_ext.CheckpointRoot(root), tag)

    with dcp_ext.CheckpointManager(root, local_tier=local, persist_every=2, keep_local=1, incremental=True,
                                   retention=dcp_ext.KeepLast(2)) as manager:
        for step in range(1, 7):
            model(torch.randn(4, 512)).sum().backward()
            optim.step()
            optim.zero_grad()
            manager.save(f"s{step}", model, optim)
            expected[f"s{step}"] = {k: v.clone() for k, v in model.state_dict().items()}
            manager.wait_for_persist()
        # s2 wrote every frame; s4 and s6 the trained layer (and Adam's state) only.
        assert data_bytes("s4") < 0.1 * data_bytes("s2") and data_bytes("s6") < 0.1 * data_bytes("s2")
        assert manager.tags() == ["s4", "s6"] and manager.checkpoints.retired_tags() == ["s2"]
        assert sorted(p.name for p in local.iterdir() if p.is_dir()) == ["s6_partial"]  # keep_local=1
        assert root_problems(manager.checkpoints) == {"missing": [], "unused": []}
        for tag in ("s4", "s6"):
            assert dcp_ext.verify(f"{root}/{tag}_partial").ok, tag
            fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
            dcp_ext.CheckpointManager(root).resume(fresh, tag=tag)
            assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected[tag].items()), tag
        # From the local tier: the full copy, no byte from the root.
        fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
        assert manager.resume(fresh).tag == "s6"
        assert "root" not in manager.last_reader.store.bytes_by_source()  # the root copy is not mixed in
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected["s6"].items())
        # compact makes s4 self-contained; s6 still refers to s2's files, which stay.
        assert manager.compact("s4").changed
        assert root_problems(manager.checkpoints) == {"missing": [], "unused": []}

    # A tier with no room: the save goes straight to the root, incremental on the root's newest.
    with dcp_ext.CheckpointManager(root, local_tier=tmp_path / "tight", local_tier_bytes=4096, incremental=True,
                                   retention=dcp_ext.KeepLast(2)) as tight:
        with pytest.raises(dcp_ext.StorageFullError):
            tight.save("s7", model, optim)
        section = dcp_ext.metadata.read_incremental_section(
            tight.checkpoints.partial_store("s7").read_file(dcp_ext.metadata.METADATA_FILE), "s7")
        assert section is not None and section.base == "s6" and section.references, section
        assert data_bytes("s7") < 0.1 * data_bytes("s4")
        fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
        assert tight.resume(fresh).tag == "s7"
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
        assert root_problems(tight.checkpoints) == {"missing": [], "unused": []}


def test_killed_tiered_saves_keep_every_tier_consistent(tmp_path: Path) -> None:
    """Two sequences of real 2-rank, 2-node jobs, their k-th jobs running side
    by side (each sequence on its own root and local tiers; checks between jobs).

    Plain tiered saves, killed while writing the local tier's data, during
    the local commit, replication and the drain, and at a random moment
    (one since 2026-11-27, to keep the suite under 10 minutes): after each,
    the persistent root's newest is unchanged unless the drain committed and
    loads bit-exact here (one process), and the next job
    resumes bit-exact: the killed tag itself once it had committed in both
    local tiers (after a random kill: the previous tag or the killed one).

    Incremental ones (full local copies, drains that write only the changed
    frames, KeepLast(2) in the root, every tag kept locally), killed in an
    incremental drain, during the root's retention (which retires the base
    whose frames kept tags use) and at a random moment: after each, every
    committed tag of the root loads bit-exact and no file a committed tag
    refers to is missing; after the last clean drain no data file is left
    that no committed tag uses.

    Each job is a process of its own (its own session: a kill of ``all``
    takes the job and its two ranks), forked from the suite's fork server
    instead of a fresh interpreter (see :func:`_side_by_side`)."""
    import dcp_ext
    from tests.support.tier_workers import root_problems

    # (crash, committed in both local tiers before the kill, drained); None:
    # a kill at a random moment, either outcome (the next job tells which).
    plain = [("none", True, True), ("0:mid_data", False, False), ("1:mid_local_commit", False, False),
             ("0:mid_replication", True, False), ("1:mid_drain", True, False), ("all:before_drain_commit", True, False),
             ("1:random:0.04", None, None), ("none", True, True)]
    incremental = [("none", True, True), ("none", True, True), ("1:mid_drain", True, False),
                   ("0:mid_retention", True, True), ("1:random:0.08", None, None), ("none", True, True)]
    (root, persisted, _), (incremental_root, incremental_persisted, chains) = _side_by_side(
        _killed_tiered_jobs(tmp_path / "plain", plain, incremental=False),
        _killed_tiered_jobs(tmp_path / "incremental", incremental, incremental=True),
    )
    # Plain: the last clean drain removed what the killed drains left in the root.
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert kept == sorted(f"{tag}_partial" for tag in persisted)

    # Incremental.
    checkpoints = dcp_ext.CheckpointRoot(str(incremental_root))
    assert [t.tag for t in checkpoints.committed()] == incremental_persisted[-2:], incremental_persisted
    assert root_problems(checkpoints) == {"missing": [], "unused": []}
    # step2 and step4 (killed in its retention) wrote only the changed frames; later
    # drains build on the previous persisted tag or restart the chain (restart_reason).
    assert chains["step1"] == (None, 0) and chains["step2"] == ("step1", 1), chains
    assert chains["step4"] == ("step2", 2), chains
    for before, tag in zip(incremental_persisted, incremental_persisted[1:]):
        assert chains[tag][1] == 0 or chains[tag][0] == before, chains
    assert not any(checkpoints.partial_store(t).exists(".dcp_ext.saving") for t in checkpoints.partial_tags())


def _side_by_side(*sequences: Any) -> list[Any]:
    """Drive job sequences (generators from :func:`_killed_tiered_jobs`) with
    :func:`tests.support.side_by_side.drive`; what each returns, in order.

    Each job (``tests/support/tier_crash_job.py``, the arguments of ``python
    -m tests.support.tier_crash_job``) is a process of its own, in its own
    session, forked from the suite's fork server (tests/support/forked.py)
    instead of a fresh interpreter, and forks its two ranks from itself:
    about 5 s of CPU less per job (its interpreter and its ranks' fork
    server each imported torch)."""
    from tests.support import REPO, forked
    from tests.support.side_by_side import drive

    def start(argv: list[str]) -> Any:
        return forked.start("tests.support.tier_crash_job:forked_main", argv, cwd=REPO, text=True)

    def finish(job: Any) -> tuple[int, str, str]:
        out, err = job.communicate(timeout=180)
        return job.returncode, out, err

    def abandon(job: Any) -> None:
        if job.poll() is None:
            job.kill()
            job.communicate()

    return drive(sequences, start, finish, abandon)


def _killed_tiered_jobs(
    tmp_path: Path, trials: list[tuple[str, bool | None, bool | None]], incremental: bool
) -> Generator[list[str], tuple[int, str, str], tuple[Path, list[str], dict[str, tuple[str | None, int]]]]:
    """A sequence of ``tier_crash_job`` runs, one per trial, checked after each:
    yields each job's arguments and takes back its ``(returncode, stdout,
    stderr)`` (:func:`_side_by_side` runs them); returns the root, the
    persisted tags, and (incremental) the base and chain of each as drained."""
    import subprocess

    import torch

    import dcp_ext
    from tests.support.crash_job import make_model
    from tests.support.tier_workers import root_problems

    root, local = tmp_path / "root", tmp_path / "local"
    log: list[str] = []
    newest_local: set[str] = set()  # what the next job may resume (one tag, or two after a random kill)
    drained = None
    persisted: list[str] = []
    chains: dict[str, tuple[str | None, int]] = {}
    for step, (crash, local_commit, drains) in enumerate(trials, start=1):
        args = [str(root), str(local), str(step), crash] + (["incremental"] if incremental else [])
        returncode, stdout, stderr = yield args
        run = subprocess.CompletedProcess(args, returncode, stdout, stderr)
        log.append(f"step {step} {crash}: exit {run.returncode} {run.stdout.strip()!r}")
        resumed = [line.split() for line in run.stdout.splitlines() if line.startswith("RESUMED")]
        if newest_local:
            assert len(resumed) == 1 and resumed[0][1] in newest_local and resumed[0][2] == "True", \
                "\n".join(log + [run.stderr[-3000:]])
            newest_local = {resumed[0][1]}
        if local_commit is not None:
            assert (run.returncode == 0) == (crash == "none"), "\n".join(log + [run.stderr[-3000:]])
        if local_commit or (local_commit is None and run.returncode == 0):
            newest_local = {f"step{step}"}
        elif local_commit is None:
            newest_local = newest_local | {f"step{step}"}
        persistent = dcp_ext.CheckpointRoot(str(root))
        if drains or (drains is None and persistent.newest() == f"step{step}"):
            drained = f"step{step}"
            persisted.append(drained)
            if incremental:
                section = dcp_ext.metadata.read_incremental_section(
                    persistent.partial_store(drained).read_file(dcp_ext.metadata.METADATA_FILE), drained)
                assert section is not None
                chains[drained] = (section.base, section.chain)
        assert persistent.newest() == drained, "\n".join(log)
        assert f"step{step}" in [t.tag for t in persistent.committed()] if drains else True
        # Every committed tag of the root (the newest at least) loads bit-exact from the root alone.
        for tag in [t.tag for t in persistent.committed()] if incremental else [drained] if drained else []:
            model = make_model(0, incremental)
            dcp_ext.CheckpointManager(root).resume(model, tag=tag)
            expected = make_model(int(tag.removeprefix("step")), incremental).state_dict()
            assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items()), (tag, log)
        if incremental:
            assert root_problems(persistent)["missing"] == [], "\n".join(log)
    print("\n".join(log))
    return root, persisted, chains


def test_a_full_file_system(tmp_path: Path) -> None:
    """A real full file system (a 3 MiB tmpfs mounted in a user namespace, no
    privileges needed): a plain save fails with StorageFullError and keeps the
    previous checkpoint; a tiered save that does not fit the local tier goes
    to the root and says so."""
    import json
    import shutil
    import subprocess
    import sys

    from tests.support import REPO

    unshare = shutil.which("unshare")
    assert unshare, "this test needs util-linux's unshare (user and mount namespaces)"
    run = subprocess.run([unshare, "--user", "--map-root-user", "--mount", sys.executable, "-m",
                          "tests.support.full_disk_job", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    small = str(tmp_path / "small")
    assert "no space left" in report["plain_error"] and small in report["plain_error"], report
    assert report["plain_newest"] == "a" and report["plain_tags"] == ["a"] and report["plain_exact"], report
    assert report["plain_leftovers"] == ["a_partial", "newest"], report  # nothing of the failed save
    assert "node 0's local tier" in report["tier_error"] and "saved straight to" in report["tier_error"], report
    assert report["tier_root_tags"] == ["t2"] and "t2_partial" not in report["tier_local"], report
    assert report["tier_resumed"] == "t2" and report["tier_exact"], report
