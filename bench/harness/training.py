"""The FSDP2 training job that ``bench.blocking`` and ``bench.tiers`` checkpoint (runs on each rank).

A stack of square Linear layers with ReLUs, each layer a ``fully_shard``
unit and then the root, over ``init_device_mesh("cpu", (world_size,))``;
Adam; a fixed batch of :data:`BATCH` rows. Sized by :func:`layer_width` so
that the fp32 parameters and Adam's two moments come to a given state size.
"""

from __future__ import annotations

import math
from typing import Any

BATCH = 4
FP32 = 4


def layer_width(state_bytes: int, layers: int) -> int:
    """Width of ``layers`` square Linear layers (with bias) whose fp32 parameters
    plus two Adam moments come closest to ``state_bytes``; a multiple of 64."""
    params_per_layer = state_bytes / (3 * FP32) / layers
    width = math.sqrt(params_per_layer + 0.25) - 0.5  # width^2 + width = params_per_layer
    return max(64, round(width / 64) * 64)


def build_training(rank: int, world_size: int, width: int, layers: int) -> tuple[Any, Any, Any]:
    """The FSDP2 model (every Linear a ``fully_shard`` unit, then the root), its
    Adam optimizer and the fixed input batch."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local()
            if local.dim() > 1:
                local.normal_(0.0, width ** -0.5, generator=gen)
            else:
                local.zero_()
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, optim, torch.randn(BATCH, width, generator=gen)


def forward_backward(model: Any, batch: Any) -> None:
    """The part of a training step that leaves the checkpointed state alone."""
    model(batch).square().mean().backward()


def optimizer_step(optim: Any) -> None:
    """The part of a training step that changes the state."""
    optim.step()
    optim.zero_grad()
