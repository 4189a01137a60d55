"""Code that runs on each rank of the spawned world in test_tier_names.py.

Four ranks play two nodes (``DCP_EXT_NODE_RANK`` = rank // 2). The two
nodes' local tiers lie at different depths (``BASE/local/node0`` and
``BASE/local/deeper/node1``), so that one hostile relative name points at
different files from each: ``../../../secret.txt`` is ``BASE/local/secret.txt``
from node 1's tag directory (a file that exists: what an attack would read)
and ``BASE/secret.txt`` from node 0's tag directory and from the root's
(``BASE/r/root``), where an attack would write.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

import dcp_ext
from dcp_ext.layout import PARTITION_FILE, partial_dir
from dcp_ext.tiers._replicas import Transfer, send_files
from dcp_ext.tiers import drain
from tests.support.async_workers import _snapshot, _train_on
from tests.support.compare import assert_same_state
from tests.support.dist_workers import app_state, local_leaves, make_fsdp

RANKS_PER_NODE = 2
HOSTILE = "../../../secret.txt"
SECRET = b"not a checkpoint file\n"


def node_dir(base: str, node: int) -> str:
    return os.path.join(base, "local", "node0") if node == 0 else os.path.join(base, "local", "deeper", f"node{node}")


def layout(base: str) -> dict[str, str]:
    """The paths the world uses: the root, what an attack would read and where it would write."""
    return {"root": os.path.join(base, "r", "root"), "source": os.path.join(base, "local", "secret.txt"),
            "target": os.path.join(base, "secret.txt")}


def _outcome(call: Any) -> tuple[str, str] | None:
    """``None`` if ``call()`` returned, else the (type name, message) it raised."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported to the test, which asserts the type
        return type(err).__name__, str(err)
    return None


def hostile_names_world(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """A 2-node tiered manager with replicas; node 1's ``partition.json`` of
    ``b`` is made to name ``../../../secret.txt`` for rank 2. Then a drain of
    ``b``, a replication of ``b``, a transfer list naming it and a restore."""
    node = rank // RANKS_PER_NODE
    paths = layout(base)
    report: dict[str, Any] = {}
    os.environ[dcp_ext._runtime.nodes.NODE_RANK_ENV] = str(node)
    model, optim = make_fsdp(world_size, seed=11)
    manager = dcp_ext.CheckpointManager(paths["root"], local_tier=node_dir(base, node), persist_every=0,
                                       keep_local=None, replicas=1)
    manager.save("a", model, optim, persist=True)
    expected_a = _snapshot(model, optim)
    manager.wait_for_persist()
    _train_on(model, optim)
    manager.save("b", model, optim)  # local only; node 0 keeps node 1's replicas
    expected_b = _snapshot(model, optim)
    _train_on(model, optim)

    hostile_file = Path(node_dir(base, 1)) / partial_dir("b") / PARTITION_FILE
    dist.barrier()
    if rank == 2:
        Path(paths["source"]).write_bytes(SECRET)
        doc = json.loads(hostile_file.read_text())
        for entry in doc["ranks"]:
            if entry["rank"] == 2:
                entry["files"][0] = HOSTILE
        hostile_file.write_text(json.dumps(doc))
    dist.barrier()
    report["hostile_file"] = str(hostile_file)

    # 1. A drain of b: node 1's ranks read the hostile record.
    report["drain"] = _outcome(lambda: drain(manager.local, manager.checkpoints, "b", manager.group, None))
    report["root_tags_after_drain"] = manager.tags()
    report["root_newest_after_drain"] = manager.read_newest()
    # 2. Replication of b again: rank 2's files come from the hostile record.
    report["replicate"] = _outcome(lambda: manager.local.replicate("b"))
    # 3. A transfer list naming the file outright (what peers exchange).
    store = manager.local.checkpoints.partial_store("b")
    report["transfer"] = _outcome(lambda: send_files(manager.group, [Transfer(HOSTILE, len(SECRET), 2, 0)],
                                                     store, store))
    # 4. Node 1's inventory leaves b out; the restore takes b from node 0
    #    (its own files and node 1's replicas), healing node 1.
    inventory = manager.local.inventory()
    report["inventory_tags"] = None if inventory is None else sorted(inventory.tags)
    fresh_model, fresh_optim = make_fsdp(world_size, seed=99)
    result = manager.resume(fresh_model, fresh_optim)
    report["restored"] = result.tag
    report["by_source"] = manager.last_reader.store.bytes_by_source()
    assert_same_state(expected_b if result.tag == "b" else expected_a,
                      local_leaves(app_state(fresh_model, fresh_optim)), f"restore of {result.tag}")
    dist.barrier()
    report["healed_partition_ok"] = HOSTILE not in hostile_file.read_text()
    manager.close()
    return report
