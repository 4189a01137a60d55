"""Rank code for the checkpoint-API tests (test_checkpoint_api.py), one world per function."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dcp_ext
from dcp_ext import CheckpointManager

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def mlp(seed: int, width: int = 16, hidden: int = 64, blocks: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width)]
    return nn.Sequential(*layers)


def tp_plan(model: nn.Sequential) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for i in range(0, len(model), 3):
        plan[str(i)] = ColwiseParallel()
        plan[str(i + 2)] = RowwiseParallel()
    return plan


# -- layout: 2x2 FSDP2 x TP and plain ranks -------------------------------------------
def layout_world(rank: int, world_size: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = mlp(0, width=512, hidden=2048, blocks=4)  # ~34 MB of fp32 weights
    parallelize_module(model, mesh["tp"], tp_plan(model))
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(100 + mesh["dp"].get_local_rank())
    model(torch.randn(4, 512)).square().mean().backward()
    optim.step()
    manager = CheckpointManager(f"{root}/mesh", mesh=mesh)
    manager.save("t1", model, optim, user_content={"step": 1})
    # A full checkpoint straight from the sharded model: rank 0 writes one
    # tensor at a time as the ranks all-gather it.
    manager.save("direct", model, partial=False, full_format="torch")
    full = get_model_state_dict(model, options=FULL)

    # The same world without a mesh: FSDP2 over all 4 ranks, files by rank.
    flat = mlp(1)
    fully_shard(flat, mesh=init_device_mesh("cpu", (world_size,)))
    CheckpointManager(f"{root}/plain").save("t1", flat)
    out: dict[str, Any] = {}
    if rank == 0:
        out["full"] = {k: v.clone() for k, v in full.items()}
        for name in ("mesh", "plain"):
            out[f"{name}_files"] = sorted(os.listdir(f"{root}/{name}/t1_partial"))
            out[f"{name}_partition"] = json.loads(open(f"{root}/{name}/t1_partial/partition.json").read())
    return out


# -- resume equivalence: DDP, FSDP2, TP with Adam ------------------------------------------
K = 3


class LateBranch(nn.Module):
    """An MLP plus a branch used only from step K on: at the save after K
    steps the branch's parameters have no optimizer state (never had a grad),
    as with frozen layers or a pooler the loss does not use."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.body = mlp(seed)
        self.late = nn.Linear(16, 16)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + self.late(x) if self.use_late else y


def _build(kind: str, seed: int) -> nn.Module:
    world = dist.get_world_size()
    if kind == "fsdp2_late":
        late = LateBranch(seed)
        fully_shard(late, mesh=init_device_mesh("cpu", (world,)))
        return late
    model = mlp(seed)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world,))
    if kind == "fsdp2":
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        parallelize_module(model, mesh, tp_plan(model))
    return model


def _step(kind: str, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    # Tensor parallel ranks share their input; data-parallel ranks differ.
    seed = 1000 + step * 10 + (0 if kind == "tp" else dist.get_rank())
    torch.manual_seed(seed)
    optim.zero_grad()
    if isinstance(model, LateBranch):
        model.use_late = step >= K
    model(torch.randn(8, 16)).square().mean().backward()
    optim.step()


def _full_params(kind: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if kind == "ddp":
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return {k: v.clone() for k, v in get_model_state_dict(model, options=FULL).items()}


KINDS = ("ddp", "fsdp2", "tp", "fsdp2_late")


def train_world(rank: int, world_size: int, root: str, phase: str) -> dict[str, Any]:
    """phase "first": train 2K steps straight, and K steps then save.
    phase "resume": resume the K-step checkpoint, train K more."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        path = f"{root}/{kind}"
        if phase == "first":
            model = _build(kind, 0)
            optim = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(2 * K):
                _step(kind, model, optim, step)
            out[f"{kind}_straight"] = _full_params(kind, model)
            model = _build(kind, 0)
            optim = torch.optim.Adam(model.parameters(), lr=0.01)
            for step in range(K):
                _step(kind, model, optim, step)
            dcp_ext.save_checkpoint(path, f"step{K}", model, optim, user_content={"step": K, "kind": kind})
        else:
            model = _build(kind, 123)  # different initial weights: all must come from the checkpoint
            optim = torch.optim.Adam(model.parameters(), lr=0.01)
            result = dcp_ext.resume_from_checkpoint(path, model, optim)
            assert result.tag == f"step{K}" and result.user_content == {"step": K, "kind": kind}, result
            for step in range(result.user_content["step"], 2 * K):
                _step(kind, model, optim, step)
            out[f"{kind}_resumed"] = _full_params(kind, model)
    return out if rank == 0 else {}


# -- fine-tuning: MiniLM-L6 into a meta-device model sharded over 2 ranks -------------
def finetune_world(rank: int, world_size: int, model_dir: str) -> dict[str, Any]:
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = BertModel(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.encoder.layer:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = dcp_ext.load_pretrained(model, os.path.join(model_dir, "model.safetensors"), strict=True)
    # Non-persistent buffers are in no checkpoint: the caller sets them.
    with torch.no_grad():
        model.embeddings.position_ids.copy_(torch.arange(config.max_position_embeddings).expand(1, -1))
        model.embeddings.token_type_ids.zero_()
    model.eval()
    input_ids = torch.tensor([[101, 7592, 2088, 1010, 2023, 2003, 1037, 3231, 102]])
    with torch.no_grad():
        sharded_out = model(input_ids=input_ids).last_hidden_state
    reference = BertModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        reference_out = reference(input_ids=input_ids).last_hidden_state
    return {
        "equal": bool(torch.equal(sharded_out, reference_out)),
        "max_diff": float((sharded_out - reference_out).abs().max()),
        "bytes_read": report.bytes_read,
        "uninitialized": report.uninitialized_buffers,
        "unexpected": report.unexpected,
        "file_size": os.path.getsize(os.path.join(model_dir, "model.safetensors")),
    }
