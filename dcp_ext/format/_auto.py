"""``compression="auto"``: compress an item only where a sample says it pays; :func:`resolve_codec`.

Compression costs CPU at every save and pays only in bytes not written. On
incompressible data (random or already-quantized weights, optimizer moments
after some steps) zstd with byte grouping reaches a ratio near 1.0 and costs
its full encode time anyway: in ``bench.frameworks`` on 2 cores it made
torchtitan's local save 1.08x torch's instead of 2.11x (issue 44).

:class:`AutoCodec` decides per stored item, before any of its frames is
encoded. It encodes a sample of the item (at most ``sample_bytes`` from its
middle) with the codec it wraps and times it (thread CPU time), and knows how
fast this process has been writing to the same kind of store and encoding
with the same transforms (:class:`WriteRates`, fed by
:class:`~dcp_ext.frames.FrameEncoder` with the time each ``write`` took,
back-pressure included, and the CPU time of each frame it encoded). Writing ``n`` bytes raw costs
``n / W``; compressing them first costs ``n / (E * t) + n / (r * W)``
(``E``: encode bytes per CPU second, ``t``: encoder threads, one core left for
writing; ``r``: the sample's ratio). The item is compressed only when that is
cheaper and ``r`` reaches ``min_ratio``, i.e. when
``r >= max(min_ratio, 1 / (1 - W / (E * t)))``; until the process has written
``_MIN_MEASURED`` bytes to that kind of store, ``min_ratio`` alone decides.

The choice is recorded per item in the metadata as every codec is: a
compressed item carries its transform chain and frame lengths, a raw one none
(and, when it is a tensor, the ``torch.save`` envelope of an uncompressed save,
so a checkpoint in which nothing paid is a plain one that torch's readers load
too). Loads stay seekable and verified either way; readers need no setting.
Items smaller than ``min_item_bytes`` are stored raw. When many items of one
dtype in a row get the same answer, only every ``_PROBE_EVERY``-th is sampled
(the others take the last answer), so a state of thousands of small tensors
pays for a few samples, not for one per tensor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedCodecError
from ._codecs import Codec, ZstdCodec, zstd_module

__all__ = ["AutoCodec", "WriteRates", "write_rates", "encode_rates", "resolve_codec"]

# Bytes a process must have written to a kind of store before its measured
# speed counts (the first parts of an S3 upload fill buffers at memory speed).
_MIN_MEASURED = 64 << 20
# After this many equal answers in a row for one dtype, sample 1 item in _PROBE_EVERY.
_STREAK = 4
_PROBE_EVERY = 8


class WriteRates:
    """Bytes per second this process has moved, per kind (of store writer:
    its class name; of encoding: its transforms), over the most recent
    ``window`` bytes; a rate counts once ``min_bytes`` were seen."""

    def __init__(self, window: int = 1 << 30, min_bytes: int = _MIN_MEASURED) -> None:
        self._window = window
        self._min_bytes = min_bytes
        self._lock = threading.Lock()
        self._seen: dict[object, tuple[float, float]] = {}  # kind -> (bytes, seconds), decayed

    def note(self, kind: object, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` of ``kind`` took ``seconds``."""
        if nbytes <= 0:
            return
        with self._lock:
            total, spent = self._seen.get(kind, (0.0, 0.0))
            total, spent = total + nbytes, spent + max(seconds, 0.0)
            if total > self._window:  # keep the recent past: scale both down
                scale = self._window / total
                total, spent = total * scale, spent * scale
            self._seen[kind] = (total, spent)

    def rate(self, kind: object) -> float | None:
        """Bytes per second of ``kind``, or ``None`` before ``min_bytes``."""
        with self._lock:
            total, spent = self._seen.get(kind, (0.0, 0.0))
        if total < max(self._min_bytes, 1):
            return None
        return total / spent if spent > 0 else float("inf")

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


#: This process's write rates per store writer class (saves learn from earlier ones).
write_rates = WriteRates()
#: This process's encode rates per transform chain, in bytes per CPU second
#: (every encoded frame and every sample counts).
encode_rates = WriteRates(window=256 << 20, min_bytes=1)


@dataclass
class _Streak:
    answer: bool = False
    count: int = 0
    skipped: int = 0


@dataclass(frozen=True)
class AutoCodec:
    """Compress each item with ``codec`` only where a sample shows it pays.

    Attributes:
        codec: The codec used where compression pays (default: zstd level 1
            with byte grouping, as ``compression="zstd"``).
        min_ratio: The least sample ratio (raw / stored) worth any CPU
            (default 1.1: below, at most 9% of the bytes would be saved).
        sample_bytes: Bytes of each item encoded to decide (from its middle).
        min_item_bytes: Items smaller than this are stored raw.
        name: ``"auto"``.
    """

    codec: ZstdCodec | Codec = field(default_factory=ZstdCodec)
    min_ratio: float = 1.1
    sample_bytes: int = 64 << 10
    min_item_bytes: int = 64 << 10
    name: str = "auto"
    _streaks: dict[tuple[str, torch.dtype | None], _Streak] = field(
        default_factory=dict, compare=False, repr=False, hash=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if not self.min_ratio >= 1.0:
            raise ValueError(f"min_ratio must be >= 1.0, got {self.min_ratio!r}")
        if self.sample_bytes < 4096:
            raise ValueError(f"sample_bytes must be >= 4096, got {self.sample_bytes}")

    def __getstate__(self) -> dict[str, object]:  # process-based uploads pickle the writer
        return {"codec": self.codec, "min_ratio": self.min_ratio, "sample_bytes": self.sample_bytes,
                "min_item_bytes": self.min_item_bytes, "name": self.name}

    def __setstate__(self, state: dict[str, object]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_streaks", {})
        object.__setattr__(self, "_lock", threading.Lock())

    def transforms(self, dtype: torch.dtype | None) -> tuple[str, ...]:
        """The transforms of an item of ``dtype`` where it is compressed."""
        return self.codec.transforms(dtype)

    def encode(self, transforms: tuple[str, ...], frame: memoryview) -> bytes:
        return self.codec.encode(transforms, frame)

    def threshold(self, encode_rate: float, write_rate: float | None, threads: int) -> float:
        """The least ratio at which compressing pays (``inf``: never)."""
        if write_rate is None:
            return self.min_ratio
        spare = 1.0 - write_rate / (encode_rate * max(1, threads - 1))
        if spare <= 0:
            return float("inf")
        return max(self.min_ratio, 1.0 / spare)

    def sample(self, dtype: torch.dtype | None, raw: memoryview) -> tuple[float, float]:
        """(ratio, encode bytes per CPU second) of a sample from the middle of ``raw``."""
        transforms = self.transforms(dtype)
        unit = 8  # whole elements for byte grouping (every element size divides 8)
        size = min(raw.nbytes, self.sample_bytes) // unit * unit
        start = (raw.nbytes - size) // 2 // unit * unit
        piece = raw[start : start + size]
        began = time.thread_time()
        stored = len(self.codec.encode(transforms, piece))
        spent = max(time.thread_time() - began, 1e-6)
        encode_rates.note(transforms, size, spent)
        return size / max(stored, 1), size / spent

    def choose(self, dtype: torch.dtype | None, raw: memoryview, writer_kind: str, threads: int) -> bool:
        """Whether to compress an item of ``dtype`` with raw bytes ``raw``,
        written to a ``writer_kind`` store by ``threads`` encoder threads."""
        if raw.nbytes < self.min_item_bytes or raw.nbytes < 4096:
            return False
        key = (writer_kind, dtype)
        with self._lock:
            streak = self._streaks.setdefault(key, _Streak())
            if streak.count >= _STREAK and streak.skipped < _PROBE_EVERY - 1:
                streak.skipped += 1
                return streak.answer
            streak.skipped = 0
        ratio, sampled_rate = self.sample(dtype, raw)
        encode_rate = encode_rates.rate(self.transforms(dtype)) or sampled_rate  # the sample's counted in it
        answer = ratio >= self.threshold(encode_rate, write_rates.rate(writer_kind), threads)
        with self._lock:
            if answer == streak.answer:
                streak.count += 1
            else:
                streak.answer, streak.count = answer, 1
        return answer


def resolve_codec(compression: object) -> Codec | None:
    """The codec for a writer's ``compression=`` argument.

    Args:
        compression: ``None`` (store raw bytes), ``"zstd"``, ``"auto"`` (zstd
            only for the items where a sample shows it pays:
            :class:`~dcp_ext.format.AutoCodec`), or a :class:`Codec` such as
            ``ZstdCodec(level=1)``.

    Raises:
        UnsupportedCodecError: Anything else, or zstandard is not installed.
    """
    if compression is None or compression is False:
        return None
    if isinstance(compression, str):
        name = compression.lower()
        if name not in ("zstd", "auto"):
            raise UnsupportedCodecError(
                f"unknown compression {compression!r}; use None, 'zstd', 'auto' or a codec object "
                f"such as dcp_ext.ZstdCodec(level=1)"
            )
        compression = AutoCodec() if name == "auto" else ZstdCodec()
    if not isinstance(compression, Codec):
        raise UnsupportedCodecError(
            f"compression must be None, 'zstd' or a codec object, got {type(compression).__name__}"
        )
    zstd_module()
    return compression
