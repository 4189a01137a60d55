"""Byte-level framing of tensors in data files, compatible with torch's readers.

Torch's ``FileSystemReader`` and ``FsspecReader`` read every stored tensor with
``torch.load`` on its byte range, so each tensor must be stored as a complete
``torch.save`` archive. dcp_ext writes exactly that, but builds the archive
around the tensor's memory instead of serializing it: the archive's header
(``prefix``) and trailer (``suffix``) come from ``torch.save`` run under
``torch.serialization.skip_data`` on an unallocated tensor of the same dtype
and shape, so the raw row-major bytes sit at a known offset in the middle.
Writers stream them straight from tensor memory; dcp_ext's reader fetches
only the raw bytes a load needs, at ``item offset + len(prefix)``.

The envelope depends only on (dtype, shape), so it is cached.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch
from torch.serialization import skip_data

__all__ = ["Envelope", "torch_save_envelope", "tensor_bytes", "DTYPES", "dtype_from_name", "dtype_name"]


@dataclass(frozen=True)
class Envelope:
    """``prefix + raw tensor bytes + suffix`` is a valid ``torch.save`` archive."""

    prefix: bytes
    suffix: bytes


class HoleRecorder:
    """A write-only file that records bytes around the one skipped data region."""

    def __init__(self) -> None:
        self.segments: list[bytearray] = [bytearray()]
        self.position = 0
        self.holes = 0
        self.hole_sizes: list[int] = []

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.segments[-1] += view
        self.position += view.nbytes
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR:
            raise OSError("envelope recorder only skips forward")
        self.position += offset
        self.holes += 1
        self.hole_sizes.append(offset)
        self.segments.append(bytearray())
        return self.position

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass


@functools.lru_cache(maxsize=8192)
def torch_save_envelope(dtype: torch.dtype, shape: tuple[int, ...]) -> Envelope:
    """The ``torch.save`` archive of a contiguous CPU tensor, minus its data.

    Args:
        dtype: Tensor dtype.
        shape: Tensor shape.

    Returns:
        The archive bytes before and after the tensor's raw data.
    """
    # torch.empty does not touch its pages, so even a huge shape costs no RSS.
    template = torch.empty(shape, dtype=dtype)
    recorder = HoleRecorder()
    with skip_data():
        torch.save(template, recorder)  # type: ignore[arg-type]
    if template.numel() == 0:
        return Envelope(bytes(recorder.segments[0]), b"")
    if recorder.holes != 1 or len(recorder.segments) != 2:
        raise RuntimeError(
            f"unexpected torch.save layout for {dtype} {shape}: {recorder.holes} data regions"
        )
    return Envelope(bytes(recorder.segments[0]), bytes(recorder.segments[1]))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy, writable byte view of a contiguous CPU tensor's data.

    The view is valid only while ``tensor`` is alive.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buffer = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B")


# The dtypes dcp_ext stores, by their names in metadata ("bfloat16", ...).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint8",
        "uint16", "uint32", "uint64",
        "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise TypeError(f"dtype {dtype} cannot be stored by dcp_ext")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; unknown names raise ``ValueError``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata") from None
