"""Tunables and the pure byte-range planning."""

from __future__ import annotations

import pytest

from dcp_ext import CheckpointReader, CheckpointWriter, IOConfig
from dcp_ext.storage import Piece, plan_requests
from dcp_ext.config import parse_size

MiB = 1024 * 1024


def test_parse_size() -> None:
    assert parse_size("16MiB") == 16 * MiB
    assert parse_size("8 MB") == 8_000_000
    assert parse_size(1234) == 1234
    for bad in ("lots", "-1", "5 parsecs"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def test_environment_then_arguments(monkeypatch) -> None:
    monkeypatch.setenv("DCP_EXT_PART_SIZE", "32MiB")
    monkeypatch.setenv("DCP_EXT_MAX_CONCURRENCY", "3")
    monkeypatch.setenv("DCP_EXT_FSYNC", "off")
    writer = CheckpointWriter("/tmp/x", max_concurrency=5)
    assert (writer.config.part_size, writer.config.max_concurrency, writer.config.fsync) == (32 * MiB, 5, False)
    reader = CheckpointReader("/tmp/x", config=IOConfig(), read_request_size="2MiB")
    assert reader.config.read_request_size == 2 * MiB  # explicit config ignores the environment
    assert reader.config.part_size == 16 * MiB


def test_bad_tunables_are_refused() -> None:
    with pytest.raises(ValueError, match="5 MiB"):
        IOConfig(part_size=MiB)
    with pytest.raises(ValueError, match="max_concurrency"):
        CheckpointWriter("/tmp/x", max_concurrency=0)


def _pieces(spans: list[tuple[int, int]]) -> list[Piece]:
    return [Piece("f", off, memoryview(bytearray(n))) for off, n in spans]


def test_holes_are_read_through_only_when_small_and_cheap() -> None:
    # Envelope-sized holes (1.5 KiB) always merge.
    reqs = plan_requests(_pieces([(0, 100), (1600, 100), (3200, 100)]), gap=MiB, max_request=16 * MiB)
    assert [(r.offset, r.length) for r in reqs] == [(0, 3300)]
    # A 500 KiB hole between two 4 KiB pieces would read 60x the wanted bytes: not merged.
    reqs = plan_requests(_pieces([(0, 4096), (512 * 1024, 4096)]), gap=MiB, max_request=16 * MiB)
    assert len(reqs) == 2
    # The same hole between 1 MiB pieces is worth reading through.
    reqs = plan_requests(_pieces([(0, MiB), (MiB + 512 * 1024, MiB)]), gap=MiB, max_request=16 * MiB)
    assert [(r.offset, r.length) for r in reqs] == [(0, 2 * MiB + 512 * 1024)]
    assert not reqs[0].is_direct and len(reqs[0].targets) == 2
    # Never beyond the gap, never beyond max_request.
    reqs = plan_requests(_pieces([(0, MiB), (3 * MiB, MiB)]), gap=MiB, max_request=16 * MiB)
    assert len(reqs) == 2
    reqs = plan_requests(_pieces([(0, MiB), (MiB, MiB)]), gap=MiB, max_request=MiB)
    assert len(reqs) == 2 and all(r.is_direct for r in reqs)


def test_large_pieces_split_into_direct_requests() -> None:
    (piece,) = _pieces([(10, 5 * MiB + 3)])
    reqs = plan_requests([piece], gap=0, max_request=2 * MiB)
    assert [(r.offset, r.length) for r in reqs] == [(10, 2 * MiB), (10 + 2 * MiB, 2 * MiB), (10 + 4 * MiB, MiB + 3)]
    assert all(r.is_direct for r in reqs)
    assert sum(r.targets[0][1].nbytes for r in reqs) == piece.length


def test_box_runs_cover_exactly_the_box() -> None:
    import random

    import torch

    from dcp_ext.storage import box_runs, run_starts

    rng = random.Random(0)
    for _ in range(400):
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(0, 4))]
        offsets = [rng.randint(0, s - 1) for s in sizes]
        lengths = [rng.randint(1, s - o) for s, o in zip(sizes, offsets)]
        chunk = torch.arange(max(1, torch.Size(sizes).numel())).reshape(sizes)
        want = chunk
        for dim, (o, n) in enumerate(zip(offsets, lengths)):
            want = want.narrow(dim, o, n)
        shape = box_runs(sizes, offsets, lengths)
        flat = chunk.reshape(-1)
        runs = [flat[s : s + shape.run] for s in run_starts(shape, offsets, lengths)]
        assert torch.equal(torch.cat(runs), want.reshape(-1)), (sizes, offsets, lengths)
        span = flat[shape.first : shape.first + shape.span]
        assert torch.equal(span.as_strided(lengths, shape.strides), want)
    with pytest.raises(ValueError, match="exceed"):
        box_runs([4, 4], [2, 0], [3, 4])
