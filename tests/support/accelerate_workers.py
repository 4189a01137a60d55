"""Rank functions for tests/test_integrations_accelerate.py: Accelerate's FSDP2
sharded save/load (accelerate's own functions and dcp_ext's drop-ins) on a
gloo world.

On a CPU machine Accelerate does not turn on FSDP itself (its FSDP path is
for accelerators), so the model is sharded with ``fully_shard`` and the
``FullyShardedDataParallelPlugin`` is passed to the functions explicitly, as
``Accelerator.save_state`` would pass ``accelerator.state.fsdp_plugin``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["accelerate_suite"]


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


class Job:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.steps = 0

    def step(self) -> None:
        g = torch.Generator().manual_seed(100 * self.steps + dist.get_rank())
        self.optimizer.zero_grad()
        self.model(torch.randn(4, 16, generator=g)).square().mean().backward()
        self.optimizer.step()
        self.steps += 1

    def snapshot(self) -> dict[str, Any]:
        return _local({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})


def accelerate_suite(rank: int, world_size: int, local_root: str, s3_root: str,
                     storage_options: dict[str, Any]) -> dict[str, Any]:
    """Every Accelerate check in one world (see the test's docstring)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    import importlib
    import sys
    import warnings

    for module in ("dcp_ext", "dcp_ext.integrations", "dcp_ext.whole_state", "dcp_ext.dcp_default"):
        importlib.import_module(module)
    frameworks = ("accelerate", "lightning", "pytorch_lightning", "torchtitan")
    out: dict[str, Any] = {"frameworks_imported_by_dcp_ext": sorted(
        m for m in sys.modules if m.split(".")[0] in frameworks)}
    warnings.filterwarnings("ignore")
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils import fsdp_utils as stock

    from dcp_ext.integrations import accelerate as ours
    from tests.support.compare import state_diff

    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    trained = Job(seed=0)
    trained.step()
    trained.step()
    saved = trained.snapshot()
    local, s3, theirs = (os.path.join(local_root, "ours"), f"{s3_root}/zstd", os.path.join(local_root, "theirs"))
    out["paths"] = [
        ours.save_fsdp_model(plugin, accelerator, trained.model, local),
        ours.save_fsdp_optimizer(plugin, accelerator, trained.optimizer, trained.model, local),
        ours.save_fsdp_model(plugin, accelerator, trained.model, s3, storage_options=storage_options,
                             compression="zstd"),
        ours.save_fsdp_optimizer(plugin, accelerator, trained.optimizer, trained.model, s3,
                                 storage_options=storage_options, compression="zstd",
                                 io_options={"max_concurrency": 2, "part_size": "5MiB", "key_prefixes": 4}),
    ]
    # io_options' key_prefixes reach the planner, which names the data files (under 4 key prefixes).
    from dcp_ext.storage import Location

    out["s3_data_files"] = sorted(name for name in Location.of(out["paths"][3], storage_options).open().list_tree()
                                  if name.endswith(".distcp"))
    # The template-free load of a checkpoint 2 FSDP2 ranks wrote, in one process
    # (each rank on its own): the full model and optimizer, parameter-name keys.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from dcp_ext.whole_state import load_whole

    full_model, full_optimizer = get_state_dict(trained.model, trained.optimizer,
                                                options=StateDictOptions(full_state_dict=True))
    out["load_whole"] = (
        state_diff(_local(full_model), load_whole(out["paths"][0])["model"])[:10]
        + state_diff(_local(full_optimizer), load_whole(out["paths"][3], storage_options=storage_options)
                     ["optimizer"])[:10])
    stock.save_fsdp_model(plugin, accelerator, trained.model, theirs)
    stock.save_fsdp_optimizer(plugin, accelerator, trained.optimizer, trained.model, theirs)
    trained.step()
    after = trained.snapshot()

    loaders = {
        "ours_local": (ours.load_fsdp_model, ours.load_fsdp_optimizer, local, {}),
        "ours_s3_zstd": (ours.load_fsdp_model, ours.load_fsdp_optimizer, s3, {"storage_options": storage_options,
                                                                          "io_options": {"max_concurrency": 2}}),
        "theirs_to_ours": (ours.load_fsdp_model, ours.load_fsdp_optimizer, theirs, {}),
        "ours_to_theirs": (stock.load_fsdp_model, stock.load_fsdp_optimizer, local, {}),
    }
    for case, (load_model, load_optimizer, path, kwargs) in loaders.items():
        fresh = Job(seed=1)
        fresh.steps = 2
        load_model(plugin, accelerator, fresh.model, path, **kwargs)
        load_optimizer(plugin, accelerator, fresh.optimizer, fresh.model, path, **kwargs)
        out[case] = state_diff(saved, fresh.snapshot())[:10]
        fresh.step()
        out[case + "_next"] = state_diff(after, fresh.snapshot())[:10]
    return out
