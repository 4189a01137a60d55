"""``user_content``: the user's extra state, stored without pickle.

Allowed values: ``None``, ``bool``, ``int``, ``float`` (NaN and infinities
too), ``str``, lists, tuples, dicts with string keys, and tensors (dense, any
device; stored from CPU). The tree is kept as JSON in the metadata of a
safetensors file that holds the tensors, so loading someone else's checkpoint
never runs their code: nothing is unpickled, and the only objects created are
the ones listed above.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ._safetensors import build_header, parse_header
from ._torch_format import tensor_bytes
from .errors import DcpExtError

__all__ = ["UnsafeUserContentError", "encode_user_content", "decode_user_content"]

_KEY = "dcp_ext.user_content"


class UnsafeUserContentError(DcpExtError, TypeError):
    """``user_content`` holds a value that cannot be stored without pickle."""


def _encode(value: Any, path: str, tensors: list[tuple[str, torch.Tensor]]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise UnsafeUserContentError(
                f"user_content{path} is a {type(value).__name__}; store a plain tensor "
                f"(e.g. .full_tensor() of a DTensor)"
            )
        name = f"t{len(tensors)}"
        tensors.append((name, value.detach().to("cpu").contiguous()))
        return {"__tensor__": name}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise UnsafeUserContentError(
                f"user_content{path} has a non-string key {bad[0]!r}; use string keys"
            )
        return {"__dict__": {k: _encode(v, f"{path}[{k!r}]", tensors) for k, v in value.items()}}
    raise UnsafeUserContentError(
        f"user_content{path} is a {type(value).__module__}.{type(value).__name__}, which "
        f"cannot be stored without pickle; use None, bool, int, float, str, list, "
        f"tuple, dict with string keys, or tensors"
    )


def encode_user_content(value: Any) -> bytes:
    """Serialize ``value`` as a safetensors file (tensors) with a JSON tree (the rest).

    Raises:
        UnsafeUserContentError: A value outside the allowed types, naming where it is.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    tree = _encode(value, "", tensors)
    header, _ = build_header(
        ((name, t.dtype, tuple(t.shape)) for name, t in tensors),
        metadata={_KEY: json.dumps(tree, separators=(",", ":"))},
    )
    return header + b"".join(bytes(tensor_bytes(t)) for _, t in tensors)


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if "__tensor__" in node:
            return tensors[node["__tensor__"]]
        if "__tuple__" in node:
            return tuple(_decode(v, tensors) for v in node["__tuple__"])
        if "__dict__" in node:
            return {k: _decode(v, tensors) for k, v in node["__dict__"].items()}
        if "__float__" in node:
            return float(node["__float__"])
        raise ValueError(f"unknown node {sorted(node)}")
    return node


def decode_user_content(data: bytes, where: str) -> Any:
    """Rebuild the value written by :func:`encode_user_content`.

    Raises:
        CheckpointCorruptError: The file is damaged.
    """
    from .errors import CheckpointCorruptError

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
        return _decode(tree, tensors)
    except (KeyError, ValueError, TypeError, RuntimeError) as err:
        raise CheckpointCorruptError(f"{where} is not valid dcp_ext user content: {err}", where) from err
