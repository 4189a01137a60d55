"""Bit-exact comparison of state dicts: nested dicts, lists and tuples of
tensors and plain values.

Tensors are equal when dtype, shape and every element match
(``torch.equal``); ``io.BytesIO`` values by their contents; anything else by
``==``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["state_diff", "same_state", "assert_same_state"]


def state_diff(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where ``actual`` differs from ``expected``: one line per differing path."""
    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            return [f"{path}: a mapping was expected, got {type(actual).__name__}"]
        if set(expected) != set(actual):
            return [f"{path}: keys differ: missing {sorted(map(str, set(expected) - set(actual)))}, "
                    f"unexpected {sorted(map(str, set(actual) - set(expected)))}"]
        return [d for key in expected for d in state_diff(expected[key], actual[key], f"{path}/{key}")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{path}: {expected!r} != {actual!r}"]
        return [d for i, (a, b) in enumerate(zip(expected, actual)) for d in state_diff(a, b, f"{path}/{i}")]
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{path}: a tensor was expected, got {type(actual).__name__}"]
        if (actual.dtype, actual.shape) != (expected.dtype, expected.shape):
            return [f"{path}: {actual.dtype} {tuple(actual.shape)} != expected {expected.dtype} {tuple(expected.shape)}"]
        return [] if torch.equal(actual, expected) else [f"{path}: tensor values differ"]
    if isinstance(expected, io.BytesIO):
        same = isinstance(actual, io.BytesIO) and actual.getvalue() == expected.getvalue()
        return [] if same else [f"{path}: BytesIO contents differ"]
    return [] if expected == actual else [f"{path}: {actual!r} != expected {expected!r}"]


def same_state(expected: Any, actual: Any) -> bool:
    """Whether the two states are bit-exact copies (see :func:`state_diff`)."""
    return not state_diff(expected, actual)


def assert_same_state(expected: Any, actual: Any, what: str = "") -> None:
    """Fail, naming every differing path, unless ``actual`` is bit-exact ``expected``."""
    diffs = state_diff(expected, actual)
    assert not diffs, f"{what}: {len(diffs)} difference(s):\n" + "\n".join(diffs[:20])
