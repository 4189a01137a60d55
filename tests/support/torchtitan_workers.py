"""Rank functions for tests/test_integrations_torchtitan.py: torchtitan's real
checkpoint managers driving an FSDP2 model, torchtitan's optimizer and LR
scheduler containers and a train state, on a gloo world.

torchtitan's full ``Trainer`` defaults to CUDA, so these build what it would
hand its checkpoint manager and call the manager as the trainer does:
``load()`` once, ``save(step)`` after every step, ``maybe_wait_for_saving()``
and ``close()`` at the end.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["torchtitan_suite"]


class TrainState(Stateful):
    """What torchtitan's trainer saves of itself: the step and tokens seen."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "ntokens_seen": torch.tensor(self.ntokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        self.ntokens_seen = int(state_dict["ntokens_seen"].item())


class Job:
    """One rank's model, optimizers, LR schedulers, train state and manager."""

    def __init__(self, manager_cls: Any, seed: int, **config: Any) -> None:
        from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)
        )
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine").build(
            optimizers=self.optimizers, training_steps=20)
        self.train_state = TrainState()
        self.manager = manager_cls.Config(enable=True, initial_load_model_only=False, **config).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"train_state": self.train_state}, sd_adapter=None)

    def step(self) -> None:
        """One training step on this rank's own batch (same on every run)."""
        g = torch.Generator().manual_seed(1000 * self.train_state.step + dist.get_rank())
        x = torch.randn(4, 16, generator=g)
        self.optimizers.zero_grad()
        self.model(x).square().mean().backward()
        self.optimizers.step()
        self.schedulers.step()
        self.train_state.step += 1
        self.train_state.ntokens_seen += x.numel()

    def snapshot(self) -> dict[str, Any]:
        """This rank's model and optimizer shards, LR scheduler and train state."""
        return _local({
            "model": self.model.state_dict(),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.schedulers.state_dict(),
            "train_state": self.train_state.state_dict(),
        })

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
            self.manager.save(self.train_state.step)
        self.manager.maybe_wait_for_staging()
        self.manager.maybe_wait_for_saving()


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


def _case(writer_cls: Any, reader_cls: Any, folder: str, **config: Any) -> dict[str, Any]:
    """Train 6 steps saving every 2nd (keep 2), then resume in a fresh job
    (other initial weights) and take one more step in both.

    Returns:
        Snapshots: ``saved`` (after step 6, what was saved), ``resumed``
        (right after ``load``), ``next`` / ``next_resumed`` (one more step in
        each), the step the fresh job resumed at and what ``load`` returned.
    """
    from tests.support.compare import state_diff

    first = Job(writer_cls, seed=0, folder=folder, interval=2, keep_latest_k=2, **config)
    assert first.manager.load() is False  # a fresh start
    first.train(6)
    saved = first.snapshot()
    first.step()
    nxt = first.snapshot()
    first.manager.close()
    dist.barrier()

    second = Job(reader_cls, seed=1, folder=folder, interval=2, keep_latest_k=2, **config)
    loaded = second.manager.load()
    resumed = second.snapshot()
    second.step()
    next_resumed = second.snapshot()
    second.manager.close()
    return {"loaded": loaded, "step": second.train_state.step,
            "resumed_diff": state_diff(saved, resumed), "next_diff": state_diff(nxt, next_resumed)}


def torchtitan_suite(rank: int, world_size: int, local_root: str, s3_root: str,
                     storage_options: dict[str, Any]) -> dict[str, Any]:
    """Every torchtitan check in one world (see the test's docstring)."""
    from torchtitan.components.checkpointer import CheckpointManager

    from dcp_ext.integrations import _checkpoint_dirs as dirs
    from dcp_ext.integrations.torchtitan import DcpExtCheckpointManager
    from dcp_ext.storage import Location

    out: dict[str, Any] = {}
    ours = DcpExtCheckpointManager
    out["local_sync_zstd"] = _case(ours, ours, os.path.join(local_root, "zstd"), compression="zstd")
    out["s3_async_zstd"] = _case(ours, ours, f"{s3_root}/async", async_mode="async", compression="zstd",
                                 storage_options=storage_options,
                                 io_options={"max_concurrency": 2, "part_size": "5MiB", "key_prefixes": 4})
    # io_options' key_prefixes reach the planner, which names the data files (under 4 key prefixes).
    steps = Location.of(f"{s3_root}/async", storage_options).open()
    out["s3_data_files"] = sorted(name for name in steps.list_tree() if name.endswith(".distcp"))
    # Cross-reading: stock torchtitan (FileSystemWriter/Reader) and ours (uncompressed), both ways.
    out["stock_to_ours"] = _case(CheckpointManager, ours, os.path.join(local_root, "stock"))
    out["ours_to_stock"] = _case(ours, CheckpointManager, os.path.join(local_root, "ours"), async_mode="async")
    # Stock torchtitan under use_for_dcp: its dcp.save/async_save/load(checkpoint_id=...) calls use dcp_ext,
    # compressed: it finds the step to resume by torch's .metadata, which every dcp_ext checkpoint has.
    from dcp_ext.dcp_default import use_for_dcp

    with use_for_dcp(compression="zstd"):
        out["stock_use_for_dcp"] = _case(CheckpointManager, CheckpointManager, os.path.join(local_root, "use"),
                                         async_mode="async")
    dist.barrier()
    if rank == 0:
        out["listings"] = {
            "zstd": dirs.child_dirs(Location.of(os.path.join(local_root, "zstd"))),
            "use_for_dcp_markers": sorted(os.listdir(os.path.join(local_root, "use", "step-6"))),
            "ours_data_files": sorted(n for n in os.listdir(os.path.join(local_root, "ours", "step-6"))
                                      if n.endswith(".distcp")),
            "s3": dirs.child_dirs(Location.of(f"{s3_root}/async", storage_options)),
            "s3_markers": sorted(n for n in Location.of(f"{s3_root}/async/step-6", storage_options).open().list_names()
                                 if not n.endswith(".distcp")),
        }
    return out
