"""Resharding at load: N ranks and one layout into M ranks and another, bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dcp_ext
from tests.support import reshard_workers
from tests.support.dist import run_world
from tests.support.metadata_edit import sign
from tests.support.reshard_workers import SMALL_FRAME


def test_resharding_matrix(tmp_path: Path) -> None:
    root = str(tmp_path)
    reshard_workers.save_one("plain", root, "plain1")  # one process, no process group
    run_world(2, reshard_workers.save_world, root)  # FSDP2, TP, DDP at 2 ranks
    # FSDP2 and 2-D FSDP2 x TP at 4 ranks, then the 4-rank loads (one world: spawning costs seconds)
    four = run_world(4, reshard_workers.save_then_load_world, root)

    diffs: dict[str, list[str]] = {}
    for source, via in (("fsdp22", "resume"), ("fsdp24", "dcp"), ("tp2", "dcp"), ("2d4", "resume"), ("ddp2", "dcp")):
        diffs[f"{source}->plain1({via})"] = reshard_workers.load_case(root, source, "plain", via)
    reports = {}
    for world in (2, 3):
        reports[world] = run_world(world, reshard_workers.load_world, root)
    reports[4] = four
    for world in (2, 3, 4):
        diffs.update(reports[world][0]["diffs"])
    assert len(diffs) == 5 + 9 + 3 + 3
    assert {case: found for case, found in diffs.items() if found} == {}

    # 4 -> 2 and 4 -> 3: each rank reads about 1/M of the data, not whole files.
    for world in (2, 3):
        for mode in ("big4/False", "big4/True") + (("bigz4/True",) if world == 3 else ()):
            rows = [r[mode] for r in reports[world]]
            print(f"4 -> {world} {mode}: stored {rows[0]['stored']} raw {rows[0]['raw']} frames "
                  f"{rows[0]['frames']}; per rank bytes read {[r['bytes_read'] for r in rows]}, frames "
                  f"verified {[r['verified'] for r in rows]}, decoded {[r['decoded'] for r in rows]}")
        exact = [r["big4/False"] for r in reports[world]]
        total = exact[0]["stored"]
        per_rank = [r["bytes_read"] for r in exact]
        assert sum(per_rank) >= total
        assert max(per_rank) <= total / world * 1.1 + 128 * 1024, (world, per_rank, total)
        assert all(r["fast_path"] == 0 and r["verified"] == 0 for r in exact)  # partition changed
        # With checksum verification each rank reads whole 32 KiB frames: at
        # most one extra frame at each end of its rows of each 512-row tensor
        # (12 of them: 4 weights, 4 exp_avg, 4 exp_avg_sq).
        checked = [r["big4/True"] for r in reports[world]]
        per_rank = [r["bytes_read"] for r in checked]
        assert max(per_rank) <= total / world * 1.1 + 128 * 1024 + 2 * 12 * SMALL_FRAME, (world, per_rank)
        assert sum(r["verified"] for r in checked) >= checked[0]["frames"]  # every frame somewhere
        assert all(r["verified"] < checked[0]["frames"] / world * 1.5 for r in checked)
        assert all(not r["diff"] for r in checked + exact)
    # 4 -> 3 from a zstd-compressed checkpoint: bit-exact, each rank reads and
    # decompresses only the frames covering its rows.
    compressed = [r["bigz4/True"] for r in reports[3]]
    assert not compressed[0]["diff"]
    stored, raw, frames = compressed[0]["stored"], compressed[0]["raw"], compressed[0]["frames"]
    assert stored < raw  # it is compressed
    assert sum(r["decoded"] for r in compressed) >= frames
    for r in compressed:
        assert r["decoded"] == r["verified"] <= frames / 3 + 2 * 12 + 24, compressed  # + boundary frames, small tensors read whole
        assert r["decoded_bytes"] <= raw / 3 * 1.1 + 2 * 12 * SMALL_FRAME
        assert r["bytes_read"] <= stored / 3 * 1.1 + 2 * 12 * SMALL_FRAME, compressed

    # 4 -> 4, same partition: each rank read only its own file, every tensor by the fast path.
    for rank, report in enumerate(reports[4]):
        assert report["files_read"] == [f"model_rank{rank}.distcp"]
        assert report["fast_path"] == report["tensors"] == 8
        assert report["metadata_reads"] == (1 if rank == 0 else 0)
        assert report["indexes_read"] == [f"model_rank{rank}.distcp"]
    for world in (2, 3):  # 4 -> M through CheckpointManager.resume: one metadata read per load
        for mode in ("big4/False", "big4/True"):
            assert [r[mode]["metadata_reads"] for r in reports[world]] == [1] + [0] * (world - 1)


def _model(width: int = 8) -> torch.nn.Module:
    return reshard_workers.mlp(0, width=width)


def test_key_shape_dtype_and_layout_errors(tmp_path: Path) -> None:
    model = _model()
    dcp_ext.save_checkpoint(tmp_path / "root", "s", model)
    root = tmp_path / "root"

    # A key the checkpoint lacks.
    extra = torch.nn.Sequential(*_model(), torch.nn.Linear(2, 3))
    with pytest.raises(dcp_ext.CheckpointKeyError, match=r"lacks 2 key\(s\) .*'model.3.bias', 'model.3.weight'"):
        dcp_ext.resume_from_checkpoint(root, extra)
    before = extra[3].weight.detach().clone()
    dcp_ext.resume_from_checkpoint(root, extra, strict=False)
    assert torch.equal(extra[3].weight, before) and torch.equal(extra[0].weight, model[0].weight)

    # A whole namespace absent (state dict keyed "weights", checkpoint "model"): the error says so.
    with pytest.raises(dcp_ext.CheckpointKeyError,
                       match=r"no key under 'weights' at all; its top-level names are \['model'\]"):
        dcp_ext.load({"weights": _model().state_dict()}, root / "s_partial")

    # Keys the state dict does not take.
    smaller = torch.nn.Sequential(torch.nn.Linear(8, 32))
    with pytest.raises(dcp_ext.CheckpointKeyError, match=r"holds 2 key\(s\) the state dict does not take: \['model.2.bias', 'model.2.weight'\]"):
        dcp_ext.resume_from_checkpoint(root, smaller)
    manager = dcp_ext.CheckpointManager(root)
    manager.resume(smaller, strict=False)
    assert manager.last_load_planner.unexpected_keys == ("model.2.bias", "model.2.weight")
    assert torch.equal(smaller[0].weight, model[0].weight)

    # A different global shape names the key and both shapes.
    with pytest.raises(dcp_ext.ReshardError, match=r"'model.0.weight': the checkpoint holds global shape \(32, 8\) .* expects \(32, 16\)"):
        dcp_ext.resume_from_checkpoint(root, _model(width=16))

    # A different dtype: an error unless casting is asked for.
    half = _model().to(torch.bfloat16)
    with pytest.raises(dcp_ext.ReshardError, match=r"'model.0.weight' was saved as torch.float32 but the state dict holds torch.bfloat16.*allow_dtype_cast=True"):
        dcp_ext.resume_from_checkpoint(root, half)
    dcp_ext.resume_from_checkpoint(root, half, allow_dtype_cast=True)
    assert torch.equal(half[0].weight, model[0].weight.to(torch.bfloat16))

    # Selective load: only some keys, through dcp_ext.load with a planner.
    subset = {"model": {"0.weight": torch.zeros(32, 8)}}
    import torch.distributed.checkpoint as dcp

    dcp.load(subset, storage_reader=dcp_ext.CheckpointReader(root / "s_partial"),
             planner=dcp_ext.LayoutLoadPlanner(keys={"model.0.weight"}))
    assert torch.equal(subset["model"]["0.weight"], model[0].weight)

    # A checkpoint whose chunks do not cover the requested tensor.
    sharded = tmp_path / "holes"
    dcp_ext.save_checkpoint(sharded, "s", model, config=dcp_ext.IOConfig(metadata_version=2))  # edits v2 items
    meta_path = sharded / "s_partial" / "dcp_ext.metadata.json"
    doc = json.loads(meta_path.read_text())
    doc["state_dict"]["model.0.weight"]["chunks"] = [{"offsets": [0, 0], "sizes": [16, 8]}]
    doc["items"] = [i for i in doc["items"] if i["fqn"] != "model.0.weight"] + [
        dict(next(i for i in json.loads(meta_path.read_text())["items"] if i["fqn"] == "model.0.weight"),
             data_length=16 * 8 * 4)
    ]
    meta_path.write_bytes(sign(doc))
    with pytest.raises(dcp_ext.ReshardError, match=r"'model.0.weight': the saved chunks cover 128 of the 256 elements"):
        dcp_ext.resume_from_checkpoint(sharded, _model())
