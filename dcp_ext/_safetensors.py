"""The safetensors file format, read and written without the safetensors package.

A file is an 8-byte little-endian header length, a JSON header (padded with
spaces to a multiple of 8 bytes) mapping each tensor name to its dtype, shape
and ``[begin, end)`` byte range in the data section, then the data: raw
row-major little-endian bytes, tensors back to back in header order.

Because every tensor's size follows from its dtype and shape, the header can
be written before any data, so files are streamed tensor by tensor without
holding the model in memory; and a reader can fetch any tensor's bytes (or a
slice of them) with ranged reads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .errors import CheckpointCorruptError

__all__ = [
    "TensorEntry",
    "SafetensorsHeader",
    "build_header",
    "parse_header",
    "SAFETENSORS_DTYPES",
    "MAX_HEADER",
]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code
_FROM_CODE = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}

#: Refuse headers larger than this (a hostile length must not allocate GBs).
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file.

    Attributes:
        name: Its key.
        dtype: Its dtype.
        shape: Its shape.
        begin: First byte, relative to the data section.
        end: One past its last byte, relative to the data section.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: where the data section starts and what it holds."""

    data_start: int
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


def build_header(
    tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
    metadata: dict[str, str] | None = None,
) -> tuple[bytes, list[TensorEntry]]:
    """Build the header bytes (length prefix included) for tensors in this order.

    Raises:
        TypeError: A dtype safetensors cannot represent.
        ValueError: A duplicate name.
    """
    entries: list[TensorEntry] = []
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in tensors:
        if name in doc or name == "__metadata__":
            raise ValueError(f"duplicate tensor name {name!r}")
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot be stored in safetensors")
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * dtype.itemsize
        doc[name] = {"dtype": code, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + nbytes]}
        entries.append(TensorEntry(name, dtype, tuple(int(s) for s in shape), offset, offset + nbytes))
        offset += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(len(body)) % 8)
    return struct.pack("<Q", len(body)) + body, entries


def parse_header(prefix: bytes, where: str, file_size: int | None = None) -> SafetensorsHeader:
    """Parse a safetensors header from the file's first bytes.

    Args:
        prefix: At least the first ``8 + header length`` bytes of the file.
        where: The file, for messages.
        file_size: If known, offsets are checked against it.

    Raises:
        CheckpointCorruptError: Not a valid safetensors header.
    """
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{where} is too short to be a safetensors file", where)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER or 8 + length > len(prefix):
        raise CheckpointCorruptError(
            f"{where}: safetensors header claims {length} bytes (have {len(prefix) - 8})", where
        )
    try:
        doc = json.loads(prefix[8 : 8 + length])
        if not isinstance(doc, dict):
            raise ValueError("header is not a JSON object")
        metadata = {str(k): str(v) for k, v in (doc.pop("__metadata__", None) or {}).items()}
        entries = []
        for name, spec in doc.items():
            dtype = _FROM_CODE.get(spec["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has unsupported dtype {spec['dtype']!r}")
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
            numel = 1
            for s in shape:
                if s < 0:
                    raise ValueError(f"tensor {name!r} has a negative dimension")
                numel *= s
            if begin < 0 or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name!r}: byte range [{begin}, {end}) does not fit {spec['dtype']} {list(shape)}")
            if file_size is not None and 8 + length + end > file_size:
                raise ValueError(f"tensor {name!r} lies beyond the end of the file")
            entries.append(TensorEntry(str(name), dtype, shape, begin, end))
    except CheckpointCorruptError:
        raise
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointCorruptError(f"{where} has an invalid safetensors header: {err}", where) from err
    entries.sort(key=lambda e: e.begin)
    return SafetensorsHeader(8 + length, tuple(entries), metadata)
