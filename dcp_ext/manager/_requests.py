"""What a save asks for and what a resume returns: :class:`SaveRequest`, :class:`ResumeResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

from ..errors import CheckpointNotFoundError
from ..root import RetentionPolicy
from ..storage import Store

__all__ = ["SaveRequest", "ResumeResult", "NO_MODEL", "app_state", "read_optional"]

NO_MODEL = (
    "{call} needs the model: pass model=, or call dcp_ext.register_model(model, optimizer) once on every "
    "rank after sharding it (the SageMaker library finds its DistributedModel the same way)"
)


@dataclass(frozen=True)
class SaveRequest:
    """One partial save, as every rank asked for it (checked by the manager).

    Attributes:
        tag: The checkpoint's tag.
        model: The model (plain, DDP, FSDP2 or tensor-parallel).
        optimizer: Its optimizer, or ``None``.
        user_content: The encoded ``user_content``, or ``None``.
        policy: The retention policy to apply after the commit, or ``None``.
        async_save: Return a handle once the state has been walked.
        overwrite: Replace an existing checkpoint with this tag.
        persist: With a local tier: drain this save to the root.
        rank_state: This rank's encoded ``rank_state``, or ``None``.
    """

    tag: str
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    user_content: bytes | None
    policy: RetentionPolicy | None
    async_save: bool
    overwrite: bool
    persist: bool = False
    rank_state: bytes | None = None


@dataclass(frozen=True)
class ResumeResult:
    """What :meth:`CheckpointManager.resume` loaded.

    Attributes:
        tag: The checkpoint's tag.
        user_content: The ``user_content`` saved with it (``None`` if none).
        partial: Whether it came from a partial checkpoint.
        rank_state: This rank's ``rank_state`` (``None`` if none was saved),
            redistributed by ``rank_state_rule`` at another world size.
    """

    tag: str
    user_content: Any
    partial: bool
    rank_state: Any = None


def app_state(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` state dicts as DCP saves and loads them."""
    if model is None:
        raise ValueError("a model is needed to name the optimizer's state")
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def read_optional(store: Store, name: str) -> bytes | None:
    """The bytes of ``name`` in ``store``, ``None`` if it does not exist."""
    try:
        return store.read_file(name)
    except CheckpointNotFoundError:
        return None
