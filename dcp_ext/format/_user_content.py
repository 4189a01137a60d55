"""``user_content``: the user's extra state, stored without pickle.

Allowed values: ``None``, ``bool``, ``int``, ``float`` (NaN and infinities
too), ``str``, lists, tuples, dicts with string keys, and tensors (dense, any
device; stored from CPU). The tree is kept as JSON (a
:mod:`dcp_ext.format._tagged_json` tree with tensor leaves) in the metadata of a
safetensors file that holds the tensors, so loading someone else's checkpoint
never runs their code: nothing is unpickled, and the only objects created are
the ones listed above.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import CheckpointCorruptError, DcpExtError
from ._safetensors import build_header, parse_header
from ._tagged_json import LeafEncoder, UnsupportedValueError, decode_tree, encode_tree
from ._torch_bytes import tensor_bytes

__all__ = ["UnsafeUserContentError", "encode_user_content", "decode_user_content"]

_KEY = "dcp_ext.user_content"


class UnsafeUserContentError(DcpExtError, TypeError):
    """``user_content`` holds a value that cannot be stored without pickle."""


def _tensor_leaf(tensors: list[tuple[str, torch.Tensor]]) -> LeafEncoder:
    """Stores each tensor in ``tensors`` and puts ``{"__tensor__": name}`` in the tree."""

    def encode(value: Any, path: str) -> dict[str, Any] | None:
        if not isinstance(value, torch.Tensor):
            return None
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise UnsafeUserContentError(
                f"user_content{path} is a {type(value).__name__}; store a plain tensor "
                f"(e.g. .full_tensor() of a DTensor)"
            )
        name = f"t{len(tensors)}"
        tensors.append((name, value.detach().to("cpu").contiguous()))
        return {"__tensor__": name}

    return encode


def _encode(value: Any, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    try:
        return encode_tree(value, _tensor_leaf(tensors))
    except UnsupportedValueError as err:
        if err.bad_key:
            raise UnsafeUserContentError(
                f"user_content{err.path} has a non-string key {err.key!r}; use string keys"
            ) from None
        kind = type(err.value)
        raise UnsafeUserContentError(
            f"user_content{err.path} is a {kind.__module__}.{kind.__name__}, which "
            f"cannot be stored without pickle; use None, bool, int, float, str, list, "
            f"tuple, dict with string keys, or tensors"
        ) from None


def encode_user_content(value: Any) -> bytes:
    """Serialize ``value`` as a safetensors file (tensors) with a JSON tree (the rest).

    Raises:
        UnsafeUserContentError: A value outside the allowed types, naming where it is.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = _encode(value, tensors)
    header, _ = build_header(
        ((name, t.dtype, tuple(t.shape)) for name, t in tensors),
        metadata={_KEY: json.dumps(tree, separators=(",", ":"))},
    )
    return header + b"".join(bytes(tensor_bytes(t)) for _, t in tensors)


def decode_user_content(data: bytes, where: str) -> Any:
    """Rebuild the value written by :func:`encode_user_content`.

    Raises:
        CheckpointCorruptError: The file is damaged.
    """

    header = parse_header(data, where, file_size=len(data))
    try:
        tree = json.loads(header.metadata[_KEY])
        tensors = {}
        for entry in header.tensors:
            start = header.data_start + entry.begin
            raw = bytearray(data[start : header.data_start + entry.end])
            tensors[entry.name] = (
                torch.frombuffer(raw, dtype=entry.dtype).reshape(entry.shape)
                if raw
                else torch.empty(entry.shape, dtype=entry.dtype)
            )
        return decode_tree(tree, {"__tensor__": tensors.__getitem__})
    except (KeyError, ValueError, TypeError, RuntimeError, OverflowError) as err:  # RecursionError is a RuntimeError
        raise CheckpointCorruptError(f"{where} is not valid dcp_ext user content: {err}", where) from err
