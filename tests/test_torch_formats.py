"""Checkpoints in torch's own formats load with dcp_ext (issue 18, part C).

* ``FileSystemWriter(_extensions=[ZStandard()])`` and user stream extensions
  (through a caller's ``ExtensionRegistry``);
* torch's ``HuggingFaceStorageWriter`` output, rank-0 and ``save_distributed``,
  resharded into another world with ranged reads;
* ``.metadata`` of older DCP releases naming the legacy
  ``_shard.sharded_tensor.metadata.TensorProperties``, while hostile pickles
  stay refused;
* overwrite refusals worded as torch's (``Checkpoint already exists``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import IO, Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties

import dcp_ext
from dcp_ext import CheckpointManager, CheckpointReader, save_checkpoint
from tests.support import api_workers
from tests.support.compare import assert_same_state
from tests.support.dist import run_world
from tests.support.hostile import RunsCode
from tests.support.torch_format_workers import hf_state, hf_world


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(64, 33, generator=generator),
        "half": torch.randn(5, 7, generator=generator).to(torch.bfloat16),
        "ids": torch.arange(100, dtype=torch.int64).reshape(10, 10),
        "zeros": torch.zeros(4096),  # compresses: the stream is really zstd
        "extra": {"step": 12, "name": "run-a"},
    }


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "name": ""}
        for k, v in state.items()
    }


class _Xor(StreamTransformExtension):
    """A user extension torch's default registry does not know: XOR every byte."""

    KEY = 0x5A

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> _Xor:
        if version != "1":
            raise ValueError(f"unknown test.xor version {version}")
        return _Xor()

    def get_descriptor(self) -> str:
        return "test.xor/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _XorStream(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _XorStream(input)  # type: ignore[return-value]


class _XorStream(io.RawIOBase):
    def __init__(self, inner: IO[bytes]) -> None:
        super().__init__()
        self.inner = inner

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        return bytes(b ^ _Xor.KEY for b in self.inner.read(-1 if size is None else size))

    def write(self, data: Any) -> int:
        raw = bytes(memoryview(data).cast("B"))
        self.inner.write(bytes(b ^ _Xor.KEY for b in raw))
        return len(raw)

    def close(self) -> None:
        if not self.closed:
            self.inner.close()
        super().close()


def test_zstd_stream_extension_loads_bit_exact(tmp_path: Path) -> None:
    state = _state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[ZStandard()]))
    stored = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    assert {tuple(info.transform_descriptors) for info in stored.values()} == {("stream.zstd/1",)}
    assert (tmp_path / "__0_0.distcp").stat().st_size < 64 * 33 * 4 + 4096 * 4  # compressed
    loaded = _zeros_like(state)
    dcp_ext.load(loaded, tmp_path)
    assert_same_state(state, loaded)
    # A row slice of one tensor (a different "world" than the save's) through stock dcp.load.
    part = {"w": torch.zeros(64, 33)}
    dcp.load(part, storage_reader=CheckpointReader(tmp_path), planner=dcp_ext.LayoutLoadPlanner(keys=("w",)))
    assert torch.equal(part["w"], state["w"])


def test_user_extension_needs_the_callers_registry(tmp_path: Path) -> None:
    state = _state()
    # A chain of two extensions, as torch's writer applies and records them.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[ZStandard(), _Xor()]))
    with pytest.raises(dcp_ext.UnsupportedCodecError, match=r"__0_0\.distcp.*'test\.xor/1'.*extension_registry"):
        dcp_ext.load(_zeros_like(state), tmp_path)
    registry = ExtensionRegistry()
    registry.register(_Xor)
    loaded = _zeros_like(state)
    dcp_ext.load(loaded, tmp_path, extension_registry=registry)
    assert_same_state(state, loaded)
    # One user extension alone: torch's own reader with the same registry agrees.
    # (torch 2.13's reader undoes a chain in the wrong order; see dcp_ext/_torch_items.py.)
    single = tmp_path / "single"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(single), _extensions=[_Xor()]))
    loaded, reference = _zeros_like(state), _zeros_like(state)
    dcp_ext.load(loaded, single, extension_registry=registry)
    dcp.load(reference, storage_reader=dcp.FileSystemReader(str(single), _extension_registry=registry))
    assert_same_state(state, loaded)
    assert_same_state(reference, loaded)


def test_damaged_zstd_stream_is_refused_naming_file_and_key(tmp_path: Path) -> None:
    state = {"w": torch.randn(32, 32)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path), _extensions=[ZStandard()]))
    data = tmp_path / "__0_0.distcp"
    # The zstd frame header (torch's format has no checksums: a flipped data
    # byte in a stored block decodes, as with torch's own reader).
    raw = bytearray(data.read_bytes())
    raw[1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"__0_0\.distcp: 'w' cannot be decoded"):
        dcp_ext.load({"w": torch.zeros(32, 32)}, tmp_path)


def _legacy_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> None:
    """What PyTorch's test_compatibility.py::test_sharded_tensor_dependency
    builds: metadata pickled with the legacy TensorProperties class."""
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as LegacyProperties

    with patch("torch.distributed.checkpoint.metadata.TensorProperties", LegacyProperties):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))


def test_legacy_tensor_properties_metadata_loads(tmp_path: Path) -> None:
    state = {"a": torch.randn(4, 4), "b": torch.arange(6, dtype=torch.int32)}
    _legacy_checkpoint(tmp_path, state)
    pickled = (tmp_path / ".metadata").read_bytes()
    assert b"torch.distributed._shard.sharded_tensor.metadata" in pickled and b"MEM_FORMAT_ENCODING" in pickled
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_ext.load(loaded, tmp_path)
    assert_same_state(state, loaded)
    # Read as today's DCP class, with the stored fields.
    properties = CheckpointReader(tmp_path).read_metadata().state_dict_metadata["b"].properties
    assert type(properties) is TensorProperties
    assert (properties.dtype, properties.memory_format) == (torch.int32, torch.contiguous_format)


def test_hostile_metadata_pickles_stay_refused(tmp_path: Path) -> None:
    _legacy_checkpoint(tmp_path / "base", {"a": torch.randn(4, 4)})
    metadata = pickle.loads((tmp_path / "base" / ".metadata").read_bytes())
    marker = tmp_path / "pwned"
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

    cases = {
        "posix.system": RunsCode(marker),  # runs a command if unpickled
        # Another class of the legacy module than the two data classes admitted.
        "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata": ShardedTensorMetadata(),
    }
    for name, value in cases.items():
        hostile = tmp_path / name.rsplit(".", 1)[-1]
        shutil.copytree(tmp_path / "base", hostile)
        evil = Metadata(state_dict_metadata=metadata.state_dict_metadata, storage_data=metadata.storage_data,
                        planner_data={"x": value})
        (hostile / ".metadata").write_bytes(pickle.dumps(evil))
        with pytest.raises(dcp_ext.CheckpointCorruptError, match=f"refers to {name}, which is not part of DCP"):
            dcp_ext.load({"a": torch.zeros(4, 4)}, hostile)
    assert not marker.exists()


def _write_hf(path: Path, state: dict[str, torch.Tensor]) -> None:
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        str(path), fqn_to_index_mapping={"embed.weight": 1, "head.weight": 2, "head.bias": 2}))


def test_hf_folder_rank0_save_loads(tmp_path: Path) -> None:
    state = hf_state()
    _write_hf(tmp_path / "hf", state)
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_ext.load(loaded, tmp_path / "hf")
    assert_same_state(state, loaded)
    # Only the bytes asked for are read: one tensor of three.
    reader = CheckpointReader(tmp_path / "hf")
    part = {"head.bias": torch.zeros(7, dtype=torch.int64)}
    dcp.load(part, storage_reader=reader, planner=dcp_ext.LayoutLoadPlanner(keys=("head.bias",)))
    assert torch.equal(part["head.bias"], state["head.bias"])
    assert reader.store.stats.snapshot().bytes_read < 2 * 64 * 1024 + 56  # two header reads + 7 int64
    # An index that puts a key in the wrong file: refused, naming key and file.
    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["head.bias"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(dcp_ext.CheckpointCorruptError, match=r"'head.bias' in .*model-00001-of-00002.safetensors"):
        dcp_ext.load(loaded, tmp_path / "hf")
    # Without its index, the numbered files are a save that has not finished.
    index_file.unlink()
    with pytest.raises(dcp_ext.CheckpointIncompleteError, match="no model.safetensors.index.json"):
        dcp_ext.load(loaded, tmp_path / "hf")


def test_hf_consolidated_save_loads_from_both_folders(tmp_path: Path) -> None:
    # torch's consolidation handles floating-point tensors only.
    state = {k: v for k, v in hf_state().items() if v.is_floating_point()}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        str(tmp_path), save_distributed=True, enable_consolidation=True))
    for folder in (tmp_path, tmp_path / "sharded"):
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp_ext.load(loaded, folder)
        assert_same_state(state, loaded)


def test_hf_distributed_save_resharded_both_ways(tmp_path: Path) -> None:
    state = hf_state()
    full, distributed = tmp_path / "full", tmp_path / "dist"
    _write_hf(full, state)
    ranks = run_world(2, hf_world, str(distributed), str(full))
    # 1 -> 2: each rank got its row shard, bit-exact, with ranged reads: half
    # the data (2.5 MiB in all) plus the headers (64 KiB a file, read twice).
    total = sum(v.numel() * v.element_size() for v in state.values())
    for rank in ranks:
        assert_same_state(rank["expected"], rank["local"])
        assert rank["bytes_read"] <= total // 2 + 8 + 2 * 2 * 64 * 1024
    # 2 -> 1: one file per rank, chunks at their saved offsets; no index.
    assert sorted(os.listdir(distributed)) == [
        "shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp_ext.load(loaded, distributed)
    assert_same_state(state, loaded)
    reference = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(reference, storage_reader=HuggingFaceStorageReader(str(distributed)))
    assert_same_state(reference, loaded)
    # A missing rank's file leaves its tensors' chunks short: refused, not zeros.
    # (The replicated head.bias is saved by one rank: delete the other's file.)
    (victim,) = [f for f in distributed.iterdir() if b'"head.bias"' not in f.read_bytes()[:4096]]
    victim.unlink()
    with pytest.raises(dcp_ext.CheckpointIncompleteError, match=r"'embed.weight'.* a shard file is missing"):
        dcp_ext.load(loaded, distributed)


def test_overwrite_refusals_use_torch_wording(tmp_path: Path) -> None:
    dcp_ext.save({"a": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(dcp_ext.CheckpointExistsError, match="Checkpoint already exists") as info:
        dcp_ext.save({"a": torch.ones(2)}, tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(info.value) and "overwrite=True" in str(info.value)
    model = api_workers.mlp(0)
    root = tmp_path / "root"
    save_checkpoint(root, "full", model, partial=False)
    with pytest.raises(dcp_ext.CheckpointExistsError, match="Checkpoint already exists.*full"):
        save_checkpoint(root, "full", model, partial=False)
    save_checkpoint(root, "s1", model)
    manager = CheckpointManager(root)
    manager.export("s1", out="exported")
    with pytest.raises(dcp_ext.CheckpointExistsError, match="Checkpoint already exists at .*exported"):
        manager.export("s1", out="exported")
