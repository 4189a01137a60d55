"""Code that runs on each rank of the spawned worlds in test_tiers.py.

Four ranks play two nodes (``DCP_EXT_NODE_RANK`` = rank // 2), each node
with its own local-tier directory; a rank only ever touches its own node's
directory, except where a test wipes or damages a node's tier (done by a
rank of that node).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dcp_ext
from dcp_ext.layout import partial_dir
from dcp_ext.metadata import METADATA_FILE, read_incremental_section
from tests.support.async_workers import _snapshot, _train_on
from tests.support.compare import assert_same_state
from tests.support.dist_workers import app_state, local_leaves, make_fsdp
from tests.support.reshard_workers import full_state

RANKS_PER_NODE = 2


def _damage_local_copy(local_base: str, tag: str, part: int) -> None:
    """Flip one byte (at 1/``part`` of its length) of rank 0's model file of
    ``tag`` in node 0's local tier."""
    damaged = Path(node_dir(local_base, 0)) / partial_dir(tag) / "model_rank0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // part] ^= 0xFF
    damaged.write_bytes(bytes(data))

def node_dir(base: str, node: int) -> str:
    return os.path.join(base, f"node{node}")


def _manager(root: str, local_base: str, node: int, **kwargs: Any) -> dcp_ext.CheckpointManager:
    os.environ[dcp_ext._runtime.nodes.NODE_RANK_ENV] = str(node)
    return dcp_ext.CheckpointManager(root, local_tier=node_dir(local_base, node), **kwargs)


def _create_bucket(options: dict[str, Any], bucket: str) -> None:
    import boto3

    client = boto3.client("s3", aws_access_key_id=options["key"], aws_secret_access_key=options["secret"],
                          **options["client_kwargs"])
    client.create_bucket(Bucket=bucket)


def _restore(manager: dcp_ext.CheckpointManager, world_size: int, tag: str | None = None) -> tuple[str, dict[str, Any], dict[str, int]]:
    """Resume into a differently initialized model; (tag, its leaves, bytes read per source)."""
    model, optim = make_fsdp(world_size, seed=99)
    result = manager.resume(model, optim, tag=tag)
    return result.tag, local_leaves(app_state(model, optim)), manager.last_reader.store.bytes_by_source()


def tier_suite(rank: int, world_size: int, root: str, local_base: str, options: dict[str, Any]) -> dict[str, Any]:
    """Local saves, drains to S3 (``root`` with ``options``), restores from the
    local tier, from the root after a wiped node, from the root for a damaged
    local file, a failed drain, and peer replicas."""
    node = rank // RANKS_PER_NODE
    report: dict[str, Any] = {}
    model, optim = make_fsdp(world_size, seed=5)
    manager = _manager(root, local_base, node, storage_options=options, persist_every=2, keep_local=2)
    assert [manager.local.nodes.node_of(r) for r in range(world_size)] == [0, 0, 1, 1]

    # 1. s1 (local only), s2 (2nd save: persisted), s3 async (local only).
    manager.save("s1", model, optim, user_content={"step": 1})
    _train_on(model, optim)
    manager.save("s2", model, optim, user_content={"step": 2})
    expected_s2 = _snapshot(model, optim)
    manager.wait_for_persist()
    _train_on(model, optim)
    handle = manager.save("s3", model, optim, async_save=True, user_content={"step": 3})
    assert handle.persist_completion is None
    handle.staging_completion.result()
    expected_s3 = _snapshot(model, optim)
    _train_on(model, optim)
    handle.result()
    dist.barrier()

    mine = Path(node_dir(local_base, node))
    report["local_tags"] = sorted(p.name for p in mine.iterdir() if p.is_dir())
    report["local_newest"] = (mine / "newest").read_text().strip()
    report["local_files_s3"] = sorted(p.name for p in (mine / partial_dir("s3")).iterdir())
    report["root_tags"] = manager.tags()
    report["root_newest"] = manager.read_newest()

    # 2. Restore the newest (s3): from the local tiers only.
    tag, got, by_source = _restore(manager, world_size)
    assert tag == "s3", tag
    assert_same_state(expected_s3, got, "restore of s3 from the local tiers")
    report["restore_local"] = by_source
    assert manager.last_restore_plan.local_complete

    # 3. Node 1's tier is wiped: s3 exists on node 0 only and not in the
    #    root, so the newest readable is s2: node 0 from its tier, node 1 from the root.
    dist.barrier()
    if rank == 2:
        shutil.rmtree(node_dir(local_base, 1))
    dist.barrier()
    tag, got, by_source = _restore(manager, world_size)
    assert tag == "s2", tag
    assert_same_state(expected_s2, got, "restore of s2 after node 1's tier was wiped")
    report["restore_wiped"] = by_source

    # 4. A damaged local copy: one flipped byte in rank 0's model file of s2
    #    on node 0; rank 0 reads that file from the root instead.
    dist.barrier()
    if rank == 0:
        _damage_local_copy(local_base, "s2", 2)
    dist.barrier()
    tag, got, by_source = _restore(manager, world_size, tag="s2")
    assert_same_state(expected_s2, got, "restore of s2 with a damaged local file")
    report["restore_damaged"] = by_source

    # 5. A drain that fails (the root's bucket does not exist): the local
    #    commit succeeds, the handle's persist future fails on every rank,
    #    a restore serves from the local tiers; once the bucket exists, the
    #    next persisted save drains.
    bucket = f"later-{os.path.basename(local_base.rstrip('/'))}".lower().replace("_", "-")[:60]
    failing = _manager(f"s3://{bucket}/run", os.path.join(local_base, "second"), node, persist_every=0,
                       storage_options=options,
                       config=dcp_ext.IOConfig(retry=dcp_ext.RetryPolicy(max_attempts=2, base_delay=0.01)))
    handle = failing.save("f1", model, optim, async_save=True, persist=True)
    handle.staging_completion.result()
    expected_f1 = _snapshot(model, optim)
    handle.result()
    full = full_state(model, optim)  # f1 (local tiers only), whole tensors, for reshard_restore
    if rank == 0:
        torch.save(full, os.path.join(local_base, "f1_full.pt"))
    _train_on(model, optim)
    error = handle.persist_completion.exception(timeout=120)
    report["drain_error"] = None if error is None else (type(error).__name__, str(error).splitlines()[0][:200])
    tag, got, by_source = _restore(failing, world_size)
    assert tag == "f1", tag
    assert_same_state(expected_f1, got, "restore after a failed drain")
    dist.barrier()
    if rank == 0:
        _create_bucket(options, bucket)
    dist.barrier()
    handle = failing.save("f2", model, optim, async_save=True, persist=True)
    handle.result()
    full = full_state(model, optim)  # f2, whole tensors, for the 2-rank restore (reshard_restore)
    if rank == 0:
        torch.save(full, os.path.join(local_base, "f2_full.pt"))
    report["second_root"] = f"s3://{bucket}/run"
    handle.persist_completion.result(timeout=120)
    report["after_retry_root_tags"] = failing.tags()
    report["after_retry_root_newest"] = failing.read_newest()
    failing.close()
    manager.close()

    # 7. Node 1's tier has no room (local_tier_bytes=4096 there): the async
    #    save goes straight to the root; every rank's handle fails with the
    #    same StorageFullError naming node 1; the root's copy restores.
    full_base = os.path.join(local_base, "full")
    tight = _manager(root.rstrip("/") + "-full", full_base, node, storage_options=options, persist_every=0,
                     local_tier_bytes=4096 if node == 1 else None)
    handle = tight.save("t1", model, optim, async_save=True)
    handle.staging_completion.result()
    expected_t1 = _snapshot(model, optim)
    _train_on(model, optim)
    error = handle.exception(timeout=120)
    assert isinstance(error, dcp_ext.StorageFullError), repr(error)
    report["full_error"] = str(error)
    handle.persist_completion.result(timeout=120)
    report["full_root_tags"] = tight.tags()
    report["full_local_has_t1"] = (Path(node_dir(full_base, node)) / partial_dir("t1")).exists()
    tag, got, by_source = _restore(tight, world_size)
    assert tag == "t1", tag
    assert_same_state(expected_t1, got, "restore of t1, saved past a full local tier")
    report["restore_past_full"] = by_source
    tight.close()

    # 6. Peer replicas: node 1's tier is wiped and restored from node 0's
    #    replicas, no byte from the root; then both nodes are wiped and the
    #    newest persisted tag comes from the root.
    rep_base, rep_root = os.path.join(local_base, "rep"), root.rstrip("/") + "-replicated"
    replicated = _manager(rep_root, rep_base, node, storage_options=options, persist_every=0, keep_local=None,
                          replicas=1)
    replicated.save("p1", model, optim, persist=True)
    expected_p1 = _snapshot(model, optim)
    replicated.wait_for_persist()
    _train_on(model, optim)
    replicated.save("r1", model, optim)
    expected_r1 = _snapshot(model, optim)
    dist.barrier()
    report["replica_files_r1"] = sorted(p.name for p in (Path(node_dir(rep_base, node)) / partial_dir("r1")).iterdir()
                                        if p.name.endswith(".distcp"))
    dist.barrier()  # every rank has listed its node's files before node 1's tier is wiped
    if rank == 2:
        shutil.rmtree(node_dir(rep_base, 1))
    dist.barrier()
    tag, got, by_source = _restore(replicated, world_size)
    assert tag == "r1", tag
    assert_same_state(expected_r1, got, "restore of r1 from the partner's replicas")
    report["restore_from_replica"] = by_source
    report["replica_fetches"] = len(replicated.last_restore_plan.fetches)
    report["healed_has_metadata"] = (Path(node_dir(rep_base, node)) / partial_dir("r1") / METADATA_FILE).exists()
    dist.barrier()
    if rank in (0, 2):
        shutil.rmtree(node_dir(rep_base, node))
    dist.barrier()
    tag, got, by_source = _restore(replicated, world_size)
    assert tag == "p1", tag
    assert_same_state(expected_p1, got, "restore of p1 from the root after both nodes were wiped")
    report["restore_both_wiped"] = by_source
    replicated.close()

    # 8. Incremental with the tiers (zstd, S3 root): full local copies,
    #    drains that write only the frames that differ from the root's newest.
    report["incremental"] = _incremental_tiers(rank, world_size, root, local_base, options)
    return report


def _train_tail(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    """A training step that leaves the first layer (and its Adam state) as it
    is, a frozen base, and changes every other tensor in place."""
    frozen = {id(p) for p in model[0].parameters()}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in frozen:
                param.add_(1.0)
    for param, state in optim.state.items():
        if id(param) in frozen:
            continue
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.add_(1.0)


def root_problems(checkpoints: dcp_ext.CheckpointRoot) -> dict[str, list[str]]:
    """What is wrong with a root's data files (any backend): files a committed
    tag uses (its own or referred to) that are missing, and data files that no
    committed tag uses."""
    from dcp_ext.metadata import decode_metadata
    from dcp_ext.metadata.document import split_reference

    used: set[tuple[str, str]] = set()
    for info in checkpoints.committed():
        store = checkpoints.partial_store(info.tag)
        decoded = decode_metadata(store.read_file(METADATA_FILE), store.describe(METADATA_FILE))
        used |= {(partial_dir(info.tag), name) for name in decoded.files}
        if decoded.incremental is not None:
            used |= {split_reference(name, info.tag) for name in decoded.incremental.references}
    present = {(partial_dir(tag), name) for tag in checkpoints.partial_tags()
               for name in checkpoints.partial_store(tag).list_tree() if name.endswith(".distcp")}
    return {"missing": sorted("/".join(p) for p in used - present),
            "unused": sorted("/".join(p) for p in present - used)}


def _root_data_bytes(checkpoints: dcp_ext.CheckpointRoot, tag: str) -> int:
    store = checkpoints.partial_store(tag)
    return sum(store.size(name) for name in store.list_tree() if name.endswith(".distcp"))


def _incremental_tiers(rank: int, world_size: int, root: str, local_base: str,
                       options: dict[str, Any]) -> dict[str, Any]:
    """Saves i1..i7 of a frozen first layer and a trained rest, every 2nd
    drained (i2 writes every frame, i4 and i6 only the changed ones), root
    retention KeepLast(2), keep_local=2; then restores from the root alone,
    from the local tiers, with a damaged local copy and with a wiped node."""
    node = rank // RANKS_PER_NODE
    out: dict[str, Any] = {"drained_bytes": {}}
    base, inc_root = os.path.join(local_base, "inc"), root.rstrip("/") + "-incremental"
    manager = _manager(inc_root, base, node, storage_options=options, persist_every=2, keep_local=2,
                       incremental=True, compression="zstd", retention=dcp_ext.KeepLast(2))
    model, optim = make_fsdp(world_size, seed=7)
    expected: dict[str, dict[str, Any]] = {}
    for step in range(1, 8):
        _train_tail(model, optim)
        handle = manager.save(f"i{step}", model, optim, async_save=step % 3 == 0, user_content={"step": step})
        if handle is not None:
            handle.staging_completion.result()
        expected[f"i{step}"] = _snapshot(model, optim)
        if handle is not None:
            handle.result()
        manager.wait_for_persist()
        if step % 2 == 0 and rank == 0:
            out["drained_bytes"][f"i{step}"] = _root_data_bytes(manager.checkpoints, f"i{step}")
    dist.barrier()
    checkpoints = manager.checkpoints
    out["root_tags"] = manager.tags()
    out["root_newest"] = manager.read_newest()
    out["root_dirs"] = sorted(partial_dir(t) for t in checkpoints.partial_tags())
    out["retired"] = checkpoints.retired_tags()
    out["problems"] = root_problems(checkpoints)
    sections = {}
    for tag in out["root_tags"]:
        store = checkpoints.partial_store(tag)
        section = read_incremental_section(store.read_file(METADATA_FILE), tag)
        sections[tag] = None if section is None else (section.base, section.chain, sorted(section.references))
    out["sections"] = sections
    mine = Path(node_dir(base, node))
    out["local_tags"] = sorted(p.name for p in mine.iterdir() if p.is_dir())

    # Every kept tag, bit-exact from the root alone (a manager without a local tier).
    plain = dcp_ext.CheckpointManager(inc_root, storage_options=options)
    for tag in out["root_tags"]:
        restored, optimizer = make_fsdp(world_size, seed=98)
        assert plain.resume(restored, optimizer, tag=tag).user_content == {"step": int(tag[1:])}
        assert_same_state(expected[tag], local_leaves(app_state(restored, optimizer)), f"{tag} from the root alone")
    # From the local tiers: the newest (i7, local only) and the persisted i6, no byte from the root.
    for tag in ("i7", "i6"):
        got_tag, got, by_source = _restore(manager, world_size, tag=tag)
        assert_same_state(expected[tag], got, f"{tag} from the local tiers")
        out[f"restore_{tag}"] = by_source
    # A damaged local copy of i6 on node 0: the whole tag again from the root.
    dist.barrier()
    if rank == 0:
        _damage_local_copy(base, "i6", 3)
    dist.barrier()
    got_tag, got, by_source = _restore(manager, world_size, tag="i6")
    assert_same_state(expected["i6"], got, "i6 with a damaged local copy")
    out["restore_damaged"] = by_source
    # Node 1's tier wiped: the newest readable is i6, every rank reads it from the root.
    dist.barrier()
    if rank == 2:
        shutil.rmtree(node_dir(base, 1))
    dist.barrier()
    got_tag, got, by_source = _restore(manager, world_size)
    assert got_tag == "i6", got_tag
    assert_same_state(expected["i6"], got, "i6 after node 1's tier was wiped")
    out["restore_wiped"] = by_source
    manager.close()
    return out


def reshard_restore(rank: int, world_size: int, root: str, local_base: str, options: dict[str, Any]) -> dict[str, Any]:
    """Two ranks, one per node, restore tags that four ranks saved (two per
    node) in step 5 of :func:`tier_suite`: ``f2`` (also in the root: each
    rank reads the files its node holds from its own tier, the rest from the
    root), then ``f1`` (only in the local tiers: each node is sent the files
    it lacks by the other)."""
    manager = _manager(root, os.path.join(local_base, "second"), rank, storage_options=options, persist_every=0)
    model, optim = make_fsdp(world_size, seed=99)
    result = manager.resume(model, optim)
    got = full_state(model, optim)
    if rank == 0:
        expected = torch.load(os.path.join(local_base, "f2_full.pt"), weights_only=False)
        assert_same_state(expected, got, "4 ranks -> 2 ranks restore of f2 across the tiers")
    report = {"tag": result.tag, "by_source": manager.last_reader.store.bytes_by_source(), 
              "from_root": sorted(n for n, label in manager.last_reader.store.routes().items() if label == "root"),
              "local_complete": manager.last_restore_plan.local_complete}
    model, optim = make_fsdp(world_size, seed=98)
    result = manager.resume(model, optim, tag="f1")
    got = full_state(model, optim)
    if rank == 0:
        expected = torch.load(os.path.join(local_base, "f1_full.pt"), weights_only=False)
        assert_same_state(expected, got, "4 ranks -> 2 ranks restore of f1 from the local tiers only")
    plan = manager.last_restore_plan
    report["f1"] = {"tag": result.tag, "by_source": manager.last_reader.store.bytes_by_source(),
                    "gathered": plan.gathered, "fetched": len(plan.fetches)}
    manager.close()
    dist.barrier()
    return report
