"""Incremental saves (dcp_ext.incremental._save): only changed frames are written,
every tag loads bit-exact, retention and deletion keep what kept tags refer to,
damage to a referenced file is found from the tag that needs it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dcp_ext
from dcp_ext.errors import CheckpointCorruptError, ChecksumMismatchError
from dcp_ext.metadata import StoredItem
from dcp_ext.metadata.document import FrameIndexRef
from dcp_ext.metadata.frame_index import attach_frame_index, encode_frame_index
from dcp_ext.layout import RETIRED_FILE
from tests.support import incremental_workers
from tests.support.backends import backend_for
from tests.support.compare import state_diff
from tests.support.dist import run_world

FRAME = 16 * 1024


def _model(head: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    # Embedding: 128 KiB = 8 frames of 16 KiB (32 rows each); the rest a frame or two each.
    return nn.Sequential(nn.Embedding(256, 128), nn.Linear(128, 128), nn.Linear(128, head))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _document(manager: dcp_ext.CheckpointManager, tag: str) -> dict[str, Any]:
    store = manager.checkpoints.partial_store(tag)
    return json.loads(store.read_file("dcp_ext.metadata.json"))


def _own_bytes(manager: dcp_ext.CheckpointManager, tag: str) -> int:
    store = manager.checkpoints.partial_store(tag)
    return sum(store.size(n) for n in store.list_tree() if n.endswith(".distcp"))


def _saved_twice(root: Path, first: str, second: str) -> tuple[dcp_ext.CheckpointManager, nn.Sequential]:
    """An incremental manager at ``root`` that saved ``first``, then ``second`` after the head's bias changed."""
    manager = dcp_ext.CheckpointManager(root, config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True)
    model = _model()
    manager.save(first, model)
    with torch.no_grad():
        model[2].bias.add_(1)
    manager.save(second, model)
    return manager, model


@pytest.mark.parametrize("kind,compression", [("local", None), ("memory", None), ("moto", "zstd")])
def test_saves_write_only_changed_frames_and_every_tag_loads(
    kind: str, compression: str | None, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    backend = backend_for(kind, request, tmp_path)
    root = backend.url("inc")
    manager = dcp_ext.CheckpointManager(root, storage_options=backend.storage_options, compression=compression,
                                        config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True, max_chain=3)
    model = _model()
    optim = torch.optim.Adam(model[2].parameters(), lr=0.1)
    expected: dict[str, tuple[dict[str, torch.Tensor], int]] = {}

    def train_head() -> None:
        model[2](torch.randn(4, 128)).square().mean().backward()
        optim.step()
        optim.zero_grad()

    for step in range(8):
        if step in (1, 2, 4, 5):
            train_head()
        if step == 2:
            with torch.no_grad():
                model[0].weight[40:45].add_(1.0)  # one frame of eight of the embedding
        if step == 6:
            # A tensor whose shape changed (a new head) and one whose dtype changed.
            model[2] = nn.Linear(128, 24)
            model[1] = model[1].to(torch.bfloat16)
            optim = torch.optim.Adam(model[2].parameters(), lr=0.1)
        manager.save(f"s{step}", model, user_content={"step": step})
        expected[f"s{step}"] = (_state(model), 24 if step >= 6 else 16)

    chains = [_document(manager, f"s{s}")["incremental"]["chain"] for s in range(8)]
    assert chains == [0, 1, 2, 3, 0, 1, 2, 3]  # max_chain=3: the 5th save writes every frame again
    own = {tag: _own_bytes(manager, tag) for tag in expected}
    full = own["s0"]
    assert own["s4"] >= 0.9 * full  # the chain restarts: everything written
    # Nothing changed: only the items under MIN_REFERENCED_BYTES (the 8 KiB head, the biases) and the index.
    assert own["s3"] < 0.06 * full, own
    # The head (a frame) changed; at s2 also one embedding frame of 8 (and nothing else).
    assert own["s1"] < 0.2 * full and own["s2"] < own["s1"] + 0.2 * full, own
    sections = {tag: _document(manager, tag)["incremental"] for tag in expected}
    assert sections["s1"]["base"] == "s0" and sections["s0"]["base"] is None and sections["s4"]["base"] is None
    referenced = {tag: sum(n for _, n in s["references"]) for tag, s in sections.items()}
    assert referenced["s3"] > 0.9 * full and referenced["s0"] == referenced["s4"] == 0
    # References always name the file that holds the bytes (s3 refers to s0 and s2, never to s1's references).
    assert {name.split("/")[1] for name, _ in sections["s3"]["references"]} <= {"s0_partial", "s1_partial", "s2_partial"}

    for tag, (state, head) in expected.items():
        fresh = _model(head=head, seed=99)
        if head == 24:
            fresh[1] = fresh[1].to(torch.bfloat16)
        result = manager.resume(fresh, tag=tag)
        assert result.user_content == {"step": int(tag[1:])}
        assert state_diff(state, fresh.state_dict()) == [], tag
        report = dcp_ext.verify(manager.checkpoints.partial_url(tag), storage_options=backend.storage_options)
        assert report.ok, report
        if tag in ("s1", "s2", "s3"):
            assert report.referenced_files and "of earlier checkpoints" in str(report)
    manager.close()


def test_retention_keeps_only_what_kept_tags_refer_to(tmp_path: Path) -> None:
    manager = dcp_ext.CheckpointManager(tmp_path, config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True,
                                        max_chain=3, retention=dcp_ext.root.KeepLast(2))
    model = _model()
    states = {}
    for step in range(8):
        with torch.no_grad():
            model[2].weight.add_(1.0)
            if step % 3 == 1:
                model[0].weight[32 * step : 32 * step + 4].add_(1.0)  # a different embedding frame
        manager.save(f"s{step}", model)
        states[f"s{step}"] = _state(model)
    assert manager.tags() == ["s6", "s7"]
    for tag in ("s6", "s7"):
        fresh = _model(seed=5)
        manager.resume(fresh, tag=tag)
        assert state_diff(states[tag], fresh.state_dict()) == []
    # Every data file left is a kept tag's own file or one a kept tag refers to; nothing else is left.
    referenced = manager.checkpoints.referenced_files()
    left = {(d.name, f.name) for d in tmp_path.glob("*_partial") for f in d.glob("*.distcp")}
    own = {(d, f) for d, f in left if d in ("s6_partial", "s7_partial")}
    assert left - own == referenced - own and referenced <= left
    retired = sorted(d.name for d in tmp_path.glob("*_partial") if (d / RETIRED_FILE).exists())
    assert retired and all(not (tmp_path / d / "dcp_ext.metadata.json").exists() for d in retired)
    assert set(retired) == {d for d, _ in referenced - own}  # no retired directory without a reason
    # s4 started the last chain (chain 3 at s3): s0..s3 are gone entirely, s4/s5 keep what s6/s7 use.
    assert not any((tmp_path / f"s{k}_partial").exists() for k in range(4))
    from dcp_ext.cli import main

    assert main(["ls", str(tmp_path), "--json"]) == 0


def test_ls_shows_own_and_referenced_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dcp_ext.cli import main

    manager, model = _saved_twice(tmp_path, "a", "b")
    manager.delete("a")  # b refers to a's file: a's directory is retired, its data file stays
    assert (tmp_path / "a_partial" / RETIRED_FILE).exists() and not (tmp_path / "a_partial" / "dcp_ext.metadata.json").exists()
    fresh = _model(seed=3)
    manager.resume(fresh)
    assert state_diff(_state(model), fresh.state_dict()) == []
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    listed = {e["tag"]: e for e in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert listed["a"]["state"] == "retired" and listed["a"]["stored_bytes"] > 100_000
    assert listed["b"]["base"] == "a" and listed["b"]["referenced_bytes"] > 0.9 * listed["a"]["stored_bytes"]
    assert listed["b"]["stored_bytes"] < 0.1 * listed["a"]["stored_bytes"]
    assert main(["ls", str(tmp_path)]) == 0
    assert "refers to" in capsys.readouterr().out
    # Saving again over the newest tag never refers to the files it replaces.
    with torch.no_grad():
        model[1].weight.add_(1)
    manager.save("b", model, overwrite=True)
    assert _document(manager, "b")["incremental"]["chain"] == 0
    manager.resume(fresh)
    assert state_diff(_state(model), fresh.state_dict()) == []
    assert not (tmp_path / "a_partial").exists()  # nothing refers to a any more: b's save swept it


def test_damaged_or_missing_base_file_fails_from_the_newer_tag(tmp_path: Path) -> None:
    manager, _ = _saved_twice(tmp_path, "s0", "s1")
    base = tmp_path / "s0_partial" / "model_rank0.distcp"
    data = bytearray(base.read_bytes())
    data[FRAME + 7] ^= 0x40  # the embedding's second frame, which s1 refers to
    base.write_bytes(bytes(data))
    report = dcp_ext.verify(tmp_path / "s1_partial")
    assert not report.ok and [p.file for p in report.problems] == ["../s0_partial/model_rank0.distcp"]
    assert "0.weight" in report.problems[0].keys[0] and "checksum mismatch" in report.problems[0].reason
    with pytest.raises(ChecksumMismatchError, match=r"s0_partial.model_rank0\.distcp \(referenced by .*s1_partial"):
        manager.resume(_model(seed=1), tag="s1")
    before = (tmp_path / "s1_partial" / "dcp_ext.metadata.json").read_bytes()
    with pytest.raises(ChecksumMismatchError, match="Nothing was compacted"):
        manager.compact("s1")  # never a self-contained copy of damaged bytes
    assert (tmp_path / "s1_partial" / "dcp_ext.metadata.json").read_bytes() == before
    data[FRAME + 7] ^= 0x40
    base.write_bytes(bytes(data))
    os.rename(base, str(base) + ".moved")
    report = dcp_ext.verify(tmp_path / "s1_partial")
    assert [p.file for p in report.problems] == ["../s0_partial/model_rank0.distcp"]
    assert "is missing" in report.problems[0].reason
    with pytest.raises(CheckpointCorruptError, match=r"s0_partial.model_rank0\.distcp is missing.*earlier checkpoint 's0_partial'"):
        manager.resume(_model(seed=1), tag="s1")


def _item(name: str, offsets: tuple[int, ...], sources: tuple[str, ...]) -> StoredItem:
    count = len(offsets)
    return StoredItem(name, 0, 10, 0, 10 * count, frame_size=10, checksums=tuple(range(count)),
                      frame_hashes=bytes(range(16)) * count, frame_offsets=offsets, frame_sources=sources)


def test_frame_index_v2_round_trip_and_hostile_references() -> None:
    item = _item("model_rank0.distcp", (0, 500, 10), ("", "../s0_partial/model_rank0.distcp", ""))
    index = encode_frame_index([item])
    ref = FrameIndexRef(100, len(index), __import__("xxhash").xxh3_64_intdigest(index))
    bare = StoredItem("model_rank0.distcp", 0, 10, 0, 30, frame_size=10, indexed=True)
    (back,) = attach_frame_index([bare], index, ref, "f")
    assert back.frame_offsets == item.frame_offsets and back.frame_sources == item.frame_sources
    assert back.frame_hashes == item.frame_hashes and back.checksums == item.checksums
    for hostile in ("../../etc/passwd", "../s0_partial/../x.distcp", "/abs/x", "s0_partial/x.distcp"):
        bad = encode_frame_index([_item("m.distcp", (0,), (hostile,))])
        bad_ref = FrameIndexRef(100, len(bad), __import__("xxhash").xxh3_64_intdigest(bad))
        with pytest.raises(CheckpointCorruptError):
            attach_frame_index([StoredItem("m.distcp", 0, 10, 0, 10, frame_size=10, indexed=True)], bad, bad_ref, "f")
    past = encode_frame_index([_item("m.distcp", (200,), ("",))])  # an own frame beyond the file's data
    with pytest.raises(CheckpointCorruptError, match="past the file's data"):
        attach_frame_index([StoredItem("m.distcp", 0, 10, 0, 10, frame_size=10, indexed=True)], past,
                           FrameIndexRef(100, len(past), __import__("xxhash").xxh3_64_intdigest(past)), "f")


def test_fsdp2_world_incremental_saves_reshard_and_retention(tmp_path: Path) -> None:
    roots = {"all": str(tmp_path / "all"), "keep2": str(tmp_path / "keep2")}
    reports = run_world(2, incremental_workers.world, roots, timeout=300)
    assert all(not found for r in reports for found in r["diffs"].values()), [r["diffs"] for r in reports]
    full = reports[0]["full"]
    every = dcp_ext.CheckpointManager(roots["all"])
    sizes = {tag: _own_bytes(every, tag) for tag in full}
    # Only the adapter, head and their Adam state change between saves (and items under a frame,
    # always written): the frozen 512 KiB embedding is referred to.
    assert all(sizes[f"s{k}"] < 0.3 * sizes["s0"] for k in range(1, incremental_workers.STEPS)), sizes
    # The embedding's changed rows cost one more frame at that step, not the tensor.
    step = incremental_workers.EMBED_STEP
    assert sizes[f"s{step}"] - sizes[f"s{step - 1}"] < 4 * incremental_workers.FRAME, sizes
    # Resharded (2 ranks -> this one process, unsharded) at every tag.
    for tag, expected in full.items():
        plain = incremental_workers.make_model(7)
        every.resume(plain, tag=tag)
        assert state_diff(expected, plain.state_dict()) == [], tag
    kept = dcp_ext.CheckpointManager(roots["keep2"])
    last = incremental_workers.STEPS - 1
    assert kept.tags() == [f"s{last - 1}", f"s{last}"]
    for tag in kept.tags():
        plain = incremental_workers.make_model(8)
        kept.resume(plain, tag=tag)
        assert state_diff(full[tag], plain.state_dict()) == [], tag
    referenced = kept.checkpoints.referenced_files()
    keep2 = Path(roots["keep2"])
    left = {(d.name, f.name) for d in keep2.glob("*_partial") for f in d.rglob("*.distcp")}
    own = {(d, f) for d, f in left if d in (f"s{last - 1}_partial", f"s{last}_partial")}
    assert left - own == referenced - own and referenced <= left
    assert all(dcp_ext.verify(kept.checkpoints.partial_url(tag)).ok for tag in kept.tags())


def test_compact_and_export_make_self_contained_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    from dcp_ext.cli import main

    manager = dcp_ext.CheckpointManager(tmp_path / "root", config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True,
                                        compression="zstd")
    model = _model()
    states = {}
    for step in range(3):
        with torch.no_grad():
            model[2].bias.add_(1)
            if step == 1:
                model[0].weight[0:2].add_(1)  # a frame s1 writes and s2 refers to
        manager.save(f"s{step}", model)
        states[f"s{step}"] = _state(model)
    manager.delete("s0")  # retired: s1 and s2 refer to its files
    # Export of an incremental tag: a full file that needs nothing else.
    out = manager.export("s2", out=str(tmp_path / "s2.safetensors"))
    assert state_diff(states["s2"], load_file(str(tmp_path / "s2.safetensors"))) == [], out
    # Compacting s1 (which s2 refers to) keeps its replaced file for s2; s0 stays retired for s2.
    report = manager.compact("s1")
    assert report.changed and report.copied_bytes > 0 and report.kept_old == ("model_rank0.distcp",)
    assert _document(manager, "s1")["incremental"] == {"base": None, "chain": 0, "references": []}
    # Then s2 by the CLI: now nothing refers to s0, whose directory goes.
    capsys.readouterr()
    assert main(["compact", str(tmp_path / "root"), "s2"]) == 0
    assert "rewrote 1 data file(s)" in capsys.readouterr().out
    assert not (tmp_path / "root" / "s0_partial").exists()
    for tag in ("s1", "s2"):
        fresh = _model(seed=4)
        manager.resume(fresh, tag=tag)
        assert state_diff(states[tag], fresh.state_dict()) == [], tag
        assert dcp_ext.verify(manager.checkpoints.partial_url(tag)).ok
        assert manager.compact(tag).changed is False  # nothing left to do
    # A compacted tag is still a base: the next save refers to it.
    manager.save("s3", model)
    assert _document(manager, "s3")["incremental"]["base"] == "s2"
    assert _own_bytes(manager, "s3") < 0.1 * _own_bytes(manager, "s2")


def test_a_damaged_base_does_not_stop_saves(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = dcp_ext.CheckpointManager(tmp_path, config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True)
    model = _model()
    manager.save("a", model)
    document = tmp_path / "a_partial" / "dcp_ext.metadata.json"
    document.write_bytes(document.read_bytes().replace(b'"chain":0', b'"chain":7'))  # fails its integrity check
    with torch.no_grad():
        model[2].bias.add_(1)
    with caplog.at_level("WARNING", logger="dcp_ext.incremental"):
        manager.save("b", model)  # writes every frame instead of building on a damaged base
    assert "its base" in caplog.text and "damaged" in caplog.text
    assert _document(manager, "b")["incremental"] == {"base": None, "chain": 0, "references": [], "sizes": []}
    fresh = _model(seed=2)
    manager.resume(fresh, tag="b")
    assert state_diff(_state(model), fresh.state_dict()) == []


def test_a_chain_restarts_when_the_files_it_keeps_are_mostly_unused(tmp_path: Path) -> None:
    """With the default max_chain a frozen majority is never written again;
    a frozen quarter that keeps three dead quarters alive is (the chain
    restarts as soon as its base's referenced files hold more unused bytes
    than used ones). Each tensor is 256 KiB (4 frames); the rest changes every save."""
    config = dcp_ext.IOConfig(frame_size=64 * 1024)
    for frozen, expected in ((3, [0, 1, 2, 3, 4, 5]), (1, [0, 1, 0, 1, 0, 1])):
        model = nn.ParameterList([nn.Parameter(torch.randn(256, 256)) for _ in range(4)])
        manager = dcp_ext.CheckpointManager(tmp_path / f"frozen{frozen}", config=config, incremental=True)
        for step in range(6):
            with torch.no_grad():
                for param in list(model)[frozen:]:
                    param.add_(1)
            manager.save(f"s{step}", model)
        sections = [_document(manager, f"s{s}")["incremental"] for s in range(6)]
        assert [s["chain"] for s in sections] == expected, sections
        # Every reference records its file's size: what the next save decides on.
        for section in sections:
            assert [name for name, _ in section["sizes"]] == [name for name, _ in section["references"]], section
        used, size = sections[1]["references"][0][1], sections[1]["sizes"][0][1]
        assert used == frozen * 256 * 1024 and size > 4 * 256 * 1024, sections[1]  # s0's whole file
        fresh = nn.ParameterList([nn.Parameter(torch.zeros(256, 256)) for _ in range(4)])
        dcp_ext.resume_from_checkpoint(manager.checkpoints.url, fresh)
        assert all(torch.equal(a, b) for a, b in zip(fresh, model))
