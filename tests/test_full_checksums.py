"""Full checkpoints carry frame checksums in a sidecar written last (issue 18).

One process each: ``CheckpointManager.save(partial=False)`` in both formats,
``export`` of a partial checkpoint, ``dcp_ext.verify_full`` /
``dcp-ext verify``, loads through ``load_pretrained``, overwrite, deletion
and listing, and damaged or stale sidecars.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dcp_ext
from dcp_ext.cli import main as cli_main
from dcp_ext.full._checksums import decode_sidecar, sidecar_name
from dcp_ext.root import verify_full
from tests.support.compare import assert_same_state
from tests.support.damage_trials import flip_byte

FRAME = 4096


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 8))


def _cli(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli_main(list(args))
    return code, out.getvalue()


def _frames(model: nn.Module) -> int:
    return sum(-(-t.numel() * t.element_size() // FRAME) for t in model.state_dict().values())


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_full_save_records_checksums_that_loads_and_verify_check(tmp_path: Path, fmt: str) -> None:
    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root), config=dcp_ext.IOConfig(frame_size=FRAME))
    model = _model(0)
    manager.save("full", model, partial=False, full_format=fmt)

    files = decode_sidecar((root / sidecar_name("full")).read_bytes(), "sidecar")
    assert set(files) == {"full"} and files["full"].size == (root / "full").stat().st_size
    assert set(files["full"].tensors) == set(model.state_dict())
    report = verify_full(str(root / "full"))
    assert report.ok and report.frames == _frames(model) == 6 and report.unchecked_items == 0, report
    assert report.bytes_checked == sum(t.numel() * 4 for t in model.state_dict().values())
    fresh = _model(1)
    dcp_ext.load_pretrained(fresh, str(root / "full"))
    assert_same_state(dict(model.state_dict()), dict(fresh.state_dict()))
    # The sidecar is no checkpoint of its own.
    code, listed = _cli("ls", "--json", str(root))
    assert code == 0 and [e["tag"] for e in json.loads(listed)["checkpoints"]] == ["full"], listed

    # One flipped bit in the second frame of 0.weight (64 x 48 fp32 = 3 frames).
    entry = files["full"].tensors["0.weight"]
    flip_byte(root / "full", entry.offset + FRAME + 5)
    report = verify_full(str(root / "full"))
    assert not report.ok and len(report.problems) == 1, report
    problem = report.problems[0]
    assert problem.keys == ("0.weight frame 2/3",) and (problem.start, problem.end) == (
        entry.offset + FRAME, entry.offset + 2 * FRAME), problem
    code, out = _cli("verify", str(root / "full"), "--quiet")
    assert code == 1 and "0.weight frame 2/3" in out, out
    with pytest.raises(dcp_ext.ChecksumMismatchError, match="full"):
        dcp_ext.load_pretrained(_model(2), str(root / "full"))
    # A tensor whose frames are intact still loads from the damaged file.
    partial = nn.Linear(48, 8)
    dcp_ext.load_pretrained(partial, str(root / "full"), key_map=lambda k: k[2:] if k.startswith("1.") else None)
    assert torch.equal(partial.weight, model[1].weight)

    # An overwrite drops the old sidecar before the new file commits, then writes its own.
    manager.save("full", _model(3), partial=False, full_format=fmt, overwrite=True)
    assert verify_full(str(root / "full")).ok
    manager.delete("full", partial=False)
    assert sorted(p.name for p in root.iterdir()) == [], list(root.iterdir())


def test_export_records_checksums_and_stale_or_damaged_sidecars_are_named(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root), config=dcp_ext.IOConfig(frame_size=FRAME))
    model = _model(0)
    manager.save("s1", model)
    manager.export("s1", out="s1_full")
    report = verify_full(str(root / "s1_full"))
    assert report.ok and report.frames == _frames(model), report

    # A file replaced by another of a different size: its checksums no longer apply.
    sidecar = root / sidecar_name("s1_full")
    data = (root / "s1_full").read_bytes()
    (root / "s1_full").write_bytes(data + b"\0" * 8)
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"s1_full is \d+ bytes but its checksums"):
        dcp_ext.load_pretrained(_model(1), str(root / "s1_full"))
    (root / "s1_full").write_bytes(data)
    sidecar.write_bytes(sidecar.read_bytes()[:-3])
    with pytest.raises(dcp_ext.CheckpointCorruptError, match="checksums.json is not a valid checksum sidecar"):
        dcp_ext.load_pretrained(_model(1), str(root / "s1_full"))
    # Without its sidecar a full checkpoint loads unverified, and verify says so.
    sidecar.unlink()
    fresh = _model(1)
    dcp_ext.load_pretrained(fresh, str(root / "s1_full"))
    assert_same_state(dict(model.state_dict()), dict(fresh.state_dict()))
    code, out = _cli("verify", str(root / "s1_full"))
    assert code == 0 and "4 items without checksums" in out and "no checksums were recorded" in out, out
    with pytest.raises(dcp_ext.InvalidTagError, match="checksums.json"):
        manager.save("x.checksums.json", model, partial=False)


def test_checksums_of_a_tensor_written_in_runs_equal_those_of_its_bytes_at_once() -> None:
    """The HF export writes a tensor as runs (its own rows from the shard, the
    rest from the receive buffer): frames spanning runs hash as one."""
    import os

    from dcp_ext.full._write import ChecksumRecorder

    data = memoryview(os.urandom(3 * FRAME + 123))
    whole, runs = ChecksumRecorder("f", FRAME), ChecksumRecorder("f", FRAME)
    whole.add("t", 8, data)
    runs.add("t", 8, [data[:5], data[5 : FRAME + 1], data[FRAME + 1 : FRAME + 1], data[FRAME + 1 :]])
    assert whole.finish(100).tensors["t"] == runs.finish(100).tensors["t"]
    assert len(whole.finish(100).tensors["t"].checksums) == 4
