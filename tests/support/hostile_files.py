"""Hostile files for tests: what a damaged disk, a buggy tool or an attacker
could leave where dcp_ext reads (issue 32, findings 6, 7, 11).

Each builder writes real files with the formats' own rules bent in one
place; the tests then check that dcp_ext refuses them with a typed error and
without allocating what they claim.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import zstandard

__all__ = [
    "peak_python_memory",
    "safetensors_bytes",
    "zstd_zeros",
    "torch_save_claiming",
    "MiB",
]

MiB = 1 << 20


@contextmanager
def peak_python_memory() -> Iterator[list[int]]:
    """Measure the peak of memory allocated through Python's allocators (bytes,
    bytearrays, numpy arrays, zstandard's output) inside the block: the
    one-element list holds it afterwards."""
    peak = [0]
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def safetensors_bytes(header: bytes | dict[str, Any], data: bytes = b"") -> bytes:
    """A safetensors file: the 8-byte length, ``header`` (raw JSON bytes, or a
    dict dumped as is, non-finite floats included) padded to 8 bytes, ``data``."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def zstd_zeros(size: int, content_size: bool) -> bytes:
    """A zstd frame of ``size`` zero bytes (about ``size / 32768`` bytes long),
    compressed in 16 MiB steps so the test never holds ``size`` bytes; the
    frame header declares ``size`` when ``content_size``."""
    out = io.BytesIO()
    chunk = bytes(16 * MiB)
    compressor = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    with compressor.stream_writer(out, size=size if content_size else -1, closefd=False) as writer:
        left = size
        while left:
            n = min(left, len(chunk))
            writer.write(chunk[:n])
            left -= n
    return out.getvalue()


def torch_save_claiming(path: Path, claimed: int) -> bytes:
    """``torch.save`` of a small Linear's state dict at ``path``, with its zip
    directory's entry for ``data.pkl`` claiming ``claimed`` bytes (compressed
    and uncompressed sizes both); returns the original bytes."""
    torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    original = path.read_bytes()
    data = bytearray(original)
    at = data.rfind(b"PK\x05\x06")
    _, cd_size, cd_offset = struct.unpack("<HII", data[at + 10 : at + 20])
    pos = cd_offset
    while pos < cd_offset + cd_size:
        n, e, c = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        if bytes(data[pos + 46 : pos + 46 + n]).endswith(b"/data.pkl"):
            data[pos + 20 : pos + 28] = struct.pack("<II", claimed, claimed)
            break
        pos += 46 + n + e + c
    else:  # pragma: no cover - torch.save always writes data.pkl
        raise AssertionError("no data.pkl in the zip directory")
    path.write_bytes(bytes(data))
    return original
