"""The model (and optimizer) the SageMaker-style functions use when none is passed.

The SageMaker model-parallel library finds the model it wrapped
(``smp.DistributedModel``) by itself, so its fine-tuning scripts call
``smp.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)``
with no model. dcp_ext wraps nothing; instead the script names its model once,
after sharding it::

    model = ...                      # FSDP2 / tensor parallel, maybe on the meta device
    optimizer = ...
    dcp_ext.register_model(model, optimizer)
    dcp_ext.resume_from_checkpoint(model_dir, tag="fullmodel.pt", partial=False)

:func:`~dcp_ext.save_checkpoint`, :func:`~dcp_ext.resume_from_checkpoint` and
:class:`~dcp_ext.CheckpointManager`'s ``save``/``resume`` then use the
registered model when their ``model`` is omitted (and its optimizer when
``optimizer`` is omitted too). One model per process; the registration holds
references until it is replaced or cleared with ``register_model(None)``.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

__all__ = ["register_model", "registered_model", "with_registered"]

_lock = threading.Lock()
_registered: tuple[nn.Module | None, torch.optim.Optimizer | None] = (None, None)


def register_model(model: nn.Module | None, optimizer: torch.optim.Optimizer | None = None) -> None:
    """(each rank) Make ``model`` (and ``optimizer``) the default of the checkpoint calls.

    Call it on every rank after the model is wrapped/sharded as it will be
    trained. A later call replaces the registration; ``register_model(None)``
    clears it.

    Args:
        model: The model the checkpoint calls save and load when they are
            given none, or ``None`` to clear the registration.
        optimizer: Its optimizer, saved and loaded with it.

    Raises:
        ValueError: An optimizer without a model.
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """
    global _registered
    if model is None and optimizer is not None:
        raise ValueError("register_model: an optimizer needs its model")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"register_model needs a torch.nn.Module, got {type(model).__name__}")
    with _lock:
        _registered = (model, optimizer)


def registered_model() -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
    """The registered ``(model, optimizer)``; ``(None, None)`` if none."""
    with _lock:
        return _registered


def with_registered(
    model: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> tuple[nn.Module | None, torch.optim.Optimizer | None]:
    """``(model, optimizer)`` as passed, or with the registered ones when ``model`` is ``None``
    (the registered optimizer only when ``optimizer`` is ``None`` too)."""
    if model is not None:
        return model, optimizer
    registered, registered_optimizer = registered_model()
    return registered, optimizer if optimizer is not None else registered_optimizer
