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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import CheckpointCorruptError
from ._stored_json import parse_stored_json

__all__ = [
    "TensorEntry",
    "SafetensorsHeader",
    "build_header",
    "parse_header",
    "header_prefix",
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
# Dimensions, offsets and sizes are 64-bit where they are used.
_INT_LIMIT = 1 << 63


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


def header_prefix(read_head: Callable[[int], bytes], file_size: Callable[[], int], first: int = 64 * 1024) -> bytes:
    """The first bytes of a file that :func:`parse_header` needs: one read of
    ``first`` bytes, and a second of the whole header only when it is longer
    and the file really holds it (a 3 KB file claiming a 100 MB header must
    not make a reader allocate 100 MB: issue 32, finding 6).

    Args:
        read_head: Reads up to ``n`` bytes from the start of the file.
        file_size: The file's size (asked only for a header over ``first`` bytes).
        first: Bytes of the first read.
    """
    head = read_head(first)
    if len(head) == first >= 8:
        (length,) = struct.unpack("<Q", head[:8])
        if first < 8 + length and length <= MAX_HEADER and 8 + length <= file_size():
            head = read_head(8 + length)
    return head


def parse_header(prefix: bytes, where: str, file_size: int | None = None) -> SafetensorsHeader:
    """Parse a safetensors header from the file's first bytes.

    Every field is checked as the format defines it (the ``safetensors``
    package refuses the same files): ``__metadata__`` maps strings to
    strings; each tensor has a known dtype, a shape of non-negative integers
    and ``data_offsets`` of two integers whose range holds exactly its
    bytes; no two tensors' ranges overlap (a bias must never be read from a
    weight's bytes). A float is not an integer: ``4.9`` is refused, not cut
    to ``4`` (issue 32, finding 11).

    Args:
        prefix: At least the first ``8 + header length`` bytes of the file.
        where: The file, for messages.
        file_size: If known, offsets are checked against it.

    Raises:
        CheckpointCorruptError: Not a valid safetensors header; the message
            names the file and the tensor or field at fault.
    """
    if len(prefix) < 8:
        raise CheckpointCorruptError(f"{where} is too short to be a safetensors file", where)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER or 8 + length > len(prefix):
        raise CheckpointCorruptError(
            f"{where}: safetensors header claims {length} bytes (have {len(prefix) - 8})", where
        )
    doc = parse_stored_json(prefix[8 : 8 + length], where, "safetensors header")
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(f"{where}: its safetensors header is not a JSON object", where)
    metadata = _metadata(doc.pop("__metadata__", None), where)
    entries = [_entry(str(name), spec, where) for name, spec in doc.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    previous: TensorEntry | None = None
    for entry in entries:
        if previous is not None and entry.begin < previous.end:
            raise CheckpointCorruptError(
                f"{where}: tensors {previous.name!r} (bytes [{previous.begin}, {previous.end})) and "
                f"{entry.name!r} (bytes [{entry.begin}, {entry.end})) overlap in the data section; the file is damaged",
                where,
            )
        if entry.end > entry.begin:
            previous = entry
        if file_size is not None and 8 + length + entry.end > file_size:
            raise CheckpointCorruptError(f"{where}: tensor {entry.name!r} lies beyond the end of the file", where)
    return SafetensorsHeader(8 + length, tuple(entries), metadata)


def _metadata(value: object, where: str) -> dict[str, str]:
    """The header's ``__metadata__``: absent, or an object of strings."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CheckpointCorruptError(
            f"{where}: the safetensors header's __metadata__ must map strings to strings", where
        )
    return {str(k): v for k, v in value.items()}


def _entry(name: str, spec: object, where: str) -> TensorEntry:
    """One tensor's header entry, checked."""
    what = f"{where}: tensor {name!r}"
    if not isinstance(spec, dict):
        raise CheckpointCorruptError(f"{what} has a malformed header entry (not an object)", where)
    code = spec.get("dtype")
    dtype = _FROM_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CheckpointCorruptError(f"{what} has unsupported dtype {_short(code)}", where)
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
        raise CheckpointCorruptError(f"{what}: shape {_short(shape)} is not a list of non-negative integers", where)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets):
        raise CheckpointCorruptError(f"{what}: data_offsets {_short(offsets)} are not two non-negative integers",
                                     where)
    begin, end = offsets
    numel = 1
    for s in shape:
        numel *= s
    if end < begin or end - begin != numel * dtype.itemsize:
        raise CheckpointCorruptError(
            f"{what}: byte range [{begin}, {end}) does not fit {code} {_short(shape)}", where
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _INT_LIMIT


def _short(value: object) -> str:
    """``repr(value)``, cut to a length a message can hold."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
