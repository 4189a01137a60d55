"""Planning a Hugging Face export: shard files, their writer ranks, and where each tensor's bytes come from.

Pure functions over shapes, dtypes and byte counts: no I/O, no collectives.
Every rank of an export computes the same plan from the same inputs
(:mod:`dcp_ext.hf._export` runs them).

The folder a plan describes is what ``transformers``' ``save_pretrained``
writes: ``model-00001-of-0000N.safetensors`` files (``model.safetensors``
when there is one), each at most ``max_shard_size`` bytes of tensor data
unless a single tensor is larger, tensors in state-dict key order, and
``model.safetensors.index.json`` mapping every key to its file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..config import parse_size
from ..errors import DcpExtError

__all__ = [
    "HF_INDEX_FILE",
    "HF_SINGLE_FILE",
    "HF_CONFIG_FILE",
    "HFTensor",
    "HFFile",
    "Box",
    "Transfer",
    "parse_shard_size",
    "shard_name",
    "plan_files",
    "assign_writers",
    "plan_transfers",
    "index_document",
    "is_shard_name",
    "stale_shards",
]

HF_INDEX_FILE = "model.safetensors.index.json"
HF_SINGLE_FILE = "model.safetensors"
HF_CONFIG_FILE = "config.json"
_NUMBERED = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


@dataclass(frozen=True)
class HFTensor:
    """A tensor as the export stores it.

    Attributes:
        name: Its key in the folder.
        dtype: The dtype written (after ``dtype=`` casting).
        shape: Its global shape.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class HFFile:
    """One safetensors file of the export.

    Attributes:
        name: Its file name in the folder.
        tensors: Indexes (into the export's tensor list) of the tensors it holds, in order.
        nbytes: Bytes of tensor data it holds (its header not included).
    """

    name: str
    tensors: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Box:
    """A rectangular slice of a tensor: global ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _numel(self.sizes)

    def overlaps(self, other: Box) -> bool:
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )


@dataclass(frozen=True)
class Transfer:
    """Where one slice of a tensor comes from when its file's writer assembles it.

    Attributes:
        source: The rank (of the export's group) that provides the slice.
        box: The slice.
    """

    source: int
    box: Box


def parse_shard_size(value: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as ``"5GB"`` (10**9
    bytes per GB, as Hugging Face counts), ``"500MB"`` or ``"2GiB"``.

    Unlike ``transformers``, a lowercase ``b`` does not mean bits.

    Raises:
        ValueError: Not a size, or not positive.
    """
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return size


def shard_name(index: int, count: int) -> str:
    """The name of file ``index`` (from 0) of ``count``, as ``transformers`` names it."""
    if count == 1:
        return HF_SINGLE_FILE
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is a weights file an export writes (single or numbered)."""
    return name == HF_SINGLE_FILE or _NUMBERED.fullmatch(name) is not None


def plan_files(tensors: Sequence[HFTensor], max_shard_size: int) -> tuple[HFFile, ...]:
    """Split ``tensors`` (in order) into files of at most ``max_shard_size`` bytes of data.

    A tensor larger than the limit gets a file of its own (the files before
    and after it keep the key order). A state with no tensors gives one empty
    file.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, tensor in enumerate(tensors):
        nbytes = tensor.nbytes
        if current and size + nbytes > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current or not groups:
        groups.append(current)
    count = len(groups)
    return tuple(
        HFFile(shard_name(k, count), tuple(group), sum(tensors[i].nbytes for i in group))
        for k, group in enumerate(groups)
    )


def assign_writers(
    files: Sequence[HFFile],
    world_size: int,
    local_bytes: Sequence[Sequence[int]] | None = None,
) -> tuple[int, ...]:
    """The rank that writes each file.

    Files are handed out largest first (ties: in file order), each to the
    rank that holds most of its bytes locally among the ranks it fits on
    without going over an even share of the bytes (``max(total / world,
    largest file)``); ties go to the rank with the fewest bytes so far, then
    the lowest rank. When no rank has room left the least loaded one takes
    it. So every rank writes about the same amount, and a file whose tensors
    a rank holds whole (replicated, or not sharded) is written where no bytes
    need to move.

    Args:
        files: The files.
        world_size: Ranks of the export.
        local_bytes: ``local_bytes[f][r]``: bytes of file ``f`` that rank
            ``r`` holds (``None``: none are held, as when reading storage).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(f.nbytes for f in files)
    cap = max(-(-total // world_size), max((f.nbytes for f in files), default=0))
    load = [0] * world_size
    owners = [0] * len(files)
    for f in sorted(range(len(files)), key=lambda k: (-files[k].nbytes, k)):
        size = files[f].nbytes
        held = local_bytes[f] if local_bytes is not None else [0] * world_size
        fitting = [r for r in range(world_size) if load[r] + size <= cap]
        if fitting:
            rank = min(fitting, key=lambda r: (-held[r], load[r], r))
        else:
            rank = min(range(world_size), key=lambda r: (load[r], -held[r], r))
        owners[f] = rank
        load[rank] += size
    return tuple(owners)


def plan_transfers(
    name: str, shape: tuple[int, ...], writer: int, held: Sequence[Sequence[Box]]
) -> tuple[Transfer, ...]:
    """The slices a file's writer assembles tensor ``name`` from, and who sends each.

    A slice several ranks hold (replicated tensors, plain tensors) comes from
    one of them: the writer itself if it holds it (no bytes move), else the
    lowest such rank. Empty slices (uneven sharding) are skipped.

    Args:
        name: The tensor's key (for messages).
        shape: Its global shape.
        writer: The rank that writes its file.
        held: ``held[r]``: the slices rank ``r`` holds.

    Raises:
        DcpExtError: The slices overlap without being equal, or do not cover
            the tensor.
    """
    holders: dict[Box, list[int]] = {}
    for rank, boxes in enumerate(held):
        for box in boxes:
            if box.numel:
                holders.setdefault(box, []).append(rank)
    # A tensor some rank holds whole (replicated, or not sharded) comes from
    # one such rank, the writer if it is one: nothing else is needed.
    whole = Box((0,) * len(shape), tuple(shape))
    if whole in holders:
        return (Transfer(writer if writer in holders[whole] else holders[whole][0], whole),)
    boxes = list(holders)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.overlaps(b):
                raise DcpExtError(
                    f"tensor {name!r}: ranks {holders[a]} hold slice {list(a.offsets)}+{list(a.sizes)} and ranks "
                    f"{holders[b]} hold {list(b.offsets)}+{list(b.sizes)}, which overlap; an export needs each "
                    f"element held as one rectangular slice (redistribute the DTensor first)"
                )
    for box in boxes:
        if any(o < 0 or o + s > d for o, s, d in zip(box.offsets, box.sizes, shape)) or len(box.sizes) != len(shape):
            raise DcpExtError(
                f"tensor {name!r}: slice {list(box.offsets)}+{list(box.sizes)} held by ranks {holders[box]} lies "
                f"outside its shape {list(shape)}"
            )
    covered = sum(b.numel for b in boxes)
    if covered != _numel(shape):
        raise DcpExtError(
            f"tensor {name!r}: the ranks hold {covered} of its {_numel(shape)} elements (shape {list(shape)}); "
            f"every element must be held by some rank of the export's group"
        )
    return tuple(
        Transfer(writer if writer in holders[b] else holders[b][0], b)
        for b in sorted(boxes, key=lambda b: b.offsets)
    )


def index_document(tensors: Sequence[HFTensor], files: Sequence[HFFile]) -> bytes:
    """``model.safetensors.index.json`` as ``transformers`` writes it:
    ``{"metadata": {"total_size": ...}, "weight_map": {key: file}}``, keys sorted, indent 2."""
    weight_map = {tensors[i].name: f.name for f in files for i in f.tensors}
    document = {"metadata": {"total_size": sum(f.nbytes for f in files)}, "weight_map": weight_map}
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def config_document(config_json: Mapping[str, object] | str, where: str) -> bytes:
    """``config.json``: a dict as ``transformers`` writes it, a string as given
    (checked to be a JSON object).

    Raises:
        ValueError: The string is not a JSON object.
    """
    if isinstance(config_json, str):
        try:
            parsed = json.loads(config_json)
        except ValueError as err:
            raise ValueError(f"config_json for {where} is not valid JSON: {err}") from err
        if not isinstance(parsed, dict):
            raise ValueError(f"config_json for {where} must be a JSON object, got {type(parsed).__name__}")
        return config_json.encode()
    return (json.dumps(dict(config_json), indent=2, sort_keys=True) + "\n").encode()


def stale_shards(existing: Sequence[str], written: Sequence[str]) -> list[str]:
    """Weights files of an earlier export (``existing``) that this one (``written``) did not rewrite."""
    keep = set(written)
    return sorted(n for n in existing if is_shard_name(n) and n not in keep)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
