"""File names read from a local tier or received from peers are checked
before anything is read, copied, written or deleted (issue 32, finding 4).

A ``partition.json`` in a node's local tier names the data files that drains
copy to the root and replication sends to the partner node; a name such as
``../../../secret.txt`` made a drain copy a file from outside the tier to
outside the root. :meth:`dcp_ext.layout.Partition.from_json` now refuses it
(with the one validator, :mod:`dcp_ext._runtime.names`), as does every transfer
between nodes, and any malformed record is a typed error naming the file
and the field.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import dcp_ext
from dcp_ext._runtime.names import UnsafeNameError
from dcp_ext.errors import CheckpointCorruptError, DcpExtError
from dcp_ext.layout import PARTITION_FILE, MeshInfo, Partition, RankPartition, partial_dir
from dcp_ext.tiers import drain
from tests.support.dist import run_world
from tests.support.tier_name_workers import HOSTILE, SECRET, hostile_names_world, layout


def _record(version: int = 3) -> bytes:
    mesh = MeshInfo((2, 2), ("dp", "tp"), (0, 1, 2, 3))
    ranks = tuple(
        RankPartition(r, mesh.coords(r), (f"model_dp{r // 2}_tp{r % 2}.distcp", f"30/optimizer_rank{r}.distcp"),
                      {"model": ("model.a", "model.b") if r else ("model.a",), "optimizer": ("optimizer.s",)})
        for r in range(4)
    )
    return Partition(4, mesh, ranks, nodes=(0, 0, 1, 1), partners=(1, 0)).to_json(version)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d["ranks"][1]["files"].__setitem__(0, "../../../../../x.txt"), "ranks[1].files[0]"),
        (lambda d: d["ranks"][0]["files"].__setitem__(1, "/etc/passwd"), "ranks[0].files[1]"),
        (lambda d: d["ranks"][3]["files"].__setitem__(0, ".hidden"), "ranks[3].files[0]"),
        (lambda d: d["ranks"][2]["files"].__setitem__(0, "a/../../b.distcp"), "ranks[2].files[0]"),
        (lambda d: d["ranks"][2]["files"].__setitem__(0, "model\n.distcp"), "ranks[2].files[0]"),
    ],
)
def test_partition_refuses_names_that_leave_the_directory(change: Any, field: str) -> None:
    doc = json.loads(_record())
    change(doc)
    with pytest.raises(UnsafeNameError) as info:
        Partition.from_json(json.dumps(doc).encode(), "/tier/node1/b_partial/partition.json")
    assert "/tier/node1/b_partial/partition.json" in str(info.value) and field in str(info.value), info.value
    assert isinstance(info.value, CheckpointCorruptError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "raw, field",
    [
        (b"{oops", "Expecting property name"),
        (b"[]", "the record must be a JSON object, not a list of 0"),
        (b"[" * 100_000, "recursion"),
        (b"\xff\xfe", "Expecting value"),
        (b'{"format": "dcp_ext.partition", "version": 3, "world_size": NaN}', "NaN"),
        (b'{"format": "dcp_ext.partition", "version": 3, "world_size": Infinity}', "Infinity"),
        (b'{"format": "dcp_ext.partition", "version": 3, "world_size": 1e400}', "'world_size'"),
        (b'{"format": "dcp_ext.partition", "version": 3, "world_size": 1' + b"0" * 400 + b"}", "'world_size'"),
        (b'{"format": "dcp_ext.partition", "version": true}', "'version'"),
    ],
)
def test_partition_refuses_bad_documents_with_a_typed_error(raw: bytes, field: str) -> None:
    prefix = "/p/partition.json is not a valid partition record: "
    with pytest.raises(CheckpointCorruptError, match=f"^{re.escape(prefix)}.*{re.escape(field)}"):
        Partition.from_json(raw, "/p/partition.json")


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(ranks={}), "'ranks' must be a list"),
        (lambda d: d["ranks"][0].update(coords=[1]), "'ranks[0].coords' must be an object"),
        (lambda d: d["ranks"][0].update(rank=1.0), "'ranks[0].rank' must be an integer"),
        (lambda d: d["ranks"][0].update(rank=4), "'ranks[0].rank' must be an integer in [0, 3]"),
        (lambda d: d["ranks"][1].update(rank=0), "rank 0 is listed twice"),
        (lambda d: d["ranks"][0].pop("files"), "'ranks[0].files' is missing"),
        (lambda d: d["ranks"][0].update(files="model.distcp"), "'ranks[0].files' must be a list"),
        (lambda d: d["ranks"][0].update(key_set=7), "'ranks[0].key_set'"),
        (lambda d: d.update(key_sets=[[0, 1]]), "'key_sets[0]' must be an object"),
        (lambda d: d["key_sets"][0].update(model=[0, 1, 0, 1]), "'key_sets[0].model'"),
        (lambda d: d["key_sets"][0].update(model=[0, 10**12]), "'key_sets[0].model[1]'"),
        (lambda d: d["mesh"].update(shape=[2, 2.5]), "'mesh.shape[1]'"),
        (lambda d: d["mesh"].update(ranks=None), "'mesh.ranks' must be a list"),
        (lambda d: d.update(nodes=[0, -1]), "'nodes[1]'"),
        (lambda d: d.update(key_table=[1]), "'key_table[0]' must be a string"),
    ],
)
def test_partition_names_the_field_of_a_malformed_record(change: Any, field: str) -> None:
    doc = json.loads(_record())
    change(doc)
    with pytest.raises(CheckpointCorruptError) as info:
        Partition.from_json(json.dumps(doc).encode(), "/p/partition.json")
    assert type(info.value) is CheckpointCorruptError  # not a name problem
    assert str(info.value).startswith("/p/partition.json is not a valid partition record: ")
    assert field in str(info.value), info.value


def test_partition_mutations_give_a_typed_error_or_a_value() -> None:
    """A seeded mutator over records of versions 1-3: every result is a
    Partition whose names are plain, or a DcpExtError; never another exception."""
    rng = random.Random(32)
    wild: list[Any] = [math.nan, math.inf, -math.inf, 10**400, 1e300, -1, 2**31, True, None, "", "../x", "/x",
                       [], {}, [[]], {"a": []}, "x" * 300, 0.5]
    records = [json.loads(_record(2)), json.loads(_record(3))]
    old = json.loads(_record(2))
    old["version"] = 1
    old.pop("key_table")
    for r in old["ranks"]:
        r["keys"] = {"model": ["model.a"]}
    records.append(old)
    outcomes = {"value": 0, "error": 0}
    for trial in range(3000):
        doc = json.loads(json.dumps(rng.choice(records)))
        for _ in range(rng.choice((0, 1, 1, 2))):
            _mutate(doc, rng, wild)
        raw = json.dumps(doc, allow_nan=True).encode()
        if trial % 5 == 0 and raw:  # and some byte-level damage
            at = rng.randrange(len(raw))
            raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1:]
        try:
            partition = Partition.from_json(raw, "p.json")
        except DcpExtError as err:
            assert "p.json" in str(err), err
            outcomes["error"] += 1
            continue
        outcomes["value"] += 1
        for rank in partition.ranks:
            for name in rank.files:
                assert not name.startswith(("/", ".")) and ".." not in name.split("/"), name
    assert outcomes["value"] > 300 and outcomes["error"] > 1000, outcomes


def _mutate(doc: Any, rng: random.Random, wild: list[Any]) -> None:
    """Replace one value anywhere in ``doc`` with a wild one (or delete a key)."""
    path: list[tuple[Any, Any]] = []
    node = doc
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    if not path:
        return
    parent, key = path[-1]
    if isinstance(parent, dict) and rng.random() < 0.1:
        del parent[key]
    else:
        parent[key] = copy.deepcopy(rng.choice(wild))


def _tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    return model, optim


def test_one_process_drain_of_a_hostile_local_tier(tmp_path: Path) -> None:
    """One process: a drain whose local partition.json names a file outside
    the tier is refused before anything is read or written; restores use the
    good tag."""
    source = tmp_path / "secret.txt"  # ../../secret.txt from local/b_partial
    source.write_bytes(SECRET)
    root, local = tmp_path / "r" / "root", tmp_path / "local"
    target = tmp_path / "r" / "secret.txt"  # ../../secret.txt from r/root/b_partial
    model, optim = _tiny_model()
    with dcp_ext.CheckpointManager(root, local_tier=local, persist_every=0, keep_local=None) as manager:
        manager.save("a", model, optim, persist=True)
        manager.wait_for_persist()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        manager.save("b", model, optim)
        record = local / partial_dir("b") / PARTITION_FILE
        doc = json.loads(record.read_text())
        doc["ranks"][0]["files"] = ["../../secret.txt"]
        record.write_text(json.dumps(doc))

        with pytest.raises(UnsafeNameError) as info:
            drain(manager.local, manager.checkpoints, "b", manager.group, None)
        assert str(record) in str(info.value) and "'../../secret.txt'" in str(info.value), info.value
        assert "ranks[0].files[0]" in str(info.value)
        assert not target.exists(), "the drain wrote outside the root"
        assert source.read_bytes() == SECRET
        assert manager.tags() == ["a"] and manager.read_newest() == "a"
        assert not (root / partial_dir("b") / "dcp_ext.metadata.json").exists()

        # The local tier's b is not a source; a is restored (from the local tier).
        fresh, _ = _tiny_model()
        with torch.no_grad():
            fresh.weight.zero_()
        assert manager.resume(fresh).tag == "a"
        assert manager.last_restore_plan is not None and manager.last_restore_plan.tag == "a"
    for key, value in expected.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    assert not target.exists()


def test_hostile_names_in_a_two_node_world(tmp_path: Path) -> None:
    """Four gloo ranks, two nodes, replicas: node 1's partition.json of ``b``
    names ``../../../secret.txt`` (a file that exists outside its tier).
    A drain, a replication and a transfer list naming it are refused with
    UnsafeNameError on every rank (none hangs), nothing outside the tiers or
    the root is written, and the restore takes ``b`` from node 0's copy and
    replicas, which heals node 1."""
    paths = layout(str(tmp_path))
    reports = run_world(4, hostile_names_world, str(tmp_path), timeout=200)
    hostile_file = reports[2]["hostile_file"]
    for rank, report in enumerate(reports):
        for check in ("drain", "replicate", "transfer"):
            outcome = report[check]
            assert outcome is not None and outcome[0] == "UnsafeNameError", (rank, check, outcome)
            assert repr(HOSTILE) in outcome[1], (rank, check, outcome)
        # The record is named where the name came from it.
        assert hostile_file in report["drain"][1] and "ranks[2].files[0]" in report["drain"][1], report["drain"]
        assert hostile_file in report["replicate"][1], report["replicate"]
        assert "the data files list of rank 2" in report["transfer"][1], report["transfer"]
        assert report["root_tags_after_drain"] == ["a"] and report["root_newest_after_drain"] == "a", report
        assert report["restored"] == "b" and report["by_source"].get("root", 0) == 0, report
        assert report["by_source"]["local"] > 0, report
        assert report["healed_partition_ok"], rank
    assert reports[2]["inventory_tags"] == ["a"], reports[2]["inventory_tags"]  # node 1: b left out
    assert reports[0]["inventory_tags"] == ["a", "b"], reports[0]["inventory_tags"]
    assert not Path(paths["target"]).exists(), "a file was written outside the tiers and the root"
    assert Path(paths["source"]).read_bytes() == SECRET
    assert not (Path(paths["root"]) / partial_dir("b") / "dcp_ext.metadata.json").exists()
