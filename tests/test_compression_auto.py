"""``compression="auto"`` (issue 44): each item compressed only where a sample shows it pays.

Incompressible items are stored raw (inside the ``torch.save`` envelope an
uncompressed save writes), compressible ones compressed; both load bit-exact
and verified, the metadata records each item's choice, and checkpoints
written before ``auto`` existed still load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

import dcp_ext
from dcp_ext.format import AutoCodec, WriteRates, encode_rates, resolve_codec, write_rates
from tests.support.compare import assert_same_state
from tests.support.damage_trials import flip_byte
from tests.support.metadata_edit import stored_items
from tests.support.states import zeros_like_state

FRAME = 64 * 1024
BEFORE = Path(__file__).parent / "data" / "before_auto_compression"


@pytest.fixture(autouse=True)
def _fresh_write_rates():
    """Decisions by ratio alone: no write speed learnt from other tests' saves."""
    write_rates.clear()
    encode_rates.clear()
    yield
    write_rates.clear()
    encode_rates.clear()


def _noise(n: int, seed: int) -> torch.Tensor:
    """bf16 of uniformly random bits, NaN and inf patterns moved to finite
    numbers (so values compare equal): incompressible."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, generator=gen)
    special = (bits & 0x7F80) == 0x7F80
    return torch.where(special, bits ^ 0x0080, bits).view(torch.bfloat16)


def _state() -> dict:
    gen = torch.Generator().manual_seed(44)
    return {
        "noise": _noise(300_000, 1).reshape(600, 500),            # 600 KB of random bits
        "weights": torch.randn(400, 512, generator=gen).bfloat16(),  # exponents compress (~1.3x)
        "zeros": torch.zeros(100_000),                            # compresses ~1000x
        "small": torch.randn(100, generator=gen),                  # below min_item_bytes: raw
        "ids": torch.arange(50_000),                               # int64: zstd/1
        "extra": {"step": 7, "blob": b"\x01\x02" * 60_000},
    }


def test_auto_stores_incompressible_raw_and_compresses_the_rest(tmp_path: Path) -> None:
    state = _state()
    path = tmp_path / "auto"
    dcp_ext.save(state, path, compression="auto", frame_size=FRAME)
    items = stored_items(path)
    codecs = {fqn: item["codec"] for fqn, item in items.items()}
    assert codecs["noise"] is None and codecs["small"] is None
    assert codecs["weights"] == ["bytegroup.2/1", "zstd.planes.2/1"]
    assert codecs["zeros"] == ["bytegroup.4/1", "zstd.planes.4/1"]
    assert codecs["ids"] == codecs["extra.blob"] == ["zstd/1"]
    # A raw tensor item is stored as an uncompressed save stores it: inside its torch.save envelope.
    assert items["noise"]["data_at"] > 0 and items["noise"]["data_length"] == 600_000
    assert items["zeros"]["data_length"] < 4_000 and items["weights"]["data_length"] < 400 * 512 * 2

    reader = dcp_ext.CheckpointReader(path)
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=reader, planner=dcp_ext.LayoutLoadPlanner())
    assert_same_state(state, out)
    frames = sum(len(item["xxh3"]) for item in items.values())
    assert reader.frame_stats.verified == frames  # every frame, raw and compressed, checked on load
    assert 0 < reader.frame_stats.decoded < frames
    report = dcp_ext.verify(path)
    assert report.ok and report.frames == frames

    # A flipped byte in a raw item and in a compressed one: both found.
    for fqn in ("noise", "weights"):
        damaged = tmp_path / f"damaged-{fqn}"
        dcp_ext.save(state, damaged, compression="auto", frame_size=FRAME)
        item = stored_items(damaged)[fqn]
        flip_byte(damaged / item["file"], item["at"] + item["data_at"] + 10)
        found = dcp_ext.verify(damaged)
        assert not found.ok and fqn in str(found.problems[0])
        with pytest.raises(dcp_ext.ChecksumMismatchError, match=fqn):
            dcp_ext.load(zeros_like_state(state), damaged)


def test_auto_with_nothing_worth_compressing_is_a_plain_checkpoint(tmp_path: Path) -> None:
    """Every item raw: torch's own reader loads it, as an uncompressed save."""
    state = {"a": _noise(200_000, 3), "b": _noise(100_000, 4).reshape(100, 1000), "tiny": torch.ones(3)}
    dcp_ext.save(state, tmp_path / "auto", compression="auto")
    dcp_ext.save(state, tmp_path / "plain")
    assert {item["codec"] for item in stored_items(tmp_path / "auto").values()} == {None}
    auto = (tmp_path / "auto" / "__0_0.distcp").read_bytes()
    assert auto == (tmp_path / "plain" / "__0_0.distcp").read_bytes()  # the same bytes as plain
    out = zeros_like_state(state)
    dcp.load(out, storage_reader=FileSystemReader(str(tmp_path / "auto")))
    assert_same_state(state, out)


def test_auto_in_a_version_2_document_records_the_choice(tmp_path: Path) -> None:
    state = _state()
    dcp_ext.save(state, tmp_path / "v2", compression="auto", frame_size=FRAME,
                 config=dcp_ext.IOConfig(metadata_version=2))
    doc = json.loads((tmp_path / "v2" / "dcp_ext.metadata.json").read_text())
    codecs = {item["fqn"]: item.get("codec") for item in doc["items"]}
    assert codecs["noise"] is None and codecs["weights"] == ["bytegroup.2/1", "zstd.planes.2/1"]
    out = zeros_like_state(state)
    dcp_ext.load(out, tmp_path / "v2")
    assert_same_state(state, out)


def test_the_decision_weighs_encode_speed_against_write_speed() -> None:
    auto = AutoCodec()
    # No write speed known yet: the ratio alone decides.
    assert auto.threshold(encode_rate=1e9, write_rate=None, threads=2) == auto.min_ratio
    # Writes faster than encoding: compressing never pays.
    assert auto.threshold(encode_rate=1e9, write_rate=3e9, threads=2) == float("inf")
    # S3 at 90 MB/s, 1 GB/s per encoder thread: 1 / (1 - 0.09) = 1.099, so min_ratio (1.1) decides;
    # at 200 MB/s a ratio of 1.25 is needed.
    assert auto.threshold(encode_rate=1e9, write_rate=9e7, threads=2) == auto.min_ratio
    assert auto.threshold(encode_rate=1e9, write_rate=2e8, threads=2) == pytest.approx(1.25)
    # 16 cores (15 encoding) at 2 GB/s local writes: 1.15x pays.
    assert auto.threshold(encode_rate=1e9, write_rate=2e9, threads=16) == pytest.approx(1 / (1 - 2 / 15))
    with pytest.raises(ValueError, match="min_ratio"):
        AutoCodec(min_ratio=0.5)


def test_a_fast_store_gets_raw_items_a_slow_one_compressed() -> None:
    auto = AutoCodec()
    weights = torch.randn(256, 1024).bfloat16()
    raw = memoryview(weights.view(torch.uint8).numpy()).cast("B")
    write_rates.note("FastWriter", 1 << 30, 0.1)  # 10 GB/s
    write_rates.note("SlowWriter", 1 << 30, 100.0)  # 11 MB/s
    assert not auto.choose(torch.bfloat16, raw, "FastWriter", threads=2)
    assert auto.choose(torch.bfloat16, raw, "SlowWriter", threads=2)


def test_write_rates_need_enough_bytes_and_follow_the_recent_past() -> None:
    rates = WriteRates(window=256 << 20)
    rates.note("S3", 32 << 20, 1.0)
    assert rates.rate("S3") is None  # the first parts fill buffers: not a speed yet
    rates.note("S3", 64 << 20, 1.0)
    assert rates.rate("S3") == pytest.approx((96 << 20) / 2.0)
    for _ in range(20):  # the store got faster: the old samples fade
        rates.note("S3", 64 << 20, 0.1)
    assert rates.rate("S3") > 400 << 20


def test_a_streak_of_equal_answers_samples_every_eighth_item() -> None:
    auto = AutoCodec()
    sampled = []
    real = auto.sample

    def counting(dtype, raw):
        sampled.append(1)
        return real(dtype, raw)

    object.__setattr__(auto, "sample", counting)  # a frozen dataclass: count this instance's samples
    noise = memoryview(_noise(100_000, 5).view(torch.uint8).numpy()).cast("B")
    answers = [auto.choose(torch.bfloat16, noise, "W", threads=2) for _ in range(36)]
    assert not any(answers)
    assert len(sampled) == 4 + 4  # 4 to build the streak, then 1 in 8 of the remaining 32


def test_resolve_codec_names_auto() -> None:
    assert isinstance(resolve_codec("auto"), AutoCodec) and isinstance(resolve_codec("AUTO"), AutoCodec)
    with pytest.raises(dcp_ext.UnsupportedCodecError, match="'auto'"):
        resolve_codec("lz4")


@pytest.mark.parametrize("name", ["plain", "zstd", "zstd-v2"])
def test_checkpoints_written_before_auto_still_load(name: str) -> None:
    """Written by the code before issue 44 (tests/data/before_auto_compression)."""
    gen = torch.Generator().manual_seed(44)
    expected = {"w": torch.randn(64, 96, generator=gen).bfloat16(), "m": torch.randn(3000, generator=gen),
                "ids": torch.arange(500), "extra": {"step": 44, "blob": b"\x07" * 3000}}
    out = zeros_like_state(expected)
    dcp_ext.load(out, BEFORE / name)
    assert_same_state(expected, out)
    assert dcp_ext.verify(BEFORE / name).ok
