"""Damaged checkpoints are always detected, never loaded as wrong data; hostile
input is rejected without running code, allocating what it claims, or writing
outside the root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dcp_ext
from tests.support.compare import assert_same_state
from tests.support.damage_trials import flip_byte, make_root, model, run_trials
from tests.support.hostile import code_running_pickle
from tests.support.metadata_edit import edit_metadata, stored_items


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_random_damage_is_always_detected(tmp_path: Path, compression: str | None) -> None:
    base = tmp_path / "base"
    make_root(base, compression)
    stats = run_trials(base, tmp_path, trials=60, seed=11)
    print(compression, stats.trials, stats.detected, stats.by_kind, stats.how)
    assert stats.violations == []
    assert stats.trials == stats.detected == 60
    assert all(kind_trials >= 5 for kind_trials, _ in stats.by_kind.values()), stats.by_kind


def test_envelope_damage_is_found_by_verify(tmp_path: Path) -> None:
    """A flipped byte in the torch.save envelope of an uncompressed tensor does
    not change what dcp_ext loads (it never reads envelopes), and verify()
    reports it (torch's own reader would trip on it)."""
    root = tmp_path / "root"
    make_root(root, None)
    tag_dir = root / "step2_partial"
    item = next(i for i in stored_items(tag_dir).values() if i["data_at"] > 0)
    data = tag_dir / item["file"]
    flip_byte(data, item["at"] + 40, 0x55)
    target = model(99)
    dcp_ext.resume_from_checkpoint(root, target)
    assert_same_state(model(2).state_dict(), target.state_dict())
    report = dcp_ext.verify(tag_dir)
    assert [(p.file, p.keys[0].split(" ")[-1]) for p in report.problems] == [(item["file"], "envelope")]
    assert "envelope bytes differ" in report.problems[0].reason


def test_hostile_tags_and_payloads(tmp_path: Path) -> None:
    root = tmp_path / "root"
    m = model(1)
    outside = sorted(os.listdir(tmp_path))
    for tag in ("../evil", "a/b", "/abs", "a\x00b", "x" * 300, "", ".", "..", ".hidden", "newest", "t_partial"):
        with pytest.raises(dcp_ext.InvalidTagError):
            dcp_ext.save_checkpoint(root, tag, m)
    assert sorted(os.listdir(tmp_path)) == outside  # nothing written anywhere
    assert not root.exists() or not any(root.iterdir())
    with pytest.raises(dcp_ext.InvalidTagError):
        dcp_ext.resume_from_checkpoint(tmp_path, m, tag="../root")

    # A committed checkpoint whose user_content file is swapped for a pickle
    # that would run a command: refused, and the command never runs.
    dcp_ext.save_checkpoint(root, "t1", m, user_content={"step": 1})
    marker = tmp_path / "code-ran"
    user_content = next((root / "t1_partial").glob("user_content*"))
    user_content.write_bytes(code_running_pickle(marker))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="user_content.safetensors"):
        dcp_ext.resume_from_checkpoint(root, model(2))
    assert not marker.exists()

    # Metadata (re-signed, as a deliberate edit would be) claiming bytes
    # outside the file, or a huge non-tensor value: refused before any read
    # or allocation of the claimed size.
    ck = tmp_path / "ck"
    # Version 2, whose JSON items this edits (version 3's table: test_metadata_v3.py).
    dcp_ext.save({"w": torch.ones(8), "extra": {"step": 3}}, ck, config=dcp_ext.IOConfig(metadata_version=2))
    meta = ck / "dcp_ext.metadata.json"
    original = meta.read_bytes()

    def move_out(doc: dict) -> None:
        doc["items"][0]["at"] = 10**12

    edit_metadata(meta, move_out)
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="lies outside file"):
        dcp_ext.load({"w": torch.zeros(8), "extra": {"step": 0}}, ck)

    def huge(doc: dict) -> None:
        for item in doc["items"]:
            if item["fqn"] == "extra.step":
                # 2 GiB: over the 1 GiB limit for a non-tensor value (a
                # bigger claim only makes this edited metadata slower to write).
                item["length"] = item["data_length"] = 1 << 31
                item["xxh3"] = ["0" * 16] * ((1 << 31) // item["frame"])
                doc["files"][item["file"]] = item["at"] + (1 << 31)

    meta.write_bytes(original)
    edit_metadata(meta, huge)
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"claims 2147483648 bytes .* refusing to allocate"):
        dcp_ext.load({"w": torch.zeros(8), "extra": {"step": 0}}, ck)

    def huge_frames(doc: dict) -> None:
        doc["items"][0]["frame"] = 1 << 40

    meta.write_bytes(original)
    edit_metadata(meta, huge_frames)
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="claims a frame size of 1099511627776 bytes"):
        dcp_ext.load({"w": torch.zeros(8), "extra": {"step": 0}}, ck)
