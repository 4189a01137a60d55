"""dcp_ext.integrations.megatron with Megatron-Core's real ``dist_checkpointing`` (megatron-core 0.16.1, CPU).

One 2-rank gloo world does every multi-rank check, each bit-exact on every
rank unless it says otherwise:

* a sharded state dict built with Megatron's helpers (row-sharded fp32,
  column-sharded bf16, a replicated tensor, a ``ShardedObject`` per rank,
  plain values in ``common.pt``), saved through Megatron's ``save`` with
  ``DcpExtSaveShardedStrategy``: read by Megatron's default loader (its
  ``torch_dist`` strategy and ``FileSystemReader``) and by
  ``DcpExtLoadShardedStrategy``;
* saved by Megatron's own ``torch_dist`` strategy (two CUDA calls stubbed,
  ``stock_save_on_cpu``), read by ``DcpExtLoadShardedStrategy`` (through
  Megatron's ``load`` and dcp_ext's ``load``): dcp_ext's restricted unpickler
  admits the DCP save plans Megatron pickles into ``.metadata``;
* zstd: ``metadata.json`` says ``dcp_ext``, Megatron's default ``load`` (no
  strategy) finds dcp_ext's registered loader; ``strict=RETURN_ALL`` reports
  no missing or unexpected key. Megatron's ``torch_dist`` strategy gets
  ``NeedsCheckpointReaderError`` from ``load_tensors_metadata`` and from a
  ``strict=RAISE_ALL`` load; from a default load the same message arrives as
  the ``AssertionError`` torch 2.13's ``dcp.load`` makes of any failed
  metadata read;
* ``async_sharded_save=True`` with dcp_ext's strategy: the data is saved
  inside ``async_save``, the returned request runs only Megatron's
  finalizers (``metadata.json``), and the checkpoint loads;
* SeaweedFS through dcp_ext's ``save``/``load``: zstd, replaced by a second
  save, refused with ``CheckpointExistsError`` under ``overwrite=False``
  (the second save's values still load), uncompressed with
  ``content_metadata`` and ``load_common_state_dict``; the files Megatron
  expects, ``metadata.json`` byte for byte as Megatron writes it;
* Megatron's ``FullyParallelSaveStrategyWrapper`` around dcp_ext's save
  strategy (the replicated tensor's save shared out among the ranks): read
  by Megatron's default loader and by ours (its load wrapper needs CUDA);
* plan caching (on by default): a second save of the same state reuses the
  coordinator's global plan; the bf16 tensor saved as float16 (the same
  bytes, sizes and chunks, only the dtype differs) and a shape change plan
  afresh, and load bit-exact with the dtype recorded as saved;
* ``keep_only_main_replica=False``: the replicated tensor, in every rank's
  plan, is saved once (one chunk recorded) and loads bit-exact;
* a tiny ``GPTModel`` tensor parallel over both ranks: our strategy through
  Megatron's ``save``, Megatron's default ``load`` into a model initialised
  otherwise; zstd on SeaweedFS through dcp_ext, applied to the model.

Then a 1-rank world loads the 2-rank checkpoints whole (resharded): the
handmade state locally with Megatron's default loader and from SeaweedFS
with ours, and the GPT into a model without tensor parallelism, compared with
the whole tensors assembled from what the two ranks saved.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_ext.errors import CheckpointCorruptError
from dcp_ext.metadata import load_torch_metadata
from tests.support.dist import run_world
from tests.support.doc_examples import run_examples
from tests.support.megatron_workers import megatron_one_rank, megatron_suite

MEGATRON_CONFIG = '{"sharded_backend": "%s", "sharded_backend_version": 1, "common_backend": "torch", ' \
                  '"common_backend_version": 1}'


def test_megatron_dist_checkpointing(make_backend, tmp_path) -> None:
    backend = make_backend("seaweedfs")
    s3_root = backend.url("megatron")
    results = run_world(2, megatron_suite, str(tmp_path), s3_root, backend.storage_options, timeout=400)
    for rank, out in enumerate(results):
        for check in ("ours_by_megatron", "ours_by_ours", "stock_by_ours", "stock_by_our_load", "zstd_by_default",
                      "async", "s3_zstd", "s3_replaced", "s3_kept", "s3_plain", "gpt_by_megatron", "gpt_s3_zstd",
                      "gpt_applied", "fp_by_megatron", "fp_by_ours", "cache1_by_megatron", "cache2_by_megatron",
                      "cache_fp16_by_megatron", "cache_fp16_by_ours", "cache_shape_by_megatron",
                      "replicas_by_megatron"):
            assert out[check] == [], (rank, check, out[check][:10])
        assert out["replicas_chunks"] == {"layer.w": 2, "layer.bf": 2, "layer.b": 1}, (rank, out["replicas_chunks"])
        assert out["cache_fp16_dtypes"] == [("layer.b", "torch.float32"), ("layer.bf", "torch.float16"),
                                            ("layer.w", "torch.float32")], (rank, out["cache_fp16_dtypes"])
        for check in ("zstd_by_torch_dist_strict", "zstd_tensors_by_torch_dist"):
            assert out[check][0] == "NeedsCheckpointReaderError", (rank, check, out[check])
        # dcp.load (torch 2.13) turns the reader's error into an AssertionError quoting it.
        kind, message = out["zstd_by_torch_dist"]
        assert kind == "AssertionError" and "load it with dcp_ext.CheckpointReader" in message, (rank, kind, message)
        assert out["s3_no_overwrite"] == "CheckpointExistsError", (rank, out["s3_no_overwrite"])
        assert out["zstd_strict"] == (set(), set()), (rank, out["zstd_strict"])
        assert out["s3_common"] == {"common": {"step": 1, "lr": 0.5, "name": "run1"}, "iteration": 1,
                                    "content_metadata": {"format": 7}}, out["s3_common"]
        assert out["gpt_fresh_differs"], rank  # the load had something to do
        assert out["async_left_to_run"] is False, rank  # saved synchronously inside async_save
    first = results[0]
    dcp_files = {".metadata", "dcp_ext.metadata.json", "common.pt", "metadata.json"}
    for name in ("ours", "zstd", "async", "gpt", "fp"):
        assert dcp_files <= set(first["files"][name]), (name, first["files"][name])
    assert "dcp_ext.metadata.json" not in first["files"]["stock"], first["files"]["stock"]
    # Plan caching: the coordinator reused the plan of the save before for the same state only (the
    # cache is the process's: cache1 reuses the plan of the "ours" save, another strategy of the same state).
    assert [first[f"{name}_reused"] for name in ("cache1", "cache2", "cache_fp16", "cache_shape")] == [
        True, True, False, False]
    # io_options={"key_prefixes": 4}: the data files under prefixes 0 and 1, none beside the metadata.
    assert {"0", "1"} <= set(first["files"]["replicas"]), first["files"]["replicas"]
    assert not [name for name in first["files"]["replicas"] if name.endswith(".distcp")], first["files"]["replicas"]
    # dcp_ext's files per kind and rank (the handmade keys, "layer.*", are of the kind "state").
    assert {"state_rank0.distcp", "state_rank1.distcp"} <= set(first["files"]["cache2"]), first["files"]["cache2"]
    assert first["configs"] == {**{name: MEGATRON_CONFIG % "torch_dist" for name in (
                                    "cache1", "cache2", "cache_fp16", "cache_shape", "replicas")},
                                "ours": MEGATRON_CONFIG % "torch_dist", "stock": MEGATRON_CONFIG % "torch_dist",
                                "zstd": MEGATRON_CONFIG % "dcp_ext", "async": MEGATRON_CONFIG % "torch_dist",
                                "gpt": MEGATRON_CONFIG % "torch_dist", "fp": MEGATRON_CONFIG % "torch_dist"}
    assert dcp_files <= set(first["s3_files"]) and first["s3_config"] == MEGATRON_CONFIG % "dcp_ext"

    shards = [out["gpt_shards"] for out in results]
    (whole,) = run_world(1, megatron_one_rank, str(tmp_path), s3_root, backend.storage_options, shards, timeout=300)
    for check in ("local", "s3_zstd", "gpt"):
        assert whole[check] == [], (check, whole[check][:10])
    assert whole["gpt_keys"] > 20, whole["gpt_keys"]


def _megatron_like_metadata(extra: object) -> bytes:
    """A ``.metadata`` pickle as Megatron's torch_dist writer makes one: DCP's
    ``Metadata`` with every rank's save plan in ``all_local_plans``, and
    ``extra`` among the plans' planner data."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    items = [
        WriteItem(MetadataIndex("w", (0,)), WriteItemType.SHARD),
        WriteItem(MetadataIndex("rng/shard_0_2"), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(nbytes=5)),
    ]
    metadata = Metadata(state_dict_metadata={}, storage_data={})
    metadata.all_local_plans = [SavePlan(items=items, planner_data=extra)]  # type: ignore[attr-defined]
    return pickle.dumps(metadata)


def test_megatron_save_plans_are_admitted_and_nothing_else() -> None:
    """dcp_ext's restricted unpickler reads Megatron's ``.metadata``, which
    pickles DCP's ``SavePlan``, ``WriteItem``, ``WriteItemType``,
    ``TensorWriteData`` and ``BytesIOWriteData``; any other class, another of
    DCP's planner module included, is still refused before it is imported."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    tensor_data = TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4])),
                                  properties=None, size=torch.Size([4]))
    loaded = load_torch_metadata(_megatron_like_metadata({"tensor": tensor_data}), "megatron/.metadata")
    (plan,) = loaded.all_local_plans  # type: ignore[attr-defined]
    assert [item.type for item in plan.items] == [WriteItemType.SHARD, WriteItemType.BYTE_IO]
    assert plan.items[1].bytes_io_data.nbytes == 5 and plan.planner_data["tensor"].size == torch.Size([4])
    for hostile, name in ((LoadPlan(items=[]), "torch.distributed.checkpoint.planner.LoadPlan"),
                          (io.BytesIO(b"x"), "_io.BytesIO")):
        with pytest.raises(CheckpointCorruptError, match=f"refers to {name}, which is not part of DCP"):
            load_torch_metadata(_megatron_like_metadata({"x": hostile}), "megatron/.metadata")


def test_documented_examples_run(tmp_path) -> None:
    """The Megatron examples of README.md and the framework guide run as written (one process each)."""
    blocks = {("README.md", "megatron"): tmp_path / "readme", ("docs/guides/integrations.md", "megatron-guide"):
              tmp_path / "guide"}
    assert run_examples(blocks) == {}
    assert {".metadata", "state_rank0.distcp", "common.pt", "dcp_ext.metadata.json", "metadata.json"} <= {
        p.name for p in (tmp_path / "readme" / "ckpt" / "iter_1").iterdir()}
