"""Block-scaled FP8 weights (DeepSeek-V3 style Hugging Face checkpoints): pairing and dequantization.

Such checkpoints store a quantized weight ``X.weight`` as ``float8_e4m3fn``
beside ``X.weight_scale_inv`` (``float32``, shape ``[ceil(rows / 128),
ceil(cols / 128)]``): each 128 x 128 block of the weight, the last ones
possibly smaller, is multiplied by its scale to get the real value. The
arithmetic is ``weight.to(float32) * scale`` elementwise, then a cast to the
model's dtype, so a slice dequantized on one rank equals the same slice of the
whole tensor dequantized at once, bit for bit.

:func:`dcp_ext.load_pretrained` reads each rank's slice of the FP8 weight and
the scale blocks that slice touches (:func:`scale_box`), then calls
:func:`dequantize_slice`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from ..errors import CheckpointCorruptError, ReshardError
from ..format import tensor_bytes
from ..frames import FrameTable, checksum_fault
from ..metadata import StoredItem
from ..storage import Piece, Store, plan_requests
from ._torch_zip import StoredTensor

__all__ = [
    "FP8Scale",
    "dequantize_all",
    "fp8_like",
    "FP8_DTYPES",
    "SCALE_SUFFIX",
    "ScaleBox",
    "block_shape",
    "dequantize_slice",
    "paired_scales",
    "scale_box",
    "scale_shape",
]

FP8_DTYPES = frozenset({
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
})
#: The scale of weight ``K`` is stored as ``K + SCALE_SUFFIX``.
SCALE_SUFFIX = "_scale_inv"


def block_shape(block: int | tuple[int, int]) -> tuple[int, int]:
    """``128`` -> ``(128, 128)``; checks both sides are positive."""
    rows, cols = (block, block) if isinstance(block, int) else tuple(block)
    if not (isinstance(rows, int) and isinstance(cols, int) and rows > 0 and cols > 0):
        raise ValueError(f"fp8_block_size must be a positive int or a pair of them, got {block!r}")
    return rows, cols


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape the scale of a 2-D weight of ``shape`` must have."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def paired_scales(
    dtypes: Mapping[str, torch.dtype], shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, str]:
    """``{weight key: scale key}`` for every 2-D FP8 tensor that has a ``*_scale_inv`` beside it."""
    return {
        key: key + SCALE_SUFFIX
        for key, dtype in dtypes.items()
        if dtype in FP8_DTYPES and len(shapes[key]) == 2 and key + SCALE_SUFFIX in dtypes
    }


@dataclass(frozen=True)
class ScaleBox:
    """The scale blocks ``[row0, row1) x [col0, col1)`` a weight slice touches."""

    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.row1 - self.row0, self.col1 - self.col0


def scale_box(offsets: tuple[int, int], lengths: tuple[int, int], block: tuple[int, int]) -> ScaleBox:
    """The scale blocks covering the weight slice at ``offsets`` of size ``lengths``."""
    (r, c), (nr, nc) = offsets, lengths
    return ScaleBox(r // block[0], -(-(r + nr) // block[0]), c // block[1], -(-(c + nc) // block[1]))


def dequantize_slice(
    values: torch.Tensor,
    offsets: tuple[int, int],
    scales: torch.Tensor,
    box: ScaleBox,
    block: tuple[int, int],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantize the slice ``values`` (FP8) of a weight, found at ``offsets`` in it.

    Args:
        values: The slice, of an FP8 dtype.
        offsets: Where the slice starts in the whole weight.
        scales: The scale blocks ``box`` (``box.shape``).
        box: Which scale blocks ``scales`` holds (:func:`scale_box`).
        block: The block shape.
        dtype: The result's dtype.

    Returns:
        ``(values.to(float32) * scale).to(dtype)``, each element with its block's scale.
    """
    rows, cols = values.shape
    out = torch.empty((rows, cols), dtype=dtype, device=values.device)
    if rows == 0 or cols == 0:
        return out
    first_col = offsets[1] - box.col0 * block[1]
    # One row of blocks at a time: the temporaries stay block-rows high, not
    # as large as the slice (a slice of a big expert matrix is hundreds of MB).
    per_column = scales.to(torch.float32).repeat_interleave(block[1], 1)[:, first_col : first_col + cols]
    per_column = per_column.to(values.device)
    for i in range(box.row0, box.row1):
        start = max(i * block[0], offsets[0]) - offsets[0]
        stop = min((i + 1) * block[0], offsets[0] + rows) - offsets[0]
        if stop > start:
            out[start:stop] = (values[start:stop].to(torch.float32) * per_column[i - box.row0]).to(dtype)
    return out


@dataclass(frozen=True)
class FP8Scale:
    """The scale of a block-scaled FP8 weight: checkpoint keys of both, where the scale is."""

    weight_key: str
    scale_key: str
    tensor: StoredTensor
    stored: StoredItem  # with its frame checksums when the folder's sidecar has them


def _local_part(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of a (possibly DTensor) tensor and its offset in the whole."""
    if not isinstance(value, DTensor):
        return value, (0,) * value.dim()
    local = value.to_local()
    create_chunks: Any = value.__create_chunk_list__  # what DCP plans this rank's reads from
    chunks: list[Any] = create_chunks()
    if not chunks:
        return local, (0,) * value.dim()
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ReshardError(
            f"cannot dequantize a DTensor placed as {value.placements}: its local part is not one box"
        )
    return local, tuple(int(o) for o in chunks[0].offsets)


def fp8_like(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``dtype`` tensor with ``value``'s shape and, for a DTensor, its placement."""
    if not isinstance(value, DTensor):
        return torch.empty(value.shape, dtype=dtype, device=value.device)
    local = value.to_local()
    return DTensor.from_local(
        torch.empty(local.shape, dtype=dtype, device=local.device), value.device_mesh, value.placements,
        run_check=False, shape=value.shape, stride=value.stride(),
    )


def dequantize_all(
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, FP8Scale]],
    store: Store,
    read_request_size: int,
    block: tuple[int, int],
) -> None:
    """(all ranks) For each ``key: (target, fp8, scale)``, scale this rank's part
    of ``fp8`` into this rank's part of ``target``.

    The scale blocks of all weights are fetched in one parallel batch of
    ranged reads: a model with thousands of FP8 weights on S3 must not wait
    for one round trip per weight.
    """
    jobs = []
    pieces: list[Piece] = []
    checks: list[tuple[FP8Scale, torch.Tensor]] = []
    for target, fp8, scale in weights.values():
        where = store.describe(scale.tensor.file)
        expected = scale_shape(tuple(target.shape), block)
        if scale.tensor.shape != expected:
            raise CheckpointCorruptError(
                f"{where}: scale {scale.scale_key!r} of {scale.weight_key!r} {tuple(target.shape)} has shape "
                f"{scale.tensor.shape}, but {block[0]}x{block[1]} blocks need {expected}; pass the checkpoint's "
                f"fp8_block_size",
                where,
            )
        if not scale.tensor.dtype.is_floating_point or scale.tensor.dtype in FP8_DTYPES:
            raise CheckpointCorruptError(f"{where}: scale {scale.scale_key!r} is {scale.tensor.dtype}", where)
        local, offsets = _local_part(target)
        values, _ = _local_part(fp8)
        if local.numel() == 0:
            continue
        box = scale_box((offsets[0], offsets[1]), (local.shape[0], local.shape[1]), block)
        if scale.stored.checksums:
            # Checksums cover whole frames: read the whole scale (1/16384 of
            # its weight's elements for 128 x 128 blocks), check it, then slice.
            whole = torch.empty(scale.tensor.shape, dtype=scale.tensor.dtype)
            pieces.append(Piece(scale.tensor.file, scale.tensor.offset, tensor_bytes(whole)))
            checks.append((scale, whole))
            scales = whole[box.row0 : box.row1, box.col0 : box.col1]
        else:
            scales = torch.empty(box.shape, dtype=scale.tensor.dtype)
            pieces += _scale_pieces(scale.tensor, box, scales)
        jobs.append((local, values, offsets, scales, box))
    store.read(plan_requests(pieces, gap=store.coalesce_gap, max_request=read_request_size))
    for scale, whole in checks:
        _check_scale(scale, tensor_bytes(whole), store.describe(scale.tensor.file))
    with torch.no_grad():
        for local, values, offsets, scales, box in jobs:
            local.copy_(dequantize_slice(values, (offsets[0], offsets[1]), scales, box, block, local.dtype))


def _check_scale(scale: FP8Scale, raw: memoryview, where: str) -> None:
    """Check every frame of a scale read whole against its recorded checksums.

    Raises:
        ChecksumMismatchError: A frame's bytes differ from what was recorded.
    """
    table = FrameTable(scale.stored)
    for k in range(len(table)):
        frame = table.frame(k)
        fault = checksum_fault(frame, raw[frame.raw_start : frame.raw_end])
        if fault is not None:
            raise fault.error(where, MetadataIndex(scale.scale_key), frame)


def _scale_pieces(info: StoredTensor, box: ScaleBox, out: torch.Tensor) -> list[Piece]:
    """Ranged reads of the scale blocks ``box`` of the scale tensor ``info`` into
    ``out``: one per row of blocks (rows next to each other merge into one request)."""
    view = tensor_bytes(out)
    esize = info.dtype.itemsize
    width = (box.col1 - box.col0) * esize
    cols = info.shape[1]
    return [
        Piece(info.file, info.offset + (row * cols + box.col0) * esize, view[i * width : (i + 1) * width])
        for i, row in enumerate(range(box.row0, box.row1))
    ]
