"""Byte ranges: which bytes of which file a load needs, merged into requests.

Pure logic, no I/O. The reader turns each tensor slice it needs into
:class:`Piece` objects (a file range and the memory it must land in);
:func:`plan_requests` merges pieces of the same file that lie close together
into one :class:`ReadRequest` (object stores charge per request) and splits
large ones so several requests run in parallel.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# Holes up to this size are always read through (torch.save envelopes, padding).
_SMALL_HOLE = 8 * 1024

__all__ = ["Piece", "ReadRequest", "plan_requests", "box_runs", "run_starts", "BoxReadShape"]


@dataclass(frozen=True, slots=True, eq=False)
class Piece:
    """``length`` bytes at ``offset`` of file ``name``, to be copied into ``dest``.

    Attributes:
        on_done: Called once ``dest`` holds the bytes, by the thread that read
            them (checksums run there, while the bytes are still in cache).
    """

    name: str
    """The data file, relative to the store's root."""
    offset: int
    """Where the bytes start in the file."""
    dest: memoryview
    """Where the bytes go: a writable buffer of exactly the piece's length (often a
    tensor's memory)."""
    on_done: Callable[[], None] | None = None

    @property
    def length(self) -> int:
        """Bytes to copy: the size of ``dest``."""
        return self.dest.nbytes

    @property
    def end(self) -> int:
        """The file offset just past the piece (``offset + length``)."""
        return self.offset + self.dest.nbytes


@dataclass(frozen=True, slots=True, eq=False)
class ReadRequest:
    """One ranged read: ``length`` bytes at ``offset`` of ``name``.

    Attributes:
        targets: ``(position within this request, destination)`` pairs. The
            destinations may overlap the request only partly and never extend
            beyond it.
        on_done: Callbacks of the pieces this request completes; the store
            runs them after the bytes landed (see :meth:`Store.read`).
        done_at: For each of ``on_done``, the position within this request
            where its piece ends: a store that reads the request front to
            back in steps may run it as soon as that many bytes landed (the
            local store does, so frame checksums read bytes still in the CPU
            cache). Empty: run every callback at the end.
    """

    name: str
    """The data file, relative to the store's root."""
    offset: int
    """Where the request starts in the file."""
    length: int
    """Bytes the request fetches (one ranged GET or ``preadv``, up to
    ``IOConfig.read_request_size``)."""
    targets: tuple[tuple[int, memoryview], ...]
    on_done: tuple[Callable[[], None], ...] = ()
    done_at: tuple[int, ...] = ()

    @property
    def is_direct(self) -> bool:
        """True when the request lands straight in one destination (no copy)."""
        if len(self.targets) != 1:
            return False
        pos, dest = self.targets[0]
        return pos == 0 and dest.nbytes == self.length


def plan_requests(
    pieces: Iterable[Piece], *, gap: int, max_request: int
) -> list[ReadRequest]:
    """Merge and split pieces into read requests.

    Pieces of one file whose gap is at most ``gap`` bytes are fetched by one
    request, as long as the request stays within ``max_request`` bytes and
    the hole is no larger than the bytes wanted so far (holes under 8 KiB
    always merge): merging saves requests without ever doubling the bytes. A
    piece larger than ``max_request`` becomes several direct requests, each
    reading into its own slice of the destination.

    Args:
        pieces: What to read; empty pieces are dropped.
        gap: Largest hole (bytes) worth reading through to save a request.
        max_request: Largest merged request, bytes.

    Returns:
        Requests ordered by file then offset.
    """
    by_name: dict[str, list[Piece]] = {}
    for piece in pieces:
        if piece.length:
            by_name.setdefault(piece.name, []).append(piece)

    requests: list[ReadRequest] = []
    for name in sorted(by_name):
        requests.extend(_merge_file(name, by_name[name], gap, max_request))
    return requests


def _group_request(name: str, group: list[Piece]) -> ReadRequest:
    start = group[0].offset
    end = max(p.end for p in group)
    done = [p for p in group if p.on_done is not None]
    return ReadRequest(
        name,
        start,
        end - start,
        tuple((p.offset - start, p.dest) for p in group),
        tuple(p.on_done for p in done if p.on_done is not None),
        tuple(p.end - start for p in done),
    )


class _AfterAll:
    """Runs a piece's callback once every request it was split into is done
    (they may complete in any order, on different threads)."""

    def __init__(self, parts: int, callback: Callable[[], None]) -> None:
        self._left = parts
        self._callback = callback
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._callback()


def _merge_file(name: str, pieces: list[Piece], gap: int, max_request: int) -> list[ReadRequest]:
    """:func:`plan_requests` for the pieces of one file."""
    requests: list[ReadRequest] = []
    group: list[Piece] = []
    start = end = useful = 0
    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.length > max_request:
            if group:
                requests.append(_group_request(name, group))
                group = []
            parts = range(0, piece.length, max_request)
            done = () if piece.on_done is None else (_AfterAll(len(parts), piece.on_done),)
            for pos in parts:
                dest = piece.dest[pos : pos + max_request]
                requests.append(
                    ReadRequest(name, piece.offset + pos, dest.nbytes, ((0, dest),), done, (dest.nbytes,) * len(done))
                )
            continue
        hole = piece.offset - end
        # A hole is read through only if it is small in absolute terms (gap)
        # and relative to what the request delivers, so merging never more
        # than doubles the bytes read (plus _SMALL_HOLE).
        if group and (
            hole > min(gap, max(_SMALL_HOLE, useful + piece.length))
            or max(end, piece.end) - start > max_request
        ):
            requests.append(_group_request(name, group))
            group = []
        if not group:
            start, end, useful = piece.offset, piece.end, 0
        else:
            end = max(end, piece.end)
        useful += piece.length
        group.append(piece)
    if group:
        requests.append(_group_request(name, group))
    return requests


@dataclass(frozen=True, slots=True)
class BoxReadShape:
    """How a box (sub-block) of a row-major chunk lies in the chunk's bytes.

    Attributes:
        first: Element index (in the chunk) of the box's first element.
        span: Elements from ``first`` to the box's last element, inclusive.
        run: Elements in each contiguous run of the box.
        runs: Number of runs; ``runs * run`` elements are wanted.
        cut: Innermost dimension the box cuts (runs vary over the ones before).
        strides: Row-major element strides of the chunk.
    """

    first: int
    span: int
    run: int
    runs: int
    cut: int
    strides: tuple[int, ...]


def _row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(sizes[d + 1]), 1)
    return tuple(strides)


def box_runs(
    sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
) -> BoxReadShape:
    """Describe the box ``offsets``/``lengths`` of a row-major chunk of ``sizes``.

    A 0-d chunk is one element; a box with a zero length is empty
    (``runs == 0``).

    Raises:
        ValueError: The box does not fit inside the chunk.
    """
    if not (len(sizes) == len(offsets) == len(lengths)):
        raise ValueError(
            f"box rank mismatch: chunk {tuple(sizes)}, offsets {tuple(offsets)}, "
            f"lengths {tuple(lengths)}"
        )
    for size, off, length in zip(sizes, offsets, lengths):
        if off < 0 or length < 0 or off + length > size:
            raise ValueError(
                f"box offsets {tuple(offsets)} lengths {tuple(lengths)} "
                f"exceed chunk {tuple(sizes)}"
            )
    strides = _row_major_strides(sizes)
    if any(length == 0 for length in lengths):
        return BoxReadShape(0, 0, 0, 0, 0, strides)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    # The innermost dimension, scanning from the right, that the box cuts.
    cut = -1
    for d in range(len(sizes) - 1, -1, -1):
        if lengths[d] != sizes[d]:
            cut = d
            break
    if cut <= 0:
        # Whole chunk, or a cut only in the leading dimension: one run.
        run = last - first + 1
        return BoxReadShape(first, run, run, 1, 0, strides)
    run = int(lengths[cut]) * strides[cut]
    runs = math.prod(int(n) for n in lengths[:cut])
    return BoxReadShape(first, last - first + 1, run, runs, cut, strides)


def run_starts(shape: BoxReadShape, offsets: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """Element index (in the chunk) where each run of the box starts, in order."""
    if shape.runs <= 1:
        return [shape.first] if shape.runs == 1 else []
    starts = [int(offsets[shape.cut]) * shape.strides[shape.cut]]
    for d in range(shape.cut - 1, -1, -1):
        step = shape.strides[d]
        base = int(offsets[d]) * step
        starts = [base + i * step + s for i in range(int(lengths[d])) for s in starts]
    return starts
