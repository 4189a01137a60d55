"""Load targets shaped like a state dict."""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["zeros_like_state"]


def zeros_like_state(state: Any) -> Any:
    """A state of the same structure to load into: contiguous zero tensors of
    each tensor's shape and dtype, empty ``io.BytesIO`` objects and lists, and
    the empty value of every other type (``0``, ``""``, ``b""``)."""
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {key: zeros_like_state(value) for key, value in state.items()}
    if isinstance(state, io.BytesIO):
        return io.BytesIO()
    if isinstance(state, list):
        return []
    return type(state)()
