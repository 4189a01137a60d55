"""Hostile input and untyped errors (issue 32, findings 6, 7, 11 and 12).

Each test feeds dcp_ext a real file bent in one place (claimed sizes, NaN and
10**400 in sealed metadata, malformed safetensors headers and Hugging Face
indexes, bad command-line options, an empty root, an export into its own
source, a broken file an incremental checkpoint refers to, a checkpoint
replaced under a reader) and checks the exact error type, that its message
names the file and the field, and, for claimed sizes, that peak memory stays
small. Each failed on commit 1139fbb (see the docstrings).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import dcp_ext
from dcp_ext.cli import main as cli
from dcp_ext.errors import (
    CheckpointCorruptError,
    CheckpointReplacedError,
    DcpExtError,
    InvalidOptionError,
    InvalidPathError,
)
from dcp_ext.metadata import METADATA_FILE, decode_metadata, read_created
from tests.support.hostile_files import MiB, peak_python_memory, safetensors_bytes, torch_save_claiming, zstd_zeros
from tests.support.metadata_edit import edit_metadata

GiB = 1 << 30


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``dcp-ext ARGS`` in a real process."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "dcp_ext", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def _one_error_line(stderr: str) -> str:
    """The CLI's error line, checked to be the only line of stderr (no traceback)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dcp-ext: error: "), stderr
    return lines[0]


# -- finding 6: claimed sizes are checked before anything is allocated ---------------------
def test_torch_save_file_claiming_a_3_gib_data_pkl_allocates_nothing(tmp_path: Path) -> None:
    """1139fbb: the 3 GiB claim was allocated (tracemalloc peak 3.0 GiB)
    before a StorageError reported the short read. Now: refused from the zip
    directory, naming the file, the record and the claim; peak < 1 MiB."""
    path = tmp_path / "model.pt"
    torch_save_claiming(path, 3 * GiB)
    assert path.stat().st_size < 4096
    with peak_python_memory() as peak, pytest.raises(Exception) as caught:
        dcp_ext.load_pretrained(nn.Linear(2, 2), path)
    assert peak[0] < MiB, peak[0]
    assert caught.type is CheckpointCorruptError
    message = str(caught.value)
    assert str(path) in message and "data.pkl claims 3221225472 bytes" in message, message


@pytest.mark.parametrize("variant", ["frame declares 1.5 GiB", "document declares 1.5 GiB"])
def test_zstd_bombed_chunk_table_allocates_nothing(tmp_path: Path, variant: str) -> None:
    """A 65 KiB metadata document whose chunk table is a zstd bomb of 1.5 GiB.
    1139fbb: peak memory rose by 1.5 GiB either way (python-zstandard
    allocates a frame's declared size whatever max_output_size says; a
    document may declare any size up to 16 GiB). Now: the frame must not
    declare more than chunk_table_bytes, and chunk_table_bytes must equal
    what the keys' rows span; peak < 1 MiB."""
    ck = tmp_path / "ck"
    dcp_ext.save({"w": torch.ones(8)}, ck)
    bomb = base64.b64encode(zstd_zeros(3 * GiB // 2, content_size=variant.startswith("frame"))).decode()

    def plant(doc: dict[str, Any]) -> None:
        doc["chunk_table"] = bomb
        if variant.startswith("document"):
            doc["chunk_table_bytes"] = 3 * GiB // 2

    edit_metadata(ck / METADATA_FILE, plant)
    assert (ck / METADATA_FILE).stat().st_size < 66 * 1024
    with peak_python_memory() as peak, pytest.raises(Exception) as caught:
        dcp_ext.load({"w": torch.zeros(8)}, ck)
    assert peak[0] < MiB, peak[0]
    assert caught.type is CheckpointCorruptError
    message = str(caught.value)
    assert str(ck / METADATA_FILE) in message and ("chunk table" in message or "chunk_table_bytes" in message), message


def test_frame_index_claimed_larger_than_its_file_allocates_nothing(tmp_path: Path) -> None:
    """A (re-signed) document claiming a 3 GiB frame index at the end of a
    3 KB data file. 1139fbb: the read asked the OS for 3 GiB at once
    (tracemalloc peak 3.0 GiB) before finding the file short. Now: read in
    4 MiB steps that stop at the end of the file; peak < 8 MiB; the error
    names the file and the claim."""
    ck = tmp_path / "ck"
    dcp_ext.save({"w": torch.ones(8)}, ck)

    def claim(doc: dict[str, Any]) -> None:
        entry = doc["files"][0]
        entry[3] = 3 * GiB
        entry[1] = entry[2] + entry[3]

    doc = edit_metadata(ck / METADATA_FILE, claim)
    with peak_python_memory() as peak, pytest.raises(Exception) as caught:
        dcp_ext.load({"w": torch.zeros(8)}, ck)
    assert peak[0] < 8 * MiB, peak[0]
    assert caught.type is CheckpointCorruptError
    message = str(caught.value)
    assert str(ck / doc["files"][0][0]) in message and "3221225472 bytes" in message, message


def test_torch_metadata_item_claiming_3_gib_allocates_nothing(tmp_path: Path) -> None:
    """A checkpoint written by torch's FileSystemWriter whose ``.metadata``
    gives an item a length of 3 GiB in a 1.6 KB file. 1139fbb: the item's
    buffer was allocated first (tracemalloc peak 3.0 GiB), then the short
    read reported. Now: checked against the file's size first; peak < 1 MiB;
    the error names the file, the key and the claimed range."""
    ck = tmp_path / "ck"
    dcp.save({"w": torch.ones(8)}, storage_writer=FileSystemWriter(str(ck)))
    metadata = pickle.loads((ck / ".metadata").read_bytes())
    metadata.storage_data = {k: dataclasses.replace(v, length=3 * GiB) for k, v in metadata.storage_data.items()}
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    with peak_python_memory() as peak, pytest.raises(Exception) as caught:
        dcp_ext.load({"w": torch.zeros(8)}, ck)
    assert peak[0] < MiB, peak[0]
    assert caught.type is CheckpointCorruptError
    assert f"{ck / '__0_0.distcp'}: .metadata puts 'w' at bytes [0, 3221225472), past the end" in str(caught.value)


# -- finding 7: numbers JSON allows but a commit time or a world size cannot be -------------
_IMPOSSIBLE = {"inf": float("inf"), "nan": float("nan"), "huge": 10**400}


def _set(doc: dict[str, Any], field: str, value: Any) -> None:
    doc[field] = value


def test_impossible_numbers_in_sealed_metadata_are_typed_errors_and_ls_lists_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """world_size / created = Infinity, NaN, 10**400 in a correctly sealed
    document. 1139fbb: OverflowError (inf, 10**400) or ValueError from
    datetime (NaN) killed ``dcp-ext ls`` for the whole root with a
    traceback. Now: CheckpointCorruptError naming the file and the field;
    read_created() gives None; ``ls`` exits 0, lists the good tag as
    committed and each bad one as damaged (a warning line names file and field)."""
    root = tmp_path / "root"
    model = nn.Linear(2, 2)
    dcp_ext.save_checkpoint(root, "good", model)
    bad = []
    for field in ("world_size", "created"):
        for name, value in _IMPOSSIBLE.items():
            tag = f"{field.replace('_', '')}-{name}"
            dcp_ext.save_checkpoint(root, tag, model)
            path = root / f"{tag}_partial" / METADATA_FILE
            edit_metadata(path, functools.partial(_set, field=field, value=value))
            bad.append(tag)
            with pytest.raises(CheckpointCorruptError, match=re.escape(f"{path}: {field} must be")):
                decode_metadata(path.read_bytes(), str(path))
            if field == "created":
                assert read_created(path.read_bytes()[:512]) is None
    result = _run_cli("ls", str(root), "--json")
    assert result.returncode == 0, result.stderr
    states = {e["tag"]: e["state"] for e in json.loads(result.stdout)["checkpoints"]}
    assert states == {"good": "committed", **{tag: "damaged" for tag in bad}}
    for tag in bad:
        assert f"{tag}: {root / (tag + '_partial') / METADATA_FILE}: " in result.stderr
    assert cli(["ls", str(root)]) == 0
    table = capsys.readouterr().out
    assert "good" in table and table.count("damaged") == len(bad)


# -- findings 7 and 11: safetensors headers -------------------------------------------------
_WEIGHT = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
_BIAS = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
_HEADERS: dict[str, tuple[bytes | dict[str, Any], str]] = {
    # case: (header, what the message must say)      1139fbb
    "metadata a list": ({"__metadata__": [1], "weight": _WEIGHT, "bias": _BIAS}, "__metadata__"),  # AttributeError
    "100k nested brackets": (b'{"weight":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),  # RecursionError
    "shape Infinity": ({"weight": {**_WEIGHT, "shape": [float("inf")]}, "bias": _BIAS}, "shape [inf]"),  # OverflowError
    "shape 4.9": ({"weight": {**_WEIGHT, "shape": [4.9]}, "bias": _BIAS}, "shape [4.9]"),  # cut to 4, then ReshardError
    "float offsets": ({"weight": {**_WEIGHT, "data_offsets": [0.0, 16.0]}, "bias": _BIAS}, "data_offsets"),  # loaded
    "overlapping offsets": ({"weight": _WEIGHT, "bias": {**_BIAS, "data_offsets": [8, 16]}}, "overlap"),  # loaded
    "entry a list": ({"weight": [1], "bias": _BIAS}, "malformed header entry"),  # CheckpointCorruptError already
}


@pytest.mark.parametrize("case", sorted(_HEADERS))
def test_malformed_safetensors_headers_are_refused_naming_file_and_field(tmp_path: Path, case: str) -> None:
    """1139fbb: AttributeError, RecursionError and OverflowError escaped;
    shape 4.9 was cut to 4; overlapping data_offsets loaded (the bias read
    from the weight's bytes) and so did float offsets. Now: one
    CheckpointCorruptError naming the file and the field, from
    load_pretrained, a folder load and ``dcp-ext inspect``."""
    header, expected = _HEADERS[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, bytes(range(24))))
    with pytest.raises(CheckpointCorruptError) as caught:
        dcp_ext.load_pretrained(nn.Linear(2, 2), path)
    assert str(path) in str(caught.value) and expected in str(caught.value), str(caught.value)
    with pytest.raises(CheckpointCorruptError, match="nested too deeply" if "nested" in case else "model.safetensors"):
        dcp_ext.CheckpointReader(tmp_path).read_metadata()  # a folder: the HF folder reader
    assert cli(["inspect", str(path)]) == 2


def test_a_valid_safetensors_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    data = torch.arange(6, dtype=torch.float32).numpy().tobytes()
    path.write_bytes(safetensors_bytes({"__metadata__": {"format": "pt"}, "weight": _WEIGHT, "bias": _BIAS,
                                        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [24, 24]}}, data))
    model = nn.Linear(2, 2)
    report = dcp_ext.load_pretrained(model, path, strict=False)
    assert report.loaded == ("bias", "weight")
    assert model.weight.flatten().tolist() == [0, 1, 2, 3] and model.bias.tolist() == [4, 5]


# -- finding 7: Hugging Face indexes --------------------------------------------------------
_INDEXES = {
    # case: (index bytes, what the message must say)     1139fbb (load_pretrained)
    "not JSON": (b"{oops", "is not valid JSON"),  # raw JSONDecodeError without the file name
    "a list": (b"[]", '"weight_map" object'),  # AttributeError
    "weight_map a list": (b'{"weight_map": []}', '"weight_map" object'),  # AttributeError
    "a list as a file": (b'{"weight_map": {"weight": ["model.safetensors"]}}', "weight_map file of tensor 'weight'"),  # TypeError
    "a path out of the folder": (b'{"weight_map": {"weight": "../x.safetensors"}}', "not a plain relative name"),
    "100k nested brackets": (b"[" * 100_000, "nested too deeply"),  # RecursionError
}


@pytest.mark.parametrize("case", sorted(_INDEXES))
def test_malformed_hf_indexes_are_refused_naming_the_index(tmp_path: Path, case: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """1139fbb: load_pretrained raised JSONDecodeError (no file name),
    AttributeError, TypeError or RecursionError; ``dcp-ext ls`` of a root
    holding such a folder exited 1 with a traceback (RecursionError). Now:
    CheckpointCorruptError naming the index and the field from every reader;
    ``ls`` lists the folder as damaged."""
    text, expected = _INDEXES[case]
    root = tmp_path / "root"
    folder = root / "hf"
    folder.mkdir(parents=True)
    (folder / "model.safetensors.index.json").write_bytes(text)
    (folder / "model.safetensors").write_bytes(safetensors_bytes({"weight": _WEIGHT, "bias": _BIAS}, bytes(24)))
    index = str(folder / "model.safetensors.index.json")
    for load in (lambda: dcp_ext.load_pretrained(nn.Linear(2, 2), folder),
                 lambda: dcp_ext.CheckpointReader(folder).read_metadata()):
        with pytest.raises(CheckpointCorruptError) as caught:
            load()
        assert index in str(caught.value) and expected in str(caught.value), str(caught.value)
    capsys.readouterr()
    assert cli(["inspect", str(folder)]) == 2
    assert index in _one_error_line(capsys.readouterr().err)
    assert cli(["ls", str(root), "--json"]) == 0
    assert [(e["tag"], e["state"]) for e in json.loads(capsys.readouterr().out)["checkpoints"]] == [("hf", "damaged")]


# -- finding 7: command-line options -------------------------------------------------------
@pytest.mark.parametrize("options", ["[1]", "{bad", '"text"'])
def test_storage_options_that_are_not_a_json_object(tmp_path: Path, options: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """1139fbb: '[1]' was a TypeError traceback (exit 1), '{bad' a message
    that did not name the option. Now: InvalidOptionError, exit 2, one line
    naming --storage-options."""
    dcp_ext.save_checkpoint(tmp_path, "a", nn.Linear(2, 2))
    assert cli(["--storage-options", options, "ls", str(tmp_path)]) == 2
    assert "--storage-options" in _one_error_line(capsys.readouterr().err)
    from dcp_ext.cli import _storage_options

    with pytest.raises(InvalidOptionError, match="--storage-options"):
        _storage_options(options)


# -- finding 11: an empty root, an export into its own source --------------------------------
def test_an_empty_path_is_refused_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """1139fbb: '' meant the current directory: dcp_ext.save wrote its files
    there, save_checkpoint a tag and ``newest``, and ``dcp-ext prune ''``
    ran cleanup there. Now: InvalidPathError (a ValueError) everywhere, and
    the directory stays empty."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    model = nn.Linear(2, 2)
    calls = {
        "CheckpointRoot": lambda: dcp_ext.CheckpointRoot(""),
        "CheckpointManager": lambda: dcp_ext.CheckpointManager(""),
        "save": lambda: dcp_ext.save(model.state_dict(), ""),
        "save_checkpoint": lambda: dcp_ext.save_checkpoint("", "t", model),
        "load": lambda: dcp_ext.load(model.state_dict(), ""),
        "CheckpointWriter file://": lambda: dcp_ext.CheckpointWriter("file://"),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidPathError, match="empty checkpoint path") as caught:
            call()
        assert isinstance(caught.value, ValueError), name
    for command in (["ls", ""], ["prune", "", "--keep", "1"], ["verify", ""]):
        assert cli(command) == 2
        assert "empty checkpoint path" in _one_error_line(capsys.readouterr().err)
    assert os.listdir(work) == []


def test_export_refuses_an_output_inside_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """1139fbb: ``dcp-ext export X_partial X_partial/model_rank0.distcp
    --overwrite`` exited 0 and replaced the data file it read (the
    checkpoint no longer loaded); ``--format hf`` into ``X_partial/hf``
    wrote a folder into the checkpoint. Now: InvalidPathError, exit 2, the
    source untouched and loadable."""
    root = tmp_path / "root"
    model = nn.Linear(4, 4)
    dcp_ext.save_checkpoint(root, "X", model)
    source = root / "X_partial"
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    for out, extra in ((source / "model_rank0.distcp", []), (source / "hf", ["--format", "hf"]), (source, []),
                       (source / "sub" / "model.safetensors", [])):
        assert cli(["export", str(source), str(out), "--overwrite", "--quiet", *extra]) == 2, out
        line = _one_error_line(capsys.readouterr().err)
        assert f"export output {out} lies in the checkpoint it exports ({source})" in line, line
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert dcp_ext.verify(source).ok
    with pytest.raises(InvalidPathError):
        dcp_ext.export_hf(str(source), str(source / "hf"))
    # An output beside it is fine.
    assert cli(["export", str(source), str(tmp_path / "model.safetensors"), "--quiet"]) == 0
    fresh = nn.Linear(4, 4)
    dcp_ext.load_pretrained(fresh, tmp_path / "model.safetensors")
    assert torch.equal(fresh.weight, model.weight)


# -- finding 12: broken files and replaced checkpoints -------------------------------------
FRAME = 16 * 1024


def test_verify_reports_only_the_frames_of_a_broken_referenced_file(tmp_path: Path) -> None:
    """An incremental checkpoint s1 refers to frames in s0's data file, which
    is truncated to 3 frames. 1139fbb: verify failed every region of the
    read batch, s1's own healthy frames included (15 problems, 0 frames
    checked). Now: only s0's frames past the cut are reported, each naming
    ``../s0_partial/model_rank0.distcp``; s1's own frames and s0's first
    three frames are checked and pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 128), nn.Linear(128, 128), nn.Linear(128, 16))
    manager = dcp_ext.CheckpointManager(tmp_path, config=dcp_ext.IOConfig(frame_size=FRAME), incremental=True)
    manager.save("s0", model)
    with torch.no_grad():
        model[2].bias.add_(1)
    manager.save("s1", model)
    assert dcp_ext.verify(tmp_path / "s1_partial").ok
    os.truncate(tmp_path / "s0_partial" / "model_rank0.distcp", 3 * FRAME)
    report = dcp_ext.verify(tmp_path / "s1_partial")
    files = {p.file for p in report.problems}
    assert files == {"../s0_partial/model_rank0.distcp"}, [str(p) for p in report.problems]
    assert min(p.start for p in report.problems) == 3 * FRAME
    assert all("cannot be read" in p.reason and "s0_partial/model_rank0.distcp" in p.reason for p in report.problems)
    own = [region for region in manager.checkpoints.partial_store("s1").list_names() if region.endswith(".distcp")]
    assert own == ["model_rank0.distcp"] and report.frames >= 3 + 3  # s0's first three, s1's own


class _Racing(DefaultLoadPlanner):
    """Overwrites (a real save with ``overwrite=True``) or deletes the
    checkpoint between the load's metadata read and its data reads: DCP
    calls ``set_up_planner`` in between, so the race is hit every time."""

    def __init__(self, path: Path, action: str) -> None:
        super().__init__()
        self.path, self.action = path, action

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        super().set_up_planner(*args, **kwargs)
        if self.action == "overwrite":
            dcp_ext.save({"w": torch.ones(64) * 7}, self.path, overwrite=True)
        else:
            shutil.rmtree(self.path)


@pytest.mark.parametrize("action", ["overwrite", "delete"])
def test_a_reader_racing_an_overwrite_is_told_the_checkpoint_was_replaced(tmp_path: Path, action: str) -> None:
    """The checkpoint is overwritten (or deleted) after a load read its metadata. 1139fbb: CheckpointCorruptError "its frame index ...
    is damaged or missing ... restore the file" (overwrite) or
    CheckpointNotFoundError (delete). Now: CheckpointReplacedError naming
    the checkpoint and saying it was replaced/removed, not damaged."""
    ck = tmp_path / "ck"
    dcp_ext.save({"w": torch.arange(64, dtype=torch.float32)}, ck)
    with pytest.raises(CheckpointReplacedError) as caught:
        dcp_ext.load({"w": torch.zeros(64)}, ck, planner=_Racing(ck, action))
    message = str(caught.value)
    assert f"checkpoint {ck} was {'replaced' if action == 'overwrite' else 'removed'}" in message, message
    assert "not damaged" in message and not isinstance(caught.value, CheckpointCorruptError)
    assert isinstance(caught.value, DcpExtError)
    if action == "overwrite":  # the new checkpoint loads
        target = {"w": torch.zeros(64)}
        dcp_ext.load(target, ck)
        assert torch.equal(target["w"], torch.ones(64) * 7)
