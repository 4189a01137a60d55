"""Codecs: how a stored chunk's bytes are transformed, one frame at a time.

A codec turns the raw bytes of one *frame* (a slice of a stored chunk, by
default 1 MiB of input) into stored bytes and back. Frames are independent,
so a reader that needs a byte range decodes only the frames covering it.

Each stored item records the chain of transforms that produced it as a tuple
of versioned descriptors, applied left to right when writing and right to left
when reading, for example ``("bytegroup.2/1", "zstd.planes.2/1")`` for bf16. The
reader rebuilds the chain from these descriptors alone (no configuration), so
one checkpoint can mix codecs, and an unknown descriptor is a clear error.

Transforms:

* ``zstd/1``: one zstd frame per input frame (level chosen by the writer; the
  reader does not need it).
* ``bytegroup.K/1`` (K = 2, 4, 8): the K bytes of each element are regrouped
  into K planes (all first bytes, then all second bytes, ...). The exponent
  bytes of floating-point data are highly repetitive while the low mantissa
  bytes are close to random; grouping them lets zstd compress the former and
  store the latter raw (the idea of ZipNN, https://arxiv.org/abs/2411.05239).
  Used for float16, bfloat16, float32 and float64 only.
* ``zstd.planes.K/1``: the input is K equal planes, each compressed as its own
  zstd frame, or stored raw when zstd would not make it smaller. The frame
  starts with K little-endian uint32 plane lengths (bit 31 set: stored raw).
  On MiniLM-L6's bf16 weights the low plane does not compress at all (ratio
  1.000) and the exponent plane does 2.93x, so storing the low plane raw costs
  nothing and compresses better than one zstd stream over both planes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import UnsupportedCodecError

__all__ = [
    "Codec",
    "ZstdCodec",
    "encode_frame",
    "decode_frame",
    "check_descriptors",
    "GROUPED_DTYPES",
]

# Element sizes byte grouping applies to: floating-point data only (integer
# and byte data gain little and stay as they are).
GROUPED_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
_GROUP_SIZES = (2, 4, 8)
_ZSTD = "zstd/1"


@runtime_checkable
class Codec(Protocol):
    """What a writer's ``compression=`` accepts besides ``None`` and ``"zstd"``.

    Attributes:
        name: Short name for messages and ``dcp-ext inspect``.
    """

    name: str

    def transforms(self, dtype: torch.dtype | None) -> tuple[str, ...]:
        """The transform descriptors for a chunk of ``dtype`` (``None``: bytes)."""
        ...

    def encode(self, transforms: tuple[str, ...], frame: memoryview) -> bytes:
        """Encode one frame of raw bytes with ``transforms``."""
        ...


@dataclass(frozen=True)
class ZstdCodec:
    """zstd, with byte grouping for floating-point tensors.

    Attributes:
        level: zstd level. At 1 (default) byte planes use parameters tuned
            for entropy coding (see ``_plane_compressor``), the fastest and, on
            model weights, best setting: the gain comes from entropy coding the
            exponent bytes, not from matches (levels 3-12 gave 1.41-1.44x on
            MiniLM-L6 bf16, less than level 1's 1.46x). Higher levels apply to
            planes and plain zstd alike.
        byte_grouping: Regroup the bytes of floating-point elements before
            zstd (see the module docstring). Off: plain zstd per frame.
    """

    level: int = 1
    byte_grouping: bool = True
    name: str = "zstd"
    """The codec's name for messages and ``dcp-ext inspect``."""

    def __post_init__(self) -> None:
        """Check the level.

        Raises:
            ValueError: ``level`` is not an integer from -7 to 22.
        """
        if not isinstance(self.level, int) or not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be an integer in [-7, 22], got {self.level!r}")

    def transforms(self, dtype: torch.dtype | None) -> tuple[str, ...]:
        """The transform descriptors for a chunk of ``dtype`` (``None``: bytes): byte grouping
        then zstd per byte plane for floating-point dtypes when ``byte_grouping`` is on, else
        plain zstd."""
        if self.byte_grouping and dtype in GROUPED_DTYPES:
            assert dtype is not None
            size = dtype.itemsize
            return (f"bytegroup.{size}/1", f"zstd.planes.{size}/1")
        return (_ZSTD,)

    def encode(self, transforms: tuple[str, ...], frame: memoryview) -> bytes:
        """Encode one frame of raw bytes with ``transforms`` at this codec's ``level``."""
        return encode_frame(transforms, frame, self.level)


# -- the transforms -----------------------------------------------------------------
def zstd_module() -> Any:
    """The ``zstandard`` module (a clear error without it)."""
    try:
        import zstandard
    except ImportError as err:  # pragma: no cover - zstandard is a dependency
        raise UnsupportedCodecError(
            "zstd compression needs the 'zstandard' package: pip install zstandard"
        ) from err
    return zstandard


# zstd contexts are not thread-safe; each thread keeps its own.
_local = threading.local()


def _compressor(level: int) -> Any:
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    ctx = cache.get(level)
    if ctx is None:
        ctx = cache[level] = zstd_module().ZstdCompressor(level=level, write_content_size=True)
    return ctx


def _plane_compressor(level: int) -> Any:
    """The compressor for byte planes. At level 1 and below: zstd's fast
    strategy with a 64-entry hash table and 7-byte minimum matches, which
    finds almost no matches and leaves the work to entropy coding, which is
    where the gain on exponent bytes is. Measured on MiniLM-L6 bf16 exponent
    planes: 2.93x at 1.14 GB/s per core, against 2.68x at 0.38 GB/s for
    level 1 (decompression 1.32 vs 1.11 GB/s)."""
    if level > 1:
        return _compressor(level)
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    ctx = cache.get("planes")
    if ctx is None:
        zstd = zstd_module()
        params = zstd.ZstdCompressionParameters(
            window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
            target_length=0, strategy=zstd.STRATEGY_FAST, write_content_size=True,
        )
        ctx = cache["planes"] = zstd.ZstdCompressor(compression_params=params)
    return ctx


def _decompressor() -> Any:
    ctx = getattr(_local, "decompressor", None)
    if ctx is None:
        ctx = _local.decompressor = zstd_module().ZstdDecompressor()
    return ctx


def _sized(descriptor: str, prefix: str) -> int:
    """K of ``{prefix}K/1`` descriptors (0 if ``descriptor`` is not one)."""
    name, _, version = descriptor.partition("/")
    if name.startswith(prefix) and version == "1":
        size = name.removeprefix(prefix)
        if size.isdigit() and int(size) in _GROUP_SIZES:
            return int(size)
    return 0


def _group_size(descriptor: str) -> int:
    return _sized(descriptor, "bytegroup.")


def _planes_size(descriptor: str) -> int:
    return _sized(descriptor, "zstd.planes.")


def check_descriptors(transforms: Sequence[str], where: str) -> tuple[str, ...]:
    """Validate a stored item's transform chain before any byte is read.

    Raises:
        UnsupportedCodecError: A descriptor this dcp_ext does not know.
    """
    chain = tuple(transforms)
    for descriptor in chain:
        if not isinstance(descriptor, str) or not (
            descriptor == _ZSTD or _group_size(descriptor) or _planes_size(descriptor)
        ):
            raise UnsupportedCodecError(
                f"{where}: unknown codec transform {descriptor!r} in {list(chain)}; this "
                f"checkpoint was written by a newer or different dcp_ext. Known: "
                f"'zstd/1', 'bytegroup.K/1', 'zstd.planes.K/1' (K = 2, 4, 8)."
            )
    zstd_module()
    return chain


def _group(frame: memoryview, size: int) -> memoryview:
    if frame.nbytes % size:
        raise ValueError(f"frame of {frame.nbytes} bytes is not a whole number of {size}-byte elements")
    planes = np.frombuffer(frame, dtype=np.uint8).reshape(-1, size).T
    return np.ascontiguousarray(planes).data.cast("B")


def _ungroup(planes: Sequence[memoryview], out: memoryview, size: int) -> None:
    # Rebuild each element from its planes with shifts on little-endian
    # words: several times faster than a transposed byte copy.
    dst = np.frombuffer(out, dtype=f"<u{size}")
    np.copyto(dst, np.frombuffer(planes[0], dtype=np.uint8))
    for b in range(1, size):
        plane = np.frombuffer(planes[b], dtype=np.uint8).astype(dst.dtype)
        plane <<= 8 * b
        dst |= plane


def _split(data: memoryview, size: int) -> list[memoryview]:
    if data.nbytes % size:
        raise ValueError(f"{data.nbytes} bytes do not split into {size} planes")
    step = data.nbytes // size
    return [data[b * step : (b + 1) * step] for b in range(size)]


# zstd.planes header: one little-endian uint32 per plane, its stored length,
# with this bit set when the plane is stored raw (it did not compress).
_RAW_PLANE = 1 << 31


def _encode_planes(data: memoryview, size: int, level: int) -> bytes:
    header = np.zeros(size, dtype="<u4")
    parts: list[bytes | memoryview] = []
    compressor = _plane_compressor(level)
    for b, plane in enumerate(_split(data, size)):
        packed = compressor.compress(plane)
        if len(packed) < plane.nbytes:
            parts.append(packed)
            header[b] = len(packed)
        else:  # random mantissa bytes: storing them raw is smaller and free
            parts.append(plane)
            header[b] = plane.nbytes | _RAW_PLANE
    return b"".join([header.tobytes(), *parts])


def _decode_planes(stored: memoryview, size: int, raw_size: int) -> list[memoryview]:
    if raw_size % size:
        raise ValueError(f"{raw_size} bytes do not split into {size} planes")
    plane_size = raw_size // size
    if stored.nbytes < 4 * size:
        raise ValueError("frame is shorter than its plane header")
    header = np.frombuffer(stored[: 4 * size], dtype="<u4")
    pos = 4 * size
    planes: list[memoryview] = []
    for b in range(size):
        length = int(header[b]) & ~_RAW_PLANE
        part = stored[pos : pos + length]
        if part.nbytes != length:
            raise ValueError(f"plane {b} runs past the end of the frame")
        pos += length
        if int(header[b]) & _RAW_PLANE:
            if length != plane_size:
                raise ValueError(f"raw plane {b} holds {length} bytes, expected {plane_size}")
            planes.append(part)
        else:
            planes.append(memoryview(_decompress(part, plane_size)))
    if pos != stored.nbytes:
        raise ValueError(f"frame has {stored.nbytes - pos} bytes after its planes")
    return planes


def _decompress(data: memoryview | bytes, expected: int) -> bytes:
    # Check the size the frame header claims before decompressing, so a
    # damaged or hostile header cannot make us allocate it.
    claimed = zstd_module().frame_content_size(data)
    if claimed != expected:
        raise ValueError(f"zstd frame header claims {claimed} bytes, expected {expected}")
    raw: bytes = _decompressor().decompress(data)
    if len(raw) != expected:
        raise ValueError(f"zstd frame decodes to {len(raw)} bytes, expected {expected}")
    return raw


def encode_frame(transforms: tuple[str, ...], frame: memoryview, level: int = 1) -> bytes:
    """Apply ``transforms`` to one frame of raw bytes."""
    data: memoryview | bytes = frame
    for descriptor in transforms:
        group, planes = _group_size(descriptor), _planes_size(descriptor)
        if group:
            data = _group(memoryview(data), group)
        elif planes:
            data = _encode_planes(memoryview(data), planes, level)
        elif descriptor == _ZSTD:
            data = _compressor(level).compress(data)
        else:
            raise UnsupportedCodecError(f"unknown codec transform {descriptor!r}")
    return data if isinstance(data, bytes) else bytes(data)


def decode_frame(transforms: tuple[str, ...], stored: memoryview, out: memoryview) -> None:
    """Undo ``transforms`` on one stored frame, writing the raw bytes to ``out``.

    Every transform keeps the raw size, so each intermediate result has
    ``out.nbytes`` bytes.

    Raises:
        ValueError: The frame does not decode to exactly ``out.nbytes`` bytes.
        zstandard.ZstdError: The frame is not valid zstd.
    """
    chain = list(transforms)
    data: memoryview = stored
    planes: list[memoryview] | None = None
    while chain:
        descriptor = chain.pop()
        group, split = _group_size(descriptor), _planes_size(descriptor)
        if descriptor == _ZSTD:
            data, planes = memoryview(_decompress(data, out.nbytes)), None
        elif split:
            planes = _decode_planes(data, split, out.nbytes)
            if chain and _group_size(chain[-1]) == split:
                continue  # the byte grouping below reads the planes directly
            data, planes = memoryview(b"".join(planes)), None
        elif group:
            sources = planes if planes is not None else _split(data, group)
            target = out if not chain else memoryview(bytearray(out.nbytes))
            _ungroup(sources, target, group)
            data, planes = target, None
        else:
            raise UnsupportedCodecError(f"unknown codec transform {descriptor!r}")
    if data.nbytes != out.nbytes:
        raise ValueError(f"frame holds {data.nbytes} bytes, expected {out.nbytes}")
    if data.obj is not out.obj or data.nbytes != out.nbytes:
        out[:] = data
