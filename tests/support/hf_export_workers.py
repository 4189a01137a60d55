"""Rank code of tests/test_hf_export.py: Hugging Face exports of MiniLM-L6 from 2 ranks.

One world does every multi-rank check (FSDP2 and tensor-parallel live
state, a partial checkpoint, the CheckpointManager hooks, failures); the
test process then loads what it wrote with transformers and safetensors.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dcp_ext
from dcp_ext._runtime import failpoints as _failpoints

# Small enough that MiniLM-L6 (90.9 MB) makes 3 files: the 46.9 MB word
# embeddings alone, then about 30 MB each.
SHARD = "30MB"
SMALL_SHARD = "2MB"


def _raised(fn: Any) -> tuple[str, str]:
    """``(class name, message)`` of what ``fn()`` raises."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test compares them across ranks
        return type(err).__name__, str(err)
    raise AssertionError("expected an error")


def _equal_full(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> bool:
    """Every tensor of the (sharded) model's state equals the reference's."""
    for key, value in get_model_state_dict(model).items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        if not torch.equal(whole, reference[key]):
            return False
    return True


def hf_world(rank: int, world_size: int, model_dir: str, out: str) -> dict[str, Any]:
    from transformers import BertConfig, BertModel

    config_text = open(os.path.join(model_dir, "config.json"), encoding="utf-8").read()
    reference_model = BertModel.from_pretrained(model_dir)
    reference = {k: v.detach().clone() for k, v in reference_model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world_size,))
    report: dict[str, Any] = {}

    # FSDP2, real weights (uneven shards: 30522 rows, 1536-row MLPs are even, 384-wide biases).
    fsdp = copy.deepcopy(reference_model)
    for layer in fsdp.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    state = get_model_state_dict(fsdp)
    report["fsdp"] = dcp_ext.save_hf(state, f"{out}/fsdp", max_shard_size=SHARD, config_json=config_text)
    report["bf16"] = dcp_ext.save_hf(state, f"{out}/bf16", max_shard_size=SHARD, dtype=torch.bfloat16,
                                     config_json=BertConfig.from_pretrained(model_dir).to_dict())

    # A partial checkpoint of the same model, exported by both ranks.
    manager = dcp_ext.CheckpointManager(f"{out}/root")
    manager.save("step1", fsdp, user_content={"step": 1})
    report["partial"] = dcp_ext.export_hf(f"{out}/root/step1_partial", f"{out}/from_partial",
                                          max_shard_size=SHARD, config_json=config_text)
    # The manager's hooks (export of a tag: tested in one process): a full save as a folder, resume from it.
    dcp_ext.save_checkpoint(f"{out}/root", "full1", fsdp, partial=False, full_format="hf", max_shard_size=SHARD,
                            hf_config=config_text, user_content={"step": 1})
    with torch.device("meta"):
        fresh = BertModel(BertConfig.from_pretrained(model_dir))
    for layer in fresh.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    resumed = manager.resume(fresh, tag="full1", partial=False)
    report["resumed_user_content"] = resumed.user_content
    report["resumed_equal"] = _equal_full(fresh, reference)

    # Tensor parallel: Shard(0) (colwise) and Shard(1) (rowwise) weights, replicated rest.
    tp = copy.deepcopy(reference_model)
    for layer in tp.encoder.layer:
        parallelize_module(layer, mesh, {
            "attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
            "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel(),
        })
    tp_state = get_model_state_dict(tp)
    report["tp_placements"] = sorted({str(v.placements) for v in tp_state.values() if hasattr(v, "placements")})
    report["tp"] = dcp_ext.save_hf(tp_state, f"{out}/tp", max_shard_size=SHARD, config_json=config_text)
    # Its partial checkpoint holds column blocks (Shard(1)): read into place one at a time.
    dcp_ext.save(tp_state, f"{out}/tp_partial")
    report["tp_partial"] = dcp_ext.export_hf(f"{out}/tp_partial", f"{out}/tp_from_partial", max_shard_size=SHARD)

    # -- failures and overwrite ---------------------------------------------------------
    report["exists"] = _raised(lambda: dcp_ext.save_hf(state, f"{out}/fsdp", max_shard_size=SHARD))
    bad = {**state, "pooler.bad": torch.zeros(2, dtype=torch.complex64)}
    report["bad_dtype"] = _raised(lambda: dcp_ext.save_hf(bad, f"{out}/bad_dtype", max_shard_size=SHARD))
    uneven = state if rank == 0 else {k: v for k, v in state.items() if k != "pooler.dense.bias"}
    report["keys_differ"] = _raised(lambda: dcp_ext.save_hf(uneven, f"{out}/keys_differ"))
    # Layer 0 alone (7 MB) in 2 MB files: several files per rank, quickly.
    small = {k: v for k, v in state.items() if k.startswith("encoder.layer.0.")}
    report["small"] = dcp_ext.save_hf(small, f"{out}/overwrite", max_shard_size=SMALL_SHARD)
    # Rank 1 fails after writing its first tensor (a failure point armed there only).
    if rank == 1:
        os.environ["DCP_EXT_FAIL_AT"] = "mid_hf_export"
        _failpoints.reload()
    try:
        report["injected"] = _raised(lambda: dcp_ext.save_hf(small, f"{out}/injected", max_shard_size=SMALL_SHARD))
    finally:
        os.environ.pop("DCP_EXT_FAIL_AT", None)
        _failpoints.reload()
    # Rank 1 cannot commit its files (a directory sits where each goes); rank 0 commits its own.
    if rank == 1:
        for name in report["small"].files:
            os.makedirs(f"{out}/blocked/{name}")
    dist.barrier()
    report["blocked"] = _raised(lambda: dcp_ext.save_hf(small, f"{out}/blocked", max_shard_size=SMALL_SHARD))
    # An overwrite of those files by the whole model in one file (model.safetensors): the old files go.
    report["overwrite_refused"] = _raised(lambda: dcp_ext.save_hf(state, f"{out}/overwrite"))
    report["overwrite"] = dcp_ext.save_hf(state, f"{out}/overwrite", overwrite=True, config_json=config_text)
    return report
