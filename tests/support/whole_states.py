"""States for the template-free load and ``use_for_dcp`` tests: a model and
its Adam optimizer after real steps (``optimizer.state_dict()``: integer
parameter keys), plus non-tensor values of several kinds."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["trained", "training_state", "NotPlainData"]


@dataclasses.dataclass
class NotPlainData:
    """A value ``torch.load(weights_only=True)`` refuses (a class it does not know)."""

    name: str


def trained(steps: int = 2, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP and its Adam optimizer after ``steps`` steps."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 16, generator=g)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def training_state(seed: int = 0) -> dict[str, Any]:
    """``{"model", "optimizer" (integer keys), "epoch", "meta", "history"}``."""
    model, optimizer = trained(seed=seed)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 7,
        "meta": {"name": "run-1", "lrs": [0.1, 0.01], "shape": (3, 4), "ok": True, "none": None},
        "history": [torch.arange(6.0), {"loss": 0.25}],
    }
