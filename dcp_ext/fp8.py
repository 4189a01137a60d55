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

import torch

__all__ = [
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
