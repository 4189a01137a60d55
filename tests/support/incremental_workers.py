"""Multi-rank incremental saves (tests/test_incremental.py): FSDP2 fine-tuning
with a frozen base, saved with ``CheckpointManager(incremental=True)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dcp_ext

#: Frames small enough that the test model spans several per tensor.
FRAME = 16 * 1024
EMBED_ROWS, WIDTH = 2048, 64
STEPS = 5
#: The step at which rows of the frozen embedding change (a partial change inside one tensor).
EMBED_STEP = 3


def make_model(seed: int) -> nn.Sequential:
    """A frozen base (embedding + linear) with a trainable adapter and head."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(EMBED_ROWS, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 8)
    )
    for param in (*model[0].parameters(), *model[1].parameters()):
        param.requires_grad_(False)
    return model


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _local(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _local(value)
        elif isinstance(value, torch.Tensor):
            out[key] = (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        else:
            out[key] = value
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _diff(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    from tests.support.compare import state_diff

    return state_diff(expected, actual)


def world(rank: int, world_size: int, roots: dict[str, str]) -> dict[str, Any]:
    """(each rank) Save ``STEPS`` incremental checkpoints to ``roots["all"]``
    (no retention) and ``roots["keep2"]`` (keep 2), training the adapter and
    head between saves and changing rows of the frozen embedding once; then
    load every tag of ``all`` into a fresh sharded model, bit-exact.

    Returns (rank 0 also returns the full tensors of each step)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = make_model(seed)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(_trainable(model), lr=1e-2)

    model, optim = build(0)
    config = dcp_ext.IOConfig(frame_size=FRAME)
    every = dcp_ext.CheckpointManager(roots["all"], config=config, incremental=True, max_chain=8)
    kept = dcp_ext.CheckpointManager(roots["keep2"], config=config, incremental=True, max_chain=8,
                                     retention=dcp_ext.root.KeepLast(2))
    expected: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    full: dict[str, dict[str, torch.Tensor]] = {}
    torch.manual_seed(100 + rank)
    for step in range(STEPS):
        if step:
            tokens = torch.randint(0, EMBED_ROWS, (16,))
            loss = model(tokens).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
        if step == EMBED_STEP and rank == 0:
            with torch.no_grad():
                model[0].weight.to_local()[100:104].add_(1.0)  # 4 rows of rank 0's shard: one 16 KiB frame
        tag = f"s{step}"
        every.save(tag, model, optim, user_content={"step": step})
        kept.save(tag, model, optim, user_content={"step": step})
        expected[tag] = (_local(model.state_dict()), _local(optim.state_dict()))
        full[tag] = _full(model)

    diffs: dict[str, list[str]] = {}
    for tag, (model_state, optim_state) in expected.items():
        fresh, fresh_optim = build(1000)
        # Adam's state exists only after a step: one step on a fresh model makes it, then the load overwrites it.
        fresh(torch.zeros(2, dtype=torch.long)).sum().backward()
        fresh_optim.step()
        fresh_optim.zero_grad()
        result = every.resume(fresh, fresh_optim, tag=tag)
        found = _diff(model_state, _local(fresh.state_dict())) + _diff(optim_state, _local(fresh_optim.state_dict()))
        if result.user_content != {"step": int(tag[1:])}:
            found.append(f"user_content {result.user_content!r}")
        diffs[tag] = found
    every.close()
    kept.close()
    dist.barrier()
    return {"diffs": diffs, "full": full if rank == 0 else None}
