"""Tagged JSON trees: Python values plain JSON would change, stored exactly.

Plain JSON has no tuples, no NaN or infinities, and no way to tell a dict from
a tag. A tagged tree stores:

* ``None``, ``bool``, ``int``, ``str`` and finite ``float`` as themselves;
* a non-finite ``float`` as ``{"__float__": "nan"}`` (its ``repr``);
* a ``tuple`` as ``{"__tuple__": [...]}``, a ``list`` as ``[...]``;
* a ``dict`` with string keys as ``{"__dict__": {...}}``;
* leaves a caller adds with a hook (user content's tensors are
  ``{"__tensor__": "t0"}``).

Used for DCP's ``planner_data`` in :mod:`dcp_ext.metadata` (no extra leaves)
and for :mod:`dcp_ext.format._user_content` (tensor leaves). Decoding creates only the
types above and whatever the caller's leaf decoders return.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["UnsupportedValueError", "LeafEncoder", "encode_tree", "decode_tree"]

#: Encodes one leaf of a caller's own type: ``(value, path) -> tagged node``,
#: or ``None`` when ``value`` is not of that type.
LeafEncoder = Callable[[Any, str], dict[str, Any] | None]

_NO_KEY = object()


class UnsupportedValueError(TypeError):
    """A value a tagged tree cannot hold.

    Callers catch it and raise their own error type and message.

    Attributes:
        path: Where the value is, as subscripts from the root (``[0]['a']``;
            ``""`` for the root itself).
        value: The value (for a bad key: the dict holding it).
        key: The first non-string key of ``value``, if that is the problem.
    """

    def __init__(self, path: str, value: Any, key: Any = _NO_KEY) -> None:
        super().__init__(f"{path or 'the root'}: cannot store a {type(value).__name__}")
        self.path = path
        self.value = value
        self.key = key

    @property
    def bad_key(self) -> bool:
        """``True`` if a dict key, not the value itself, is the problem."""
        return self.key is not _NO_KEY


def encode_tree(value: Any, leaf: LeafEncoder | None = None, path: str = "") -> Any:
    """The JSON-ready tagged tree of ``value``.

    Args:
        value: The value to encode.
        leaf: Encodes the caller's extra leaf types; tried on every value that
            is not ``None``, a ``bool``, ``int``, ``str`` or ``float``.
        path: Where ``value`` is, for errors (``""`` at the root).

    Raises:
        UnsupportedValueError: A value of another type, or a non-string dict key.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if leaf is not None:
        node = leaf(value, path)
        if node is not None:
            return node
    if isinstance(value, tuple):
        return {"__tuple__": [encode_tree(v, leaf, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_tree(v, leaf, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise UnsupportedValueError(path, value, bad[0])
        return {"__dict__": {k: encode_tree(v, leaf, f"{path}[{k!r}]") for k, v in value.items()}}
    raise UnsupportedValueError(path, value)


def decode_tree(node: Any, leaves: Mapping[str, Callable[[Any], Any]] | None = None) -> Any:
    """Rebuild the value :func:`encode_tree` encoded as ``node``.

    Args:
        node: A parsed tagged tree.
        leaves: The caller's leaf tags and how to decode each from the tag's
            value (``{"__tensor__": tensors.__getitem__}``); checked first.

    Raises:
        ValueError: A dict with no known tag.
        KeyError, TypeError, AttributeError: A malformed tree (or what a leaf
            decoder raises).
    """
    if isinstance(node, list):
        return [decode_tree(v, leaves) for v in node]
    if isinstance(node, dict):
        for tag, decode_leaf in (leaves or {}).items():
            if tag in node:
                return decode_leaf(node[tag])
        if "__tuple__" in node:
            return tuple(decode_tree(v, leaves) for v in node["__tuple__"])
        if "__dict__" in node:
            return {k: decode_tree(v, leaves) for k, v in node["__dict__"].items()}
        if "__float__" in node:
            return float(node["__float__"])
        raise ValueError(f"unknown tagged value {sorted(node)}")
    return node
